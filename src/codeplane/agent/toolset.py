"""The tool framework: `Tool` objects, JSON-schema'd, each a function of (Environment, args,
ctx), gathered in a `Toolset`; the typed `ToolContext` a run's calls share, with the services
its caller injected (`ToolServices`: codebase search and the apply merge).

`Toolset.execute()` is the only entry point - the agent loop, `codeplane tool`, the server,
background agents and RL episodes all call it, so arguments, errors and result formats are the
same everywhere. Tools touch the workspace only through `env.workspace` (read, write, stat,
list, exec), so they run unchanged on every workspace backend, and reach anything else only
through `ctx.services`, which the program's composition root builds once (a tool reads no
settings). Tools never raise at the caller: a failure is a result with `ok=False` whose text
tells the model what to do instead. Results longer than `max_chars` are cut at a line boundary
with a note saying how much was shown and how to see the rest.

The tools themselves live in `agent/tools/`, one module per kind; `agent/tools/__init__.py`
holds the one table of them.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from codeplane.agent.env import Environment, ToolError

if TYPE_CHECKING:  # apply loads the engine's modules: only a code_edit call pays for them
    from codeplane.apply.service import ApplyResult
    from codeplane.models.engine import Engine

MAX_CHARS = 8000
ADVANCED_ARGS = ("code_edit", "case_sensitive")  # optional arguments the core set leaves out


class SearchUnavailable(Exception):
    """Codebase search cannot answer for this workspace (not indexed, no index configured,
    the search server unreachable); the message says what a user can do."""


class CodeSearch(Protocol):
    """What `codebase_search` needs: the index's hits for a workspace, best first."""

    def search(self, env: Environment, query: str, limit: int,
               files: bool) -> list[dict[str, Any]]:
        """[{path, start_line, end_line, score, snippet}], paths workspace-relative, snippets
        read through `env.workspace`; `files` ranks whole files. SearchUnavailable if the
        workspace cannot be searched."""


class Charge(Protocol):
    used: int  # tokens the metered work used, set by the work


# Holds an upper-bound guess of tokens against a caller's limits before model work runs and
# settles what its charge says after; raises ToolError when the caller's limits refuse it.
Metering = Callable[[int], AbstractContextManager[Charge]]


class EditMerge(Protocol):
    """What `edit_file`'s `code_edit` needs: a sketch merged into a file's text."""

    def merge(self, original: str, edit: str, path: str) -> ApplyResult:
        """The merged text, deterministic merge first, then the model where one is held."""

    def charged(self, meter: Metering) -> EditMerge:
        """This merge with its model work charged through `meter` (one run's caller)."""


class NoIndex:
    """Search for a program that holds no index (RL episodes, a toolset built bare)."""

    def search(self, env: Environment, query: str, limit: int,
               files: bool) -> list[dict[str, Any]]:
        raise SearchUnavailable("this run has no codebase index")


class ApplyMerge:
    """Apply's merge with the engine and model the program holds: `engine=None` (a client
    that holds no engine: `codeplane agent`, `codeplane tool`, RL) merges deterministically
    only, as `/v1/apply` with method "deterministic"; with an engine, as its "auto"."""

    def __init__(self, engine: Engine | None = None, model: str = "code-small",
                 meter: Metering | None = None) -> None:
        self.engine, self.model, self.meter = engine, model, meter

    def merge(self, original: str, edit: str, path: str) -> ApplyResult:
        """As `/v1/apply` "auto": the free path first; the model only once it declined,
        charged through the meter when there is one."""
        from codeplane.apply.service import apply_edit, estimated_tokens

        free = apply_edit(original, edit, path, method="deterministic")
        if free.ok or self.engine is None:
            return free
        if self.meter is None:
            return apply_edit(original, edit, path, self.engine, self.model)
        with self.meter(estimated_tokens(original, edit)) as charge:
            result = apply_edit(original, edit, path, self.engine, self.model)
            charge.used = result.model_tokens()
        return result

    def charged(self, meter: Metering) -> ApplyMerge:
        return ApplyMerge(self.engine, self.model, meter)


@dataclass(frozen=True)
class ToolServices:
    """What tools reach beyond the workspace, built once by the program's composition root
    (`server/services.py`, the CLI) and shared by every run it starts."""

    search: CodeSearch = field(default_factory=NoIndex)
    apply: EditMerge = field(default_factory=ApplyMerge)

    def charged(self, meter: Metering) -> ToolServices:
        """These services for one run, their model work charged through `meter`."""
        return ToolServices(self.search, self.apply.charged(meter))


@dataclass
class ToolContext:
    """Per-run state and services: the todo list, the injected services, cancellation, and
    which files this run has read (the agent refuses edits to files it never read)."""

    todos: list[dict[str, Any]] = field(default_factory=list)
    services: ToolServices = field(default_factory=ToolServices)
    cancel: threading.Event | None = None
    read_before_edit: bool = False
    seen: set[Path] = field(default_factory=set)  # files read or written in this run
    written: set[Path] = field(default_factory=set)  # files created, changed or deleted
    checked: bool = False  # a command ran after the last write (tests, a script)

    def changed(self, path: Path) -> None:
        self.written.add(path)
        self.checked = False


@dataclass
class ToolResult:
    name: str
    ok: bool
    output: str  # exactly what the model sees
    seconds: float = 0.0
    truncated: bool = False
    data: dict[str, Any] = field(default_factory=dict)  # structured extras: diff, todos, exit

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "output": self.output,
                "seconds": self.seconds, "truncated": self.truncated, "data": self.data}


Impl = Callable[[Environment, dict[str, Any], ToolContext], tuple[str, dict[str, Any]]]


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    properties: dict[str, Any]
    required: tuple[str, ...]
    impl: Impl
    access: str  # "read" | "write" | "exec" | "state": decides what may run concurrently
    more: str = "narrow the request"  # how to see what truncation left out
    # Pure-Python work (no subprocess, no network): under the GIL a thread cannot run it in
    # parallel, and handing it to one costs more than the work, so the loop runs it inline.
    inline: bool = False

    def schema(self) -> dict[str, Any]:
        params = {"type": "object", "properties": self.properties,
                  "required": list(self.required)}
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.description,
                                                 "parameters": params}}


def tool(name: str, description: str, properties: dict[str, Any], required: tuple[str, ...],
         access: str, more: str = "narrow the request",
         inline: bool = False) -> Callable[[Impl], Tool]:
    """Turns an implementation into a `Tool` (nothing is registered anywhere: the table in
    `agent/tools/__init__.py` lists the tools a standard toolset offers)."""
    def make(impl: Impl) -> Tool:
        return Tool(name, description, properties, required, impl, access, more, inline)
    return make


class Toolset:
    """The tools one agent, command or environment server offers, by name."""

    def __init__(self, tools: Iterable[Tool]) -> None:
        self.tools = {t.name: t for t in tools}

    def __contains__(self, name: object) -> bool:
        return name in self.tools

    def get(self, name: str) -> Tool | None:
        return self.tools.get(name)

    def schemas(self, names: list[str] | None = None,
                core: bool = False) -> list[dict[str, Any]]:
        out = [self.tools[n].schema() for n in (names or list(self.tools))]
        if core:
            for fn in (s["function"] for s in out):
                props = fn["parameters"]["properties"]
                fn["parameters"]["properties"] = {k: v for k, v in props.items()
                                                  if k not in ADVANCED_ARGS}
        return out

    def execute(self, env: Environment, name: str, args: dict[str, Any] | str,
                ctx: ToolContext | None = None, max_chars: int = MAX_CHARS) -> ToolResult:
        """Run one tool call exactly as the agent would."""
        start = time.monotonic()
        ctx = ctx or ToolContext()
        spec = self.tools.get(name)
        try:
            if spec is None:
                raise ToolError(f"unknown tool {name!r}; available: {', '.join(self.tools)}")
            text, data = spec.impl(env, _check_args(spec, args), ctx)
            ok = True
        except ToolError as exc:
            text, data, ok = f"error: {exc}", {}, False
        except Exception as exc:  # noqa: BLE001 - a tool bug must not kill the agent loop
            text, data, ok = f"error: {name} failed: {type(exc).__name__}: {exc}", {}, False
        text, cut = truncate(text, max_chars, spec.more if spec else "")
        return ToolResult(name, ok, text, round(time.monotonic() - start, 4), cut, data)

    def conflicts(self, env: Environment, a: tuple[str, dict], b: tuple[str, dict]) -> bool:
        """Must call b wait for call a? Writes to overlapping paths and commands
        serialize."""
        ta, tb = self.tools.get(a[0]), self.tools.get(b[0])
        if ta is None or tb is None:
            return False
        kinds = {ta.access, tb.access}
        if "state" in kinds:
            return kinds == {"state"}
        if kinds == {"read"}:
            return False
        if "exec" in kinds:  # a command may touch any file: it is a barrier
            return True
        pa, pb = _touched(env, a[1]), _touched(env, b[1])
        return pa is None or pb is None or pa == pb or pa in pb.parents or pb in pa.parents


def truncate(text: str, limit: int, more: str = "narrow the request") -> tuple[str, bool]:
    if len(text) <= limit:
        return text, False
    head = text[:limit]
    if "\n" in head:
        head = head[: head.rindex("\n")]
    shown, total = head.count("\n") + 1, text.count("\n") + 1
    return (f"{head}\n[truncated: showed {len(head)} of {len(text)} characters "
            f"({shown} of {total} lines); {more}]"), True


def _touched(env: Environment, args: dict | str) -> Path | None:
    if not isinstance(args, dict):  # arguments that are not JSON: the tool will refuse them
        return None
    try:
        return env.resolve(str(args.get("path") or "."))
    except (ToolError, TypeError):
        return None


def _check_args(spec: Tool, args: dict[str, Any] | str) -> dict[str, Any]:
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except ValueError as exc:
            raise ToolError(f"arguments are not valid JSON: {exc}") from None
    if not isinstance(args, dict):
        raise ToolError("arguments must be a JSON object")
    unknown = sorted(set(args) - set(spec.properties))
    if unknown:
        raise ToolError(f"unexpected argument(s) {', '.join(unknown)}; {spec.name} takes: "
                        f"{', '.join(spec.properties)}")
    missing = [k for k in spec.required if args.get(k) is None]
    if missing:
        raise ToolError(f"missing required argument(s): {', '.join(missing)}")
    out = {}
    for key, value in args.items():
        want = spec.properties[key].get("type")
        if want == "integer" and isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)  # small models often quote numbers
        if want == "array" and isinstance(value, str):
            value = [value]
        kinds = {"string": str, "integer": int, "boolean": bool, "array": list}
        if want in kinds and value is not None and not isinstance(value, kinds[want]):
            raise ToolError(f"argument {key!r} must be a {want}")
        out[key] = value
    return out
