"""The agent's tools: `Tool` objects, JSON-schema'd, each a function of (Environment, args,
ctx), gathered in a `Toolset` (`default_toolset()` builds the standard one).

`Toolset.execute()` is the only entry point - the agent loop, `codeplane tool`, the server
and future training environment servers all call it, so arguments, errors and result formats
are the same everywhere. Tools touch the workspace only through `env.workspace` (read, write,
stat, list, exec), so they run unchanged on every workspace backend. Tools never raise at the
caller: a failure is a result with `ok=False` whose text tells the model what to do instead.
Results longer than `max_chars` are cut at a line boundary with a note saying how much was
shown and how to see the rest.
"""

from __future__ import annotations

import base64
import difflib
import fnmatch
import functools
import json
import os
import re
import shutil
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from codeplane.agent.env import Environment, ToolError
from codeplane.core import languages
from codeplane.core.files import Refused, TextFile, TooLarge, decode
from codeplane.sandbox.workspace import Entry, FileStat

MAX_CHARS = 8000
MAX_FILE_BYTES = 8 << 20  # larger files are refused before reading (logs, data, sparse files)
MAX_READ_LINES = 400
MAX_HITS = 100
_SKIP_DIRS = {".git", "node_modules", "__pycache__", ".venv", "venv", ".mypy_cache",
              ".pytest_cache", ".ruff_cache"}


@dataclass
class ToolContext:
    """Per-run state and services: the todo list, settings for search, cancellation, and
    which files this run has read (the agent refuses edits to files it never read)."""

    todos: list[dict[str, Any]] = field(default_factory=list)
    settings: Any = None
    engine: Any = None
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
    """Turns an implementation into a `Tool` (nothing is registered anywhere: a `Toolset`
    lists the tools it offers)."""
    def make(impl: Impl) -> Tool:
        return Tool(name, description, properties, required, impl, access, more, inline)
    return make


# The "core" set for small local models: fewer tools and arguments to choose from.
CORE = ["read_file", "list_dir", "grep", "edit_file", "create_file", "delete_file",
        "run_terminal_cmd"]
_ADVANCED = ("code_edit", "case_sensitive")  # optional arguments the core set leaves out


class Toolset:
    """The tools one agent, command or environment server offers, by name."""

    def __init__(self, tools: Iterable[Tool]) -> None:
        self.tools = {t.name: t for t in tools}

    def __contains__(self, name: object) -> bool:
        return name in self.tools

    def get(self, name: str) -> Tool | None:
        return self.tools.get(name)

    def with_tools(self, *extra: Tool) -> Toolset:
        """This set plus (or with replaced) `extra` tools."""
        return Toolset([*self.tools.values(), *extra])

    def schemas(self, names: list[str] | None = None,
                core: bool = False) -> list[dict[str, Any]]:
        out = [self.tools[n].schema() for n in (names or list(self.tools))]
        if core:
            for fn in (s["function"] for s in out):
                props = fn["parameters"]["properties"]
                fn["parameters"]["properties"] = {k: v for k, v in props.items()
                                                  if k not in _ADVANCED}
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


def mentioned(text: str, files: list[str]) -> list[str]:
    """Workspace files a task names, by path or by an unambiguous file name, in the order
    they appear in the text."""
    by_name: dict[str, list[str]] = {}
    for f in files:
        by_name.setdefault(Path(f).name, []).append(f)
    found: dict[str, int] = {}
    for f in files:
        names = [f] + ([Path(f).name] if len(by_name[Path(f).name]) == 1 else [])
        for name in names:
            m = re.search(rf"(?<![\w/.-]){re.escape(name)}(?![\w/-])", text)
            if m:
                found[f] = min(found.get(f, m.start()), m.start())
    return sorted(found, key=found.__getitem__)


def _missing(env: Environment, given: str) -> ToolError:
    """A not-found error that names the workspace files the model probably meant."""
    name = Path(given).name
    files = list(list_files(env, env.root))
    close = [f for f in files if Path(f).name == name] or [
        f for f in files if name and name.split(".")[0] in Path(f).name][:3]
    hint = f"; did you mean {' or '.join(close[:3])}?" if close else \
        "; use list_dir or file_search to find files"
    return ToolError(f"{given} does not exist{hint}")


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


# ---------------------------------------------------------------- reading and searching

PATH = {"type": "string", "description": "Path relative to the workspace root."}


@tool("read_file", "Read a text file. Reads up to 400 lines at a time; pass start_line/end_line "
      "(1-based, inclusive) for other parts. Read several files at once by calling this tool "
      "several times in one turn.",
      {"path": PATH, "start_line": {"type": "integer"}, "end_line": {"type": "integer"}},
      ("path",), "read", "call read_file with start_line/end_line for the rest", inline=True)
def read_file(env: Environment, args: dict, ctx: ToolContext) -> tuple[str, dict]:
    path = env.resolve(args["path"])
    kind = _kind(env, path)
    if kind == "dir":
        raise ToolError(f"{args['path']} is a directory; use list_dir")
    if kind is None:
        raise _missing(env, args["path"])
    fmt = _text(env, path)
    lines = _lines(fmt.shown)
    ctx.seen.add(path)
    first = max(args.get("start_line") or 1, 1)
    last = min(args.get("end_line") or first + MAX_READ_LINES - 1, len(lines),
               first + MAX_READ_LINES - 1)
    rel = env.relative(path)
    if not lines:
        return f"{rel} is empty", {"lines": 0}
    if first > len(lines):
        raise ToolError(f"start_line {first} is past the end ({len(lines)} lines)")
    body = "\n".join(lines[first - 1:last])
    note = (f"\n[lines {last + 1}-{len(lines)} not shown; call read_file with "
            f"start_line={last + 1}]" if last < len(lines) else "")
    kind = "" if fmt.label == "UTF-8" else f"; {fmt.label}"
    return (f"{rel} (lines {first}-{last} of {len(lines)}{kind}):\n{body}{note}",
            {"lines": len(lines), "encoding": fmt.label})


def _lines(text: str) -> list[str]:
    """Lines split at "\n" only: `str.splitlines` also splits at form feeds and at U+0085
    (a plain byte in Latin-1 files), which would shift line numbers against the editor."""
    lines = text.split("\n")
    return lines[:-1] if lines[-1] == "" else lines


@tool("list_dir", "List a directory: sub-directories end with '/', files show their size.",
      {"path": {**PATH, "description": "Directory relative to the workspace root (default .)"}},
      (), "read", "list a sub-directory", inline=True)
def list_dir(env: Environment, args: dict, ctx: ToolContext) -> tuple[str, dict]:
    path = env.resolve(args.get("path") or ".")
    if _kind(env, path) != "dir":
        raise ToolError(f"{args.get('path')} is not a directory")
    rows = []
    for entry in sorted(env.workspace.list(path), key=lambda e: (e.stat.kind != "dir", e.name)):
        if entry.stat.kind == "symlink":
            rows.append(f"{entry.name} -> {entry.stat.target}")
        elif entry.stat.kind == "dir":
            rows.append(f"{entry.name}/")
        else:
            rows.append(f"{entry.name} ({entry.stat.size} bytes)")
    return f"{env.relative(path)}:\n" + ("\n".join(rows) or "(empty)"), {"entries": len(rows)}


@tool("file_search", "Find files by name: a glob (e.g. '**/test_*.py') or a fuzzy part of "
      "the name (e.g. 'usrsrv' finds user_service.py).",
      {"query": {"type": "string"}, "path": {**PATH, "description": "Directory to search in"}},
      ("query",), "read", "use a more specific query")
def file_search(env: Environment, args: dict, ctx: ToolContext) -> tuple[str, dict]:
    query = args["query"].strip()
    if not query:
        raise ToolError("query is empty")
    files = list(list_files(env, env.resolve(args.get("path") or ".")))
    if any(c in query for c in "*?["):
        hits = [f for f in files if fnmatch.fnmatch(f, query)
                or fnmatch.fnmatch(Path(f).name, query) or fnmatch.fnmatch(f, f"**/{query}")]
    else:
        scored = [(s, f) for f in files if (s := _fuzzy(query.lower(), f.lower())) is not None]
        hits = [f for _, f in sorted(scored)]
    if not hits:
        return f"no files match {query!r}", {"count": 0}
    shown = hits[:50]
    more = f"\n[{len(hits) - 50} more]" if len(hits) > 50 else ""
    return "\n".join(shown) + more, {"count": len(hits)}


def _fuzzy(query: str, path: str) -> tuple[int, int] | None:
    """Rank: name contains query < path contains query < query is a subsequence."""
    name = path.rsplit("/", 1)[-1]
    if query in name:
        return (0, len(path))
    if query in path:
        return (1, len(path))
    pos = 0
    for ch in query:
        pos = path.find(ch, pos) + 1
        if pos == 0:
            return None
    return (2, len(path))


@tool("grep", "Search file contents with a regular expression (ripgrep syntax). Returns "
      "path:line:text lines. Use `include` to filter files by glob, e.g. '*.py'.",
      {"pattern": {"type": "string"}, "path": {**PATH, "description": "File or directory"},
       "include": {"type": "string", "description": "glob of files to search"},
       "case_sensitive": {"type": "boolean"}},
      ("pattern",), "read", "narrow the pattern, path or include glob")
def grep(env: Environment, args: dict, ctx: ToolContext) -> tuple[str, dict]:
    base = env.resolve(args.get("path") or ".")
    pattern, include = args["pattern"], args.get("include")
    sensitive = args.get("case_sensitive", True)
    rg = shutil.which("rg")
    engine = "rg" if rg else "python"

    def search(literal: bool) -> list[str]:
        return (_rg(env, rg, pattern, base, include, sensitive, literal) if rg
                else _pygrep(env, pattern, base, include, sensitive, literal))

    special = bool(_REGEX_SYNTAX.search(pattern))
    try:
        hits, note = search(literal=False), ""
    except ToolError:
        if not special:
            raise
        hits, note = [], "invalid regular expression"
    if not hits and special:
        # Models often paste code (`add(2, 3)`) as the pattern; as a regex its parentheses
        # are a group and it matches nothing. Searching it literally is what they meant.
        hits = search(literal=True)
        note = f"{note or 'no regex matches'}; matched as a literal string" if hits else note
    if not hits:
        tip = f"; {pattern} is a file: read it with read_file" if _is_file(env, pattern) else ""
        tip += f" ({note}; no literal match either)" if note else ""
        return f"no matches for {pattern!r}{tip}", {"count": 0, "engine": engine}
    more = f"\n[{len(hits) - MAX_HITS} more matches not shown; narrow the search]" \
        if len(hits) > MAX_HITS else ""
    head = f"[{note}]\n" if note else ""
    shown = hits[:MAX_HITS]
    shown[0] += _grep_next(env, ctx, hits[0])  # next to its hit: truncation cuts the end
    return head + "\n".join(shown) + more, {"count": len(hits), "engine": engine}


_HIT = re.compile(r"^(.+?):(\d+):")


def _grep_next(env: Environment, ctx: ToolContext, first_hit: str) -> str:
    """The next step after a grep, spelled out when the first hit's file is unread: last
    session's transcripts show code-medium calling edit_file straight from a grep hit (which
    the read-before-edit rule refuses) and running out of turns."""
    match = _HIT.match(first_hit)
    if not match or not _unread_file(env, ctx, match[1]):
        return ""
    line = int(match[2])
    return f"\n{_next_step(match[1], line, line)}"


def _needs_read(ctx: ToolContext, path: Path) -> bool:
    """Would a change to path be refused as not read in this run? (the read-before-edit rule)"""
    return ctx.read_before_edit and path not in ctx.seen


def _unread_file(env: Environment, ctx: ToolContext, rel: str) -> bool:
    """`_needs_read` for a path as a hit names it."""
    try:
        return _needs_read(ctx, env.resolve(rel))
    except (ToolError, ValueError, OSError):  # not a workspace path after all
        return False


def _next_step(rel: str, first: int, last: int) -> str:
    return (f"[next: to change {rel}, call {_read_call(rel, first, last)} first; edit_file "
            "needs the file read in this run, and a search hit is not a read]")


def _read_call(rel: str, first: int, last: int) -> str:
    """The read_file call that shows lines first..last of rel with some context, written as
    the model would call it, so it can copy it instead of guessing."""
    args = {"path": rel, "start_line": max(first - _MARGIN, 1), "end_line": last + _MARGIN}
    return f"read_file {json.dumps(args)}"


_MARGIN = 20  # lines of context either side of a hit in the suggested read


def _is_file(env: Environment, rel: str) -> bool:
    try:
        return _kind(env, env.resolve(rel)) == "file"
    except (ToolError, ValueError, OSError):  # outside the workspace, or not a path at all
        return False


_REGEX_SYNTAX = re.compile(r"[.^$*+?()\[\]{}|\\]")


def _rg(env: Environment, rg: str, pattern: str, base: Path, include: str | None,
        sensitive: bool, literal: bool) -> list[str]:
    """ripgrep inside the sandbox (over a read-only workspace); its JSON lines tell hits
    from its error messages, which share the output stream."""
    argv = [rg, "--json", "--max-count=50", "--threads=1"]
    argv += [] if sensitive else ["--ignore-case"]
    argv += ["--fixed-strings"] if literal else []
    argv += ["--glob", include] if include else []
    argv += ["--regexp", pattern, "--", env.relative(base)]
    res = env.exec(argv, stderr=True)
    hits, errors = [], []
    for line in res.output.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            errors.append(line)
            continue
        if event.get("type") == "match" and len(hits) < MAX_HITS * 5:
            data = event["data"]
            text = _rg_text(data["lines"]).rstrip("\r\n")[:300]
            hits.append(f"{_strip_dot(_rg_text(data['path']))}:{data['line_number']}:{text}")
    if res.exit_code == 2 and not hits:
        raise ToolError(f"grep failed: {' '.join(errors).strip()[:500]}")
    return hits


def _rg_text(field: dict) -> str:
    """ripgrep's JSON carries non-UTF-8 paths and lines as base64 "bytes"."""
    if "text" in field:
        return field["text"]
    return base64.b64decode(field.get("bytes", "")).decode(errors="replace")


def _strip_dot(line: str) -> str:
    return line.removeprefix("./")


def _pygrep(env: Environment, pattern: str, base: Path, include: str | None,
            sensitive: bool, literal: bool) -> list[str]:
    """Fallback when ripgrep is absent: Python `re`, skipping binary and ignored dirs."""
    try:
        regex = re.compile(re.escape(pattern) if literal else pattern,
                           0 if sensitive else re.IGNORECASE)
    except re.error as exc:
        raise ToolError(f"invalid regular expression: {exc}") from None
    hits: list[str] = []
    for rel in list_files(env, base, use_rg=False):
        if include and not fnmatch.fnmatch(Path(rel).name, include) \
                and not fnmatch.fnmatch(rel, include):
            continue
        try:
            text = _text(env, env.root / rel).shown  # the resolver: no symlink out, no FIFO
        except ToolError:
            continue
        hits += [f"{rel}:{n}:{line[:300]}" for n, line in enumerate(_lines(text), 1)
                 if regex.search(line)]
        if len(hits) > MAX_HITS * 5:
            break
    return hits


def list_files(env: Environment, base: Path, use_rg: bool = True) -> Iterator[str]:
    """Workspace-relative paths of files under base; ripgrep (in the sandbox) honours
    .gitignore."""
    rg = shutil.which("rg") if use_rg else None
    if rg:
        res = env.exec([rg, "--files", "--null", "--", env.relative(base)])
        if res.killed:
            raise ToolError(f"listing files failed ({res.killed})")
        yield from sorted(_strip_dot(p) for p in res.output.split("\0") if p)
        return
    kind = _kind(env, base)
    if kind != "dir":
        yield from [env.relative(base)] if kind else []
        return
    # depth first in name order, iteratively: a tree 1,000 directories deep must not exhaust
    # the interpreter's stack (symlinked directories are not entered)
    stack = [(base, _listing(env, base))]
    while stack:
        folder, entries = stack[-1]
        entry = next(entries, None)
        if entry is None:
            stack.pop()
        elif entry.stat.kind != "dir":
            yield env.relative(folder / entry.name)
        elif entry.name not in _SKIP_DIRS and entry.name[0] != ".":
            stack.append((folder / entry.name, _listing(env, folder / entry.name)))


def _listing(env: Environment, folder: Path) -> Iterator[Entry]:
    """A folder's entries; none for one that cannot be listed (past PATH_MAX, gone)."""
    try:
        return iter(env.workspace.list(folder))
    except (Refused, OSError):
        return iter(())


@tool("codebase_search", "Semantic search: find code by meaning ('where are passwords "
      "hashed?'). Returns the most relevant snippets with paths and line ranges.",
      {"query": {"type": "string"}, "limit": {"type": "integer"},
       "target_directories": {"type": "array", "items": {"type": "string"}},
       "files": {"type": "boolean", "description": "rank whole files: use when asking where "
                 "a change should go"}},
      ("query",), "read", "ask a narrower question")
def codebase_search(env: Environment, args: dict, ctx: ToolContext) -> tuple[str, dict]:
    try:
        from codeplane.indexing.api import IndexUnavailable, search_workspace
    except ImportError as exc:
        return (f"index unavailable: semantic search is not installed ({exc}); use grep or "
                "file_search instead"), {"available": False}
    settings = ctx.settings
    if settings is None:
        from codeplane.config import load_settings
        settings = load_settings()
    try:
        hits = search_workspace(env.root, args["query"], int(args.get("limit") or 10), settings,
                                files=bool(args.get("files")))
    except IndexUnavailable as exc:
        return f"index unavailable: {exc}; use grep or file_search instead", {"available": False}
    dirs = [env.relative(env.resolve(d)) for d in args.get("target_directories") or []]
    if dirs:
        hits = [h for h in hits if any(d == "." or str(h["path"]).startswith(d) for d in dirs)]
    if not hits:
        return "no results", {"available": True, "count": 0}
    blocks = [f"{h['path']}:{h['start_line']}-{h['end_line']} (score {h['score']:.2f})\n"
              f"{h.get('snippet', '')}" for h in hits]
    top = hits[0]
    if _unread_file(env, ctx, str(top["path"])):  # right after the top hit: ten snippets
        # often pass the result limit, and truncation cuts the end
        blocks[0] += "\n" + _next_step(str(top["path"]), top["start_line"], top["end_line"])
    return "\n\n".join(blocks), {"available": True, "count": len(hits)}


# ---------------------------------------------------------------- changing files

@tool("edit_file", "Edit a file by exact string replacement: old_string must match the file "
      "exactly (including indentation) and be unique unless replace_all is true; include a "
      "few surrounding lines to make it unique. Alternatively pass code_edit: the changed "
      "code with '# ... existing code ...' marking unchanged parts.",
      {"path": PATH, "old_string": {"type": "string"}, "new_string": {"type": "string"},
       "replace_all": {"type": "boolean"}, "code_edit": {"type": "string"}},
      ("path",), "write", inline=True)
def edit_file(env: Environment, args: dict, ctx: ToolContext) -> tuple[str, dict]:
    path = env.resolve(args["path"], write=True)
    if _kind(env, path) is None:
        err = _missing(env, args["path"])
        raise ToolError(f"{err}; use create_file for new files")
    if _needs_read(ctx, path):
        raise ToolError(_unread(env, path, args.get("old_string")))
    fmt = _text(env, path)
    before = fmt.text
    if args.get("code_edit") is not None and args.get("old_string") is None:
        after = _apply_sketch(before, fmt.incoming(args["code_edit"]), env.relative(path), ctx)
    else:
        old, new = (args.get(k) for k in ("old_string", "new_string"))
        old, new = (fmt.incoming(v) if isinstance(v, str) else v for v in (old, new))
        try:
            after = _replace(before, old, new, bool(args.get("replace_all")))
        except ToolError as exc:
            raise ToolError(f"{exc}{_found_elsewhere(env, ctx, path, old)}") from None
    _write(env, path, fmt, after)
    ctx.changed(path)
    return _change_report(env, path, fmt.show(before), fmt.show(after), "edited")


def _unread(env: Environment, path: Path, old: str | None) -> str:
    """The refusal of an edit to an unread file, naming the read_file call to make: around
    old_string if the file has it, else from the top."""
    rel = env.relative(path)
    text = shown_text(env, path) or ""
    at = text.find(old) if isinstance(old, str) and old else -1
    first = text.count("\n", 0, at) + 1 if at >= 0 else 1
    last = first + str(old).count("\n") if at >= 0 else MAX_READ_LINES - _MARGIN
    return (f"read {rel} with read_file first: call {_read_call(rel, first, last)}, then copy "
            "old_string exactly from its output")


def _replace(text: str, old: str | None, new: str | None, replace_all: bool) -> str:
    if old is None or new is None:
        raise ToolError("pass old_string and new_string (or code_edit)")
    if old == "":
        raise ToolError("old_string is empty; use create_file to write a whole file")
    if old == new:
        raise ToolError("old_string and new_string are identical; nothing to change")
    count = text.count(old)
    if count == 0 and (start := _unique_ignoring_quotes(text, old)) is not None:
        return text[:start] + new + text[start + len(old):]
    if count == 0:
        hint = ""
        if " ".join(old.split()) in " ".join(text.split()):
            hint = " (it matches if whitespace is ignored: copy the indentation exactly)"
        raise ToolError(f"old_string was not found in the file{hint}; read_file the file "
                        "and copy the text exactly")
    if count > 1 and not replace_all:
        raise ToolError(f"old_string occurs {count} times; include more surrounding lines to "
                        "make it unique, or set replace_all to true")
    return text.replace(old, new) if replace_all else text.replace(old, new, 1)


def _found_elsewhere(env: Environment, ctx: ToolContext, path: Path, old: str | None) -> str:
    """Small models often edit the test file with a line from the code it imports (or the
    reverse); if old_string is missing here but in exactly one other file this run read,
    say which."""
    if not old or old in _text(env, path).text:
        return ""
    others = [p for p in sorted(ctx.seen) if p != path and old in _quiet(env, p)]
    return f" (it does occur in {env.relative(others[0])}: edit that file)" \
        if len(others) == 1 else ""


def _unique_ignoring_quotes(text: str, old: str) -> int | None:
    """Where `old` occurs once if ' and " are the same character (models often switch quote
    style when copying, as Aider and Claude Code also tolerate). The mapping is one character
    to one, so offsets in the normalised text are offsets in the file."""
    table = str.maketrans("'", '"')
    haystack, needle = text.translate(table), old.translate(table)
    start = haystack.find(needle)
    if start == -1 or haystack.find(needle, start + 1) != -1:
        return None
    return start


def _apply_sketch(before: str, sketch: str, rel: str, ctx: ToolContext) -> str:
    try:
        from codeplane.apply.api import apply_edit
    except ImportError:
        raise ToolError("sketch edits (code_edit) are not available in this installation; "
                        "use old_string/new_string instead") from None
    result = apply_edit(before, sketch, rel, engine=ctx.engine)
    if not result.ok or result.merged is None:
        detail = "; ".join(result.diagnostics) or "merge failed"
        raise ToolError(f"could not apply code_edit ({detail}); use old_string/new_string")
    return result.merged


@tool("create_file", "Create a file (and its directories) with the given content, or "
      "overwrite an existing file completely.",
      {"path": PATH, "content": {"type": "string"}}, ("path", "content"), "write",
      inline=True)
def create_file(env: Environment, args: dict, ctx: ToolContext) -> tuple[str, dict]:
    path = env.resolve(args["path"], write=True)
    kind = _kind(env, path)
    if kind == "dir":
        raise ToolError(f"{args['path']} is a directory")
    exists = kind is not None
    if exists and _needs_read(ctx, path):
        raise ToolError(f"{env.relative(path)} already exists; read it with read_file first, "
                        "then change it with edit_file (or overwrite it with create_file)")
    fmt = _text(env, path) if exists else TextFile("", "utf-8")  # an overwrite keeps the format
    content = fmt.incoming(args["content"])
    _write(env, path, fmt, content)
    ctx.seen.add(path)
    ctx.changed(path)
    return _change_report(env, path, fmt.shown, fmt.show(content),
                          "overwrote" if exists else "created")


@tool("delete_file", "Delete a file.", {"path": PATH}, ("path",), "write", inline=True)
def delete_file(env: Environment, args: dict, ctx: ToolContext) -> tuple[str, dict]:
    path = env.resolve(args["path"], write=True)
    kind = _kind(env, path)
    if path == env.root or kind == "dir":
        raise ToolError(f"{args['path']} is a directory; only files can be deleted")
    if kind is None:
        raise ToolError(f"{args['path']} does not exist")
    try:  # the diff shows what was lost; a binary or huge file is deleted without one
        before = _text(env, path).shown
    except ToolError:
        before = ""
    try:
        env.workspace.remove(path)
    except Refused as exc:
        raise ToolError(str(exc)) from None
    ctx.changed(path)
    diff = _diff(env.relative(path), before, "")
    return f"deleted {env.relative(path)}", {"diff": diff, "path": env.relative(path)}


def _change_report(env: Environment, path: Path, before: str, after: str,
                   verb: str) -> tuple[str, dict]:
    rel = env.relative(path)
    diff = _diff(rel, before, after)
    added = sum(1 for ln in diff.splitlines() if ln[:1] == "+" and ln[:3] != "+++")
    removed = sum(1 for ln in diff.splitlines() if ln[:1] == "-" and ln[:3] != "---")
    text = f"{verb} {rel} (+{added} -{removed} lines)"
    errors = syntax_errors(path, after)
    if errors:
        text += "\nwarning: the file now has syntax errors:\n" + "\n".join(errors[:5])
    return text, {"diff": diff, "path": rel, "syntax_errors": errors}


def _diff(rel: str, before: str, after: str) -> str:
    return "".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True),
                                        f"a/{rel}", f"b/{rel}"))


# ---------------------------------------------------------------- checking and running

@tool("read_lints", "Report lint errors: ruff for Python files, syntax errors (tree-sitter) "
      "for other languages. Pass files or directories (default: the whole workspace).",
      {"paths": {"type": "array", "items": {"type": "string"}}}, (), "read",
      "lint fewer files at a time")
def read_lints(env: Environment, args: dict, ctx: ToolContext) -> tuple[str, dict]:
    targets = [env.resolve(p) for p in args.get("paths") or ["."]]
    files = sorted({rel for t in targets for rel in list_files(env, t)})
    py = [f for f in files if f.endswith(".py")]
    problems = _ruff(env, py) if py else []
    for rel in files:
        if not rel.endswith(".py") and languages.language_for(rel) \
                and (source := shown_text(env, env.root / rel)):
            problems += syntax_errors(env.root / rel, source, rel)
    if not problems:
        return f"no lint errors in {len(files)} file(s)", {"count": 0, "files": len(files)}
    return "\n".join(problems), {"count": len(problems), "files": len(files)}


def _ruff(env: Environment, files: list[str]) -> list[str]:
    """ruff inside the sandbox over a read-only workspace; one JSON object per diagnostic,
    so its own error messages (same stream) are told apart."""
    res = env.exec([_ruff_binary(), "check", "--output-format=json-lines", "--no-cache",
                    "--exit-zero", "--", *files], timeout=120, stderr=True)
    found, errors = [], []
    for line in res.output.splitlines():
        try:
            found.append(json.loads(line))
        except ValueError:
            errors.append(line)
    if res.exit_code != 0 and not found:
        raise ToolError(f"ruff failed: {' '.join(errors).strip()[:500] or res.killed}")
    return [f"{env.relative(Path(d['filename']))}:{d['location']['row']}:"
            f"{d['location']['column']}: {d.get('code') or 'syntax'} {d['message']}"
            for d in found]


def _ruff_binary() -> str:
    """ruff's executable, by absolute path, from this installation. Never `python -m ruff`
    (it puts the working directory first on sys.path: a `ruff.py` in the workspace ran on
    the host) nor `import ruff` for `find_ruff_bin` (same risk when the server runs with the
    workspace as its working directory); this is the lookup find_ruff_bin does."""
    for folder in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        candidate = Path(folder) / "ruff"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("ruff")
    if not found:
        raise ToolError("ruff is not installed; pip install ruff")
    return found


def syntax_errors(path: Path, source: str, rel: str | None = None) -> list[str]:
    """Syntax errors in `source` (the text of `path`) via tree-sitter (Python: the
    compiler), as 'path:line:col: message'."""
    rel = rel or path.name
    if path.suffix == ".py":
        try:
            compile(source, rel, "exec")
            return []
        except SyntaxError as exc:
            return [f"{rel}:{exc.lineno}:{exc.offset}: syntax error: {exc.msg}"]
    language = languages.language_for(path.name)
    if language is None:
        return []
    return [f"{rel}:{e.line}:{e.column}: syntax error" + (f": missing {e.missing}" if e.missing
                                                          else "")
            for e in languages.syntax_errors(source, language)]


@tool("run_terminal_cmd", "Run a shell command in the workspace (sandboxed: no network, "
      "writes only inside the workspace). Use it to run tests and scripts. Output is capped.",
      {"command": {"type": "string"},
       "timeout": {"type": "integer", "description": "seconds (default 120)"}},
      ("command",), "exec", "redirect output to a file and grep or read_file it")
def run_terminal_cmd(env: Environment, args: dict, ctx: ToolContext) -> tuple[str, dict]:
    command = args["command"].strip()
    if not command:
        raise ToolError("command is empty")
    res = env.run(command, args.get("timeout"), ctx.cancel)
    ctx.checked = True
    status = (f"killed: {res.killed}" + (f" after {res.seconds:.0f}s" if res.killed == "timeout"
                                         else "")) if res.killed else f"exit code {res.exit_code}"
    text = f"$ {command}\n{res.output.rstrip()}\n[{status}]"
    return text, {"exit_code": res.exit_code, "killed": res.killed, "seconds": res.seconds,
                  "sandboxed": res.sandboxed}


_STATUSES = ("pending", "in_progress", "completed", "cancelled")


@tool("todo_write", "Keep a visible task list for multi-step work. Each todo has id, content "
      "and status (pending, in_progress, completed, cancelled). merge=true updates todos by "
      "id; otherwise the list is replaced.",
      {"todos": {"type": "array", "items": {"type": "object", "properties": {
          "id": {"type": "string"}, "content": {"type": "string"},
          "status": {"type": "string", "enum": list(_STATUSES)}}}},
       "merge": {"type": "boolean"}}, ("todos",), "state", inline=True)
def todo_write(env: Environment, args: dict, ctx: ToolContext) -> tuple[str, dict]:
    items = []
    for n, raw in enumerate(args["todos"], 1):
        if not isinstance(raw, dict):
            raise ToolError("each todo must be an object with id, content and status")
        status = str(raw.get("status") or "pending")
        if status not in _STATUSES:
            raise ToolError(f"todo status must be one of {', '.join(_STATUSES)}")
        items.append({"id": str(raw.get("id") or n), "content": str(raw.get("content") or ""),
                      "status": status})
    if args.get("merge"):
        merged = {t["id"]: t for t in ctx.todos}
        for item in items:
            merged[item["id"]] = {**merged.get(item["id"], {}),
                                  **{k: v for k, v in item.items() if v}}
        items = list(merged.values())
    ctx.todos[:] = items
    marks = {"pending": "[ ]", "in_progress": "[~]", "completed": "[x]", "cancelled": "[-]"}
    text = "\n".join(f"{marks[t['status']]} {t['id']}. {t['content']}" for t in items)
    return text or "(no todos)", {"todos": [dict(t) for t in items]}


def _kind(env: Environment, path: Path) -> str | None:
    """What is at a resolved path ("file", "dir", "symlink", "other"), None for nothing."""
    st: FileStat | None = env.workspace.stat(path)
    return st.kind if st else None


def _text(env: Environment, path: Path) -> TextFile:
    """A workspace file through the workspace (local backends: the one resolver,
    core/files.py): a regular file inside it, not larger than MAX_FILE_BYTES, not
    binary."""
    try:
        return decode(env.workspace.read(path, MAX_FILE_BYTES), path.name)
    except TooLarge as exc:
        raise ToolError(f"{exc}; look at parts of it with grep, or run_terminal_cmd with "
                        "head/sed -n") from None
    except Refused as exc:
        raise ToolError(str(exc)) from None
    except FileNotFoundError:
        raise ToolError(f"{path.name} does not exist") from None
    except OSError as exc:
        raise ToolError(f"cannot read {path.name}: {exc.strerror}") from None


def shown_text(env: Environment, path: Path) -> str | None:
    """A file's text as the model sees it, or None when it cannot be read (gone, binary,
    too large, outside the workspace)."""
    try:
        return _text(env, path).shown
    except ToolError:
        return None


def _quiet(env: Environment, path: Path) -> str:
    """A file's text for a hint, or "" when it cannot be read."""
    try:
        return _text(env, path).text
    except ToolError:
        return ""


def _write(env: Environment, path: Path, fmt: TextFile, text: str) -> None:
    """Encode as the file was and replace it atomically through the resolver."""
    try:
        data = fmt.encode(text)
    except ValueError as exc:
        raise ToolError(f"{exc}; nothing was written (keep to characters the file's "
                        "encoding has, or use an escape sequence)") from None
    try:
        env.workspace.write(path, data)
    except Refused as exc:
        raise ToolError(f"{exc}; nothing was written") from None


def default_toolset() -> Toolset:
    """The standard tools, in the order their schemas are offered to the model."""
    return Toolset([read_file, list_dir, file_search, grep, codebase_search, edit_file,
                    create_file, delete_file, read_lints, run_terminal_cmd, todo_write])


@functools.cache
def _standard() -> Toolset:
    return default_toolset()


def execute(env: Environment, name: str, args: dict[str, Any] | str,
            ctx: ToolContext | None = None, max_chars: int = MAX_CHARS) -> ToolResult:
    """One call on the standard toolset (for callers that do not hold a Toolset)."""
    return _standard().execute(env, name, args, ctx, max_chars)


def schemas(names: list[str] | None = None, core: bool = False) -> list[dict[str, Any]]:
    """The standard toolset's schemas."""
    return _standard().schemas(names, core)
