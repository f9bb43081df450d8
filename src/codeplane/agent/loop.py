"""The agent loop: Model -> tool calls -> Environment, until the model answers without tools.

Three small parts, in the spirit of mini-swe-agent: a `ChatModel` (`core/chat.py`: the HTTP
client below, or the server's in-process gateway client), an `Environment` (env.py) and
`Agent`. Every step emits events; the same events feed the Rich CLI, the server's SSE stream
and the JSONL transcript, so what a user sees, what an RL trainer replays and what the API
returns cannot drift apart.

Several tool calls in one model turn run concurrently on a thread pool; a call waits only for
earlier calls it conflicts with (same file written, or a command), and results go back to the
model in call order.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pathspec

from codeplane.agent.env import Environment
from codeplane.agent.prompts import (
    BROKEN,
    CODE_NOT_APPLIED,
    EMPTY,
    FAKE_RESULT,
    NOTHING_CHANGED,
    NUDGE,
    SYSTEM,
    VERIFY,
    task_message,
)
from codeplane.agent.tools import (
    CORE,
    ToolContext,
    ToolResult,
    Toolset,
    default_toolset,
    list_files,
    mentioned,
    shown_text,
    syntax_errors,
)
from codeplane.core.chat import Cancelled, ChatModel, ModelError, Sampling, Turn, TurnBuilder
from codeplane.core.sse import ChunkReader, StreamError
from codeplane.models.toolcalls import parse_tool_calls

Event = dict[str, Any]
log = logging.getLogger("codeplane.agent")


def _http_error(resp: httpx.Response) -> ModelError:
    try:
        err = resp.json()["error"]
        message, code = err.get("message"), err.get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        message, code = resp.text[:500], None
    return ModelError(f"model server returned {resp.status_code}: {message}", code)


def _assemble(lines: Iterator[str], cancel: threading.Event | None) -> Turn:
    """Fold an OpenAI chat-completion SSE stream into one Turn, checking `cancel` before
    each line (keep-alive comments included). A malformed, erroring or cut stream raises
    ModelError: a cut reply is not an answer (the rules live in `core/sse`, shared with the
    gateway)."""
    reader, turn = ChunkReader(), TurnBuilder()
    try:
        for line in lines:
            if cancel is not None and cancel.is_set():
                raise Cancelled
            chunk = reader.feed(line)
            if reader.done:
                break
            if chunk is not None:
                turn.add(chunk)
        reader.end()
    except StreamError as exc:
        raise ModelError(f"model stream {exc.message}", exc.code) from None
    return turn.turn()


class HttpChatModel:
    """A `ChatModel` over any OpenAI-compatible endpoint (`codeplane serve`, a provider):
    what the CLI uses. Server runs use the in-process gateway client instead."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None,
                 timeout: float = 900.0) -> None:
        self.base_url, self.name = base_url.rstrip("/"), model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.base_url, timeout=timeout, headers=headers)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "via": "http", "base_url": self.base_url}

    def complete(self, messages: list[dict], tools: list[dict], sampling: Sampling,
                 cancel: threading.Event | None = None) -> Turn:
        """One chat completion, streamed so that `cancel` can end it between chunks: leaving
        the stream closes the connection, and the server stops generating (a run cancelled
        mid-reply no longer keeps the CPU busy until the reply is complete)."""
        body = {"model": self.name, "messages": messages, "tools": tools,
                "tool_choice": sampling.tool_choice, "max_tokens": sampling.max_tokens,
                "temperature": sampling.temperature, "stream": True,
                "stream_options": {"include_usage": True}}
        try:
            with self.http.stream("POST", "/chat/completions", json=body) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise _http_error(resp)
                return _assemble(resp.iter_lines(), cancel)
        except httpx.TransportError as exc:
            raise ModelError(f"cannot reach the model server at {self.base_url} ({exc}); "
                             "start it with `codeplane serve` or pass --base-url",
                             "unreachable") from None

    def close(self) -> None:
        self.http.close()


@dataclass
class AgentConfig:
    max_steps: int = 25
    max_tokens: int = 1024  # per model reply
    temperature: float = 0.0
    context_tokens: int = 6000  # compact old turns once a prompt grows past this
    token_budget: int = 300_000  # prompt + completion tokens for the whole run
    max_result_chars: int = 6000
    parallel: bool = True
    keep_turns: int = 2  # most recent turns never compacted
    corrections: int = 3  # replies without a usable tool call that get a hint, not the end
    max_calls_per_turn: int = 8
    # First turns must call a tool (tool_choice "required"): codeplane serve enforces it with
    # a grammar, so the first call is well-formed JSON (code-medium 8/17 vs 4/17 without;
    # docs/agent.md, "Measured"). OpenAI-compatible providers accept it too.
    required_steps: int = 1
    read_before_edit: bool = True  # edit_file refuses files not read in this run
    preread: int = 4  # files named in the task the harness reads before the first turn
    toolset: str = "full"  # "full" (all tools) or "core" (7 tools, simpler schemas)


@dataclass
class RunResult:
    run_id: str
    status: str  # completed | max_steps | budget | cancelled | error
    answer: str
    steps: int
    tool_calls: int
    prompt_tokens: int
    completion_tokens: int
    seconds: float
    model: str
    transcript: str | None = None
    error: str | None = None
    todos: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Agent:
    def __init__(self, model: ChatModel, env: Environment, config: AgentConfig | None = None,
                 on_event: Callable[[Event], None] | None = None,
                 cancel: threading.Event | None = None, settings: Any = None,
                 run_id: str | None = None, toolset: Toolset | None = None) -> None:
        self.model, self.env = model, env
        self.toolset = toolset or default_toolset()
        self.config = config or AgentConfig()
        self.cancel = cancel or threading.Event()
        self.ctx = ToolContext(settings=settings, cancel=self.cancel,
                               read_before_edit=self.config.read_before_edit)
        self.listeners = [on_event] if on_event else []
        self.run_id = run_id or uuid.uuid4().hex[:16]
        self.tools = (self.toolset.schemas(CORE, core=True) if self.config.toolset == "core"
                      else self.toolset.schemas())
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._failed_writes = 0
        self._has_tests = self._verified = self._change_task = False
        self._start = time.monotonic()
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0}
        self.steps = self.calls_made = 0

    def emit(self, event: Event) -> None:
        event = {"type": event.pop("type"), "run_id": self.run_id,
                 "t": round(time.monotonic() - self._start, 3), **event}
        with self._lock:
            for listener in self.listeners:
                listener(event)

    def run(self, task: str) -> RunResult:
        """Run the task to a terminal status. Whatever fails - listing the workspace, a
        tool's scheduling, the model, a bug - the run ends with a `run_end` event and a
        status; a run that silently stops would look "running" forever to its watchers."""
        self._start = time.monotonic()
        messages: list[dict] = []
        status, answer, error = "error", "", None
        try:
            messages += self._setup(task)
            status, answer = self._loop(messages)
        except ModelError as exc:
            status, error = "error", str(exc)
        except Cancelled:
            status = "cancelled"
        except Exception as exc:  # any failure must still end the run
            log.exception("agent run %s failed", self.run_id)
            status, error = "error", f"internal error: {type(exc).__name__}: {exc}"
        finally:
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None
        if status != "error" and self.cancel.is_set():
            status = "cancelled"
        result = RunResult(self.run_id, status, answer, self.steps, self.calls_made,
                           self.usage["prompt_tokens"], self.usage["completion_tokens"],
                           round(time.monotonic() - self._start, 3), self.model.name,
                           error=error, todos=list(self.ctx.todos))
        self.emit({"type": "run_end", **result.to_dict(), "messages": messages})
        return result

    def _setup(self, task: str) -> list[dict]:
        """The first two messages, announced by `run_start`."""
        files = list(list_files(self.env, self.env.root))
        self._has_tests = any(_TEST_FILE.search(f) for f in files)
        self._change_task = bool(_CHANGE.search(task))
        user = task_message(task, files) + self._preread(task, files)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        self.emit({"type": "run_start", "time": time.time(), "task": task,
                   "model": self.model.name, "model_info": self.model.describe(),
                   "environment": self.env.metadata(), "config": asdict(self.config),
                   "tools": self.tools, "messages": list(messages)})
        return messages

    def _loop(self, messages: list[dict]) -> tuple[str, str]:
        """Turns until an answer or a limit: (status, answer). Progress is counted in
        `steps` and `calls_made` as it happens, so a run that fails midway reports it."""
        corrections, seen, force_next = 0, {}, False
        for step in range(1, self.config.max_steps + 1):
            self.steps = step
            if self.cancel.is_set():
                return "cancelled", ""
            if sum(self.usage.values()) >= self.config.token_budget:
                return "budget", ""
            force = self.steps <= self.config.required_steps or force_next
            message = self._turn(self.steps, messages, "required" if force else "auto")
            calls = message.get("tool_calls") or self._repair(self.steps, message)
            force_next = False
            if not calls:
                note, force_next = self._correction(message.get("content") or "",
                                                    self.calls_made)
                if note and corrections < self.config.corrections:
                    corrections += 1
                    messages.append({"role": "user", "content": note})
                    self.emit({"type": "user_message", "step": self.steps, "content": note})
                    continue
                return "completed", message.get("content") or ""
            self.calls_made += len(calls)
            outputs = self._outputs(self.steps, calls, seen)
            for call, output in zip(calls, outputs, strict=True):
                messages.append({"role": "tool", "tool_call_id": call.get("id", ""),
                                 "name": call["function"]["name"], "content": output})
        return "max_steps", ""

    def _preread(self, task: str, files: list[str]) -> str:
        """Files the task names, read for the model and appended to the task: like an
        @-mention in an editor. Small models otherwise edit files they never read. Plain
        text rather than a made-up read_file turn: after such a turn code-medium copied
        `<tool_response>` blocks instead of acting (5 of 17 runs).

        Secret files (`.env`, keys, credentials) are never pre-read: the prompt leaves this
        machine when the model is a provider, and a task naming `id_rsa` is no consent."""
        named = [f for f in mentioned(task, files) if not _SECRET_FILES.match_file(f)]
        parts = [self.toolset.execute(self.env, "read_file", {"path": path}, self.ctx,
                         self.config.max_result_chars).output
                 for path in named[: self.config.preread]]
        parts = [p for p in parts if _PRIVATE_KEY not in p]
        if not parts:
            return ""
        return ("\n\nThe files the task names, already read for you (you may edit them):\n\n"
                + "\n\n".join(parts))

    def _turn(self, step: int, messages: list[dict], tool_choice: str = "auto") -> dict:
        """One model call; on context overflow compact harder and retry once."""
        start = time.monotonic()
        sampling = Sampling(self.config.max_tokens, self.config.temperature, tool_choice)
        try:
            turn = self.model.complete(messages, self.tools, sampling, self.cancel)
        except ModelError as exc:
            if exc.code != "context_length_exceeded" or not self._compact(step, messages, 0):
                raise
            turn = self.model.complete(messages, self.tools, sampling, self.cancel)
        for key in self.usage:
            self.usage[key] += int(turn.usage.get(key) or 0)
        message = {k: v for k, v in turn.message.items()
                   if k in ("role", "content", "tool_calls")}
        messages.append(message)
        self.emit({"type": "model_turn", "step": step, "message": message, "usage": turn.usage,
                   "tool_choice": tool_choice, "finish_reason": turn.finish_reason,
                   "seconds": round(time.monotonic() - start, 3),
                   **({"logprobs": turn.logprobs} if turn.logprobs else {})})
        if int(turn.usage.get("prompt_tokens") or 0) > self.config.context_tokens:
            self._compact(step, messages, self.config.keep_turns)
        return message

    def _compact(self, step: int, messages: list[dict], keep_turns: int) -> bool:
        """Replace old tool results with a stub; the newest `keep_turns` turns stay whole.

        Deterministic stubs instead of an LLM summary: small local models summarise poorly
        and a stub keeps the KV-cache prefix up to the first compacted message."""
        turn_starts = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        cut = turn_starts[-keep_turns] if 0 < keep_turns <= len(turn_starts) else len(messages)
        changed = 0
        for msg in messages[2:cut]:
            content = msg.get("content") or ""
            if msg["role"] == "tool" and not content.startswith("[compacted"):
                msg["content"] = (f"[compacted: {len(content)} characters of {msg.get('name')} "
                                  "output removed to save context; call the tool again if "
                                  "needed]")
                changed += 1
        if changed:
            self.emit({"type": "compaction", "step": step, "messages_compacted": changed})
        return changed > 0

    def _repair(self, step: int, message: dict) -> list[dict]:
        """Calls to invented tool names whose arguments fit exactly one real tool, as calls
        of that tool. code-small mostly names the tool after the task
        (`{"name": "change_server_port", "arguments": {"path": ..., "start_line": 1}}`) and
        repeats itself word for word after a hint; the history then shows the right name."""
        content = message.get("content") or ""
        params = {t["function"]["name"]: t["function"]["parameters"] for t in self.tools}
        repaired = []
        for call in parse_tool_calls(content, _AnyName(params))[1]:
            args = _arguments(call.arguments)
            fits = [name for name, p in params.items() if isinstance(args, dict) and args
                    and set(p["required"]) <= set(args) <= set(p["properties"])]
            if call.name in params or len(fits) != 1:
                return []
            repaired.append({"id": call.id, "type": "function",
                             "function": {"name": fits[0], "arguments": call.arguments}})
        repaired = repaired or self._code_block_edit(content)
        if repaired:
            message.update(content="", tool_calls=repaired)
            self.emit({"type": "call_repair", "step": step, "original": content,
                       "tool_calls": repaired})
        return repaired

    def _code_block_edit(self, content: str) -> list[dict]:
        """A reply that shows new code instead of editing - what 1.5B models do most - as
        `edit_file(code_edit=<the code>)` on the file it belongs to, merged by the apply
        compartment (like an editor's Apply button on a chat code block). Only before any
        file changed, with one code block, for the one file this run has read that defines
        one of the block's functions or classes (Python, JavaScript, TypeScript)."""
        blocks = _FENCE.findall(content)
        if self.ctx.written or len(blocks) != 1 or "edit_file" not in {
                t["function"]["name"] for t in self.tools}:
            return []
        names = set(_DEFINES.findall(blocks[0]))
        owners = sorted(self.env.relative(p) for p in self.ctx.seen
                        if names & set(_DEFINES.findall(shown_text(self.env, p) or "")))
        if len(owners) != 1:
            return []
        args = json.dumps({"path": owners[0], "code_edit": blocks[0]})
        return [{"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                 "function": {"name": "edit_file", "arguments": args}}]

    def _correction(self, content: str, calls_made: int) -> tuple[str | None, bool]:
        """A hint instead of ending the run, when a reply is not really a final answer, and
        whether the next turn must call a tool.

        Before the answer: it names a tool that does not exist (small models invent them),
        imitates a tool result, shows code instead of editing, or nothing was done at all.
        At the answer, what a reviewer would check first: the task asks for a change (or the
        answer claims one) but no file changed (code-medium said "I changed ..." after failed
        edits in 5 of 17 tasks, or restated the task), the changed files no longer parse, or
        tests exist and were never run after the last change."""
        names = {t["function"]["name"] for t in self.tools}
        bogus = {c.name for c in parse_tool_calls(content, _AnyName(names))[1]} - names
        if bogus:
            return (f"error: {', '.join(sorted(bogus))} is not a tool. Available tools: "
                    f"{', '.join(sorted(names))}. Call one of them."), False
        if "<tool_response>" in content or "<tool_call>" in content:
            return FAKE_RESULT, False
        if "```" in content and not self.ctx.written:
            return CODE_NOT_APPLIED, True
        if calls_made == 0:
            return NUDGE, False
        if not self.ctx.written and (self._change_task or _CLAIM.search(content)):
            why = ("every edit you tried failed" if self._failed_writes
                   else "you have not edited any file")
            return NOTHING_CHANGED.format(why=why), True
        errors = [e for p in sorted(self.ctx.written)
                  if (source := shown_text(self.env, p)) is not None
                  for e in syntax_errors(p, source, self.env.relative(p))]
        if errors:
            return BROKEN.format(errors="\n".join(errors[:5])), True
        if self._needs_check():
            self._verified = True
            return VERIFY, True
        return (EMPTY if not content.strip() else None), False

    def _needs_check(self) -> bool:
        """Python changed, the repository has tests, and no command ran since: asked once."""
        return (self._has_tests and not self._verified and not self.ctx.checked
                and any(p.suffix == ".py" for p in self.ctx.written)
                and "run_terminal_cmd" in {t["function"]["name"] for t in self.tools})

    def _outputs(self, step: int, calls: list[dict], seen: dict[str, str]) -> list[str]:
        """Run a turn's calls; identical repeats get a pointer instead of a second copy."""
        keys = [json.dumps([c["function"]["name"], _arguments(c["function"].get("arguments"))],
                           sort_keys=True) for c in calls]
        first: dict[str, int] = {}  # identical calls since the last write or command
        source: dict[int, int] = {}  # index of a collapsed call -> the call it repeats
        run: list[int] = []
        for i, key in enumerate(keys):
            if key in first:
                source[i] = first[key]
            elif len(run) < self.config.max_calls_per_turn:
                run.append(i)
                first[key] = i
                spec = self.toolset.get(calls[i]["function"]["name"])
                if spec is not None and spec.access in ("write", "exec"):
                    first = {}
        results = dict(zip(run, self._execute(step, [calls[i] for i in run]), strict=True))
        outputs = []
        for i, key in enumerate(keys):
            if i in results:
                out = results[i].output
                repeat = seen.get(key) == out  # same call, same answer: the model is looping
                seen[key] = out
                outputs.append(out + ("\n[note: you already made this exact call and got this "
                                      "result; do something different]" if repeat else ""))
            elif i in source:
                outputs.append(f"[same call as #{source[i] + 1} in this turn; see its result]")
            else:
                outputs.append(f"error: not run - at most {self.config.max_calls_per_turn} "
                               "tool calls per turn")
        return outputs

    def _execute(self, step: int, calls: list[dict]) -> list[ToolResult]:
        """Run calls; each waits only for earlier calls it conflicts with.

        Calls that wait on a subprocess or the network go to a pool that lives as long as
        the run (starting threads per turn costs ~1-4 ms each on a loaded 2-core machine);
        pure-Python tools (`Tool.inline`) run on this thread, in order, meanwhile. Serial
        mode uses no thread at all."""
        parsed = [(c["function"]["name"], _arguments(c["function"].get("arguments")))
                  for c in calls]
        if not self.config.parallel:
            return [self._one(step, i, c, parsed[i]) for i, c in enumerate(calls)]
        futures: list[Future] = [Future() for _ in calls]
        deps = [[futures[j] for j in range(i)
                 if self.toolset.conflicts(self.env, parsed[j], parsed[i])]
                for i in range(len(calls))]
        inline = [i for i, (name, _) in enumerate(parsed)
                  if (spec := self.toolset.get(name)) is None or spec.inline]
        for i in range(len(calls)):
            if i not in inline:
                self._workers().submit(self._settle, futures[i], deps[i], step, i, calls[i],
                                       parsed[i])
        for i in inline:
            self._settle(futures[i], deps[i], step, i, calls[i], parsed[i])
        return [f.result() for f in futures]

    def _workers(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.config.max_calls_per_turn,
                                            thread_name_prefix=f"agent-{self.run_id}")
        return self._pool

    def _settle(self, future: Future, deps: list[Future], *call: Any) -> None:
        for dep in deps:
            dep.exception()  # wait; a failed dependency does not stop this call
        try:
            future.set_result(self._one(*call))
        except BaseException as exc:  # noqa: BLE001 - re-raised by future.result()
            future.set_exception(exc)

    def _one(self, step: int, index: int, call: dict, parsed: tuple[str, Any]) -> ToolResult:
        name, args = parsed
        base = {"step": step, "index": index, "call_id": call.get("id", ""), "name": name}
        self.emit({"type": "tool_start", **base, "arguments": args})
        result = self.toolset.execute(self.env, name, args, self.ctx,
                                      self.config.max_result_chars)
        spec = self.toolset.get(name)
        if not result.ok and spec is not None and spec.access == "write":
            self._failed_writes += 1
        self.emit({"type": "tool_result", **base, **result.to_dict()})
        return result


def _arguments(raw: Any) -> dict | str:
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw or "{}")
    except ValueError:
        return str(raw)
    return value if isinstance(value, dict) else str(raw)


# Never pre-read into a prompt. Narrower than the index's ignore list (indexing/scan.py),
# which also skips build and vendor folders that a task may rightly name.
_SECRET_FILES = pathspec.GitIgnoreSpec.from_lines([
    ".env", ".env.*", "*.env", ".envrc", "*.pem", "*.key", "*.p12", "*.pfx", "*.jks",
    "*.keystore", "id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*", ".ssh/", ".aws/",
    ".gnupg/", ".netrc", ".npmrc", ".pypirc", ".git-credentials", "credentials*.json",
    "secret*.json", "secret*.y*ml", "secret*.toml", "*.secret", ".htpasswd"])
_PRIVATE_KEY = "PRIVATE KEY-----"  # a PEM key under any name
_TEST_FILE = re.compile(r"(^|/)(tests?/|test_[^/]*\.py$|[^/]*_test\.py$)")
# A task that asks for a change ("Fix ...", "rename ...", "should also include ...").
_CHANGE = re.compile(r"\b(?:fix|implement|rename|add|change|create|delete|remove|update|"
                     r"replace|refactor|move|edit|include|make)\b", re.IGNORECASE)
# A final answer that reports a change: "I changed ...", "... and fixed it", "has been added".
_CLAIM = re.compile(r"\b(?:changed|updated|fixed|modified|renamed|added|removed|replaced|"
                    r"implemented|created|deleted|edited|corrected)\b", re.IGNORECASE)
_FENCE = re.compile(r"```[\w+-]*[ \t]*\n(.*?)```", re.DOTALL)
# Definitions that tie a code block to a file: Python `def`/`class`, JS/TS `function`/`class`.
_DEFINES = re.compile(r"^[ \t]*(?:export[ \t]+)?(?:async[ \t]+)?(?:def|class|function)"
                      r"[ \t]+(\w+)", re.MULTILINE)


class _AnyName(set):
    """Lets the lenient tool-call parser find calls to names that are not tools."""

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and bool(name)


class Transcript:
    """Appends every event as one JSON line (flushed, so a killed run keeps its history)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")

    def __call__(self, event: Event) -> None:
        self._file.write(json.dumps(event, default=str) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
