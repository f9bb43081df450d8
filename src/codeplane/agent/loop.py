"""The agent loop: Model -> tool calls -> Environment, until the model answers without tools.

Three small parts, in the spirit of mini-swe-agent: a `ChatModel` (`core/chat.py`: the HTTP
client, the server's in-process gateway client, or a training policy), an `Environment`
(env.py) and `Agent`. The small-model repairs are switchable hooks (hooks.py): the product runs
them all, a training run may run none, and `run_start` records which were on. Every step emits
events; the same events feed the Rich CLI, the server's SSE stream and the JSONL transcript, so
what a user sees, what an RL trainer replays and what the API returns cannot drift apart.

The loop is steppable - `start(task)`, then `step()` until it returns a status, then
`finish(...)` - so an RL rollout drives this very loop with its policy as the `ChatModel`
(rl/rollout.py) instead of keeping a second one; `run(task)` is that sequence for the product.

Several tool calls in one model turn run concurrently on a thread pool; a call waits only for
earlier calls it conflicts with (same file written, or a command), and results go back to the
model in call order.

A reply is never taken as the answer while it carries tool-call or tool-response markup (a call
written as text, or a made-up tool result): calls the product's parser finds in it run; anything
else gets a hint; when the hints are used up the run ends `malformed`, not `completed`.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from codeplane.agent.env import Environment
from codeplane.agent.hooks import (
    PRODUCT_HOOKS,
    AnyName,
    arguments,
    invented_tools_note,
    make_hooks,
    tool_names,
)
from codeplane.agent.prompts import FAKE_RESULT, system_prompt, task_message
from codeplane.agent.tools import CORE, default_toolset
from codeplane.agent.tools.common import list_files
from codeplane.agent.toolset import ToolContext, ToolResult, ToolServices, Toolset
from codeplane.core.chat import Cancelled, ChatModel, ModelError, Sampling
from codeplane.models.toolcalls import parse_tool_calls

Event = dict[str, Any]
log = logging.getLogger("codeplane.agent")
# Text only a tool call or a tool result carries (the Hermes format of the chat template).
MARKUP_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# What is left of a reply when its last call written as text was cut off by the token limit.
CUT_CALL = re.compile(r'\{\s*"name"\s*:')


def is_markup(content: str) -> bool:
    """Does a reply carry tool-call or tool-response markup instead of an answer: either tag,
    or nothing but calls in a form the product's parser reads (tagged, fenced or bare JSON),
    whatever their names, the last of them possibly cut off by the token limit. JSON inside
    prose ("the file holds {"name": ...}") is an answer."""
    if any(tag in content for tag in MARKUP_TAGS):
        return True
    rest, calls = parse_tool_calls(content, AnyName())
    return (bool(calls) and not rest.strip()) or bool(CUT_CALL.match(rest.lstrip()))


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
    # a grammar, so the first call is well-formed JSON (docs/agent.md, "Measured", has what
    # it gained). OpenAI-compatible providers accept it too.
    required_steps: int = 1
    read_before_edit: bool = True  # edit_file refuses files not read in this run
    preread: int = 4  # files named in the task the harness reads before the first turn
    toolset: str = "full"  # "full" (all tools) or "core" (8 tools, simpler schemas)
    # The last of max_steps turns is asked without tools (tool_choice "none"): a run at its
    # step limit ends with the model's answer (or `malformed`) instead of `max_steps`. Off in
    # the product's defaults; an RL run may turn it on to score episodes the limit would cut.
    answer_turn: bool = False


@dataclass
class RunResult:
    run_id: str
    status: str  # completed | malformed | max_steps | budget | cancelled | error
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


@dataclass(frozen=True)
class StepOutcome:
    """What one `Agent.step` ended with: `status` None while the run goes on, else its
    terminal status, with the answer when it is `completed`."""

    status: str | None = None
    answer: str = ""


class Agent:
    """The loop. `hooks` names the small-model repairs to run (hooks.py; default: all of
    them, as the product does; `()` runs the plain loop, as a training run may); `services`
    what its tools reach beyond the workspace (default: no index, deterministic merges)."""

    def __init__(self, model: ChatModel, env: Environment, config: AgentConfig | None = None,
                 on_event: Callable[[Event], None] | None = None,
                 cancel: threading.Event | None = None, services: ToolServices | None = None,
                 run_id: str | None = None, toolset: Toolset | None = None,
                 hooks: tuple[str, ...] | list[str] = PRODUCT_HOOKS) -> None:
        self.model, self.env = model, env
        self.hooks = make_hooks(hooks)
        self.toolset = toolset or default_toolset()
        self.config = config or AgentConfig()
        self.cancel = cancel or threading.Event()
        self.ctx = ToolContext(services=services or ToolServices(), cancel=self.cancel,
                               read_before_edit=self.config.read_before_edit)
        self.listeners = [on_event] if on_event else []
        self.run_id = run_id or uuid.uuid4().hex[:16]
        self.tools = (self.toolset.schemas(CORE, core=True) if self.config.toolset == "core"
                      else self.toolset.schemas())
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.failed_writes = 0
        self._start = time.monotonic()
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0}
        self.steps = self.calls_made = 0
        self.messages: list[dict] = []  # the conversation as the model is next shown it
        self.hints = 0  # hints given instead of ending the run (at most config.corrections)
        self.repairs: Counter = Counter()  # hook (or "parser") -> replies turned into calls
        self._seen: dict[str, str] = {}  # call -> its last output: repeats get a note
        self._force_next = False  # a hint asked for a tool call next turn

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
        status, answer, error = "error", "", None
        try:
            self.start(task)
            while (outcome := self.step()).status is None:
                pass
            status, answer = outcome.status, outcome.answer
        except ModelError as exc:
            status, error = "error", str(exc)
        except Exception as exc:  # any failure must still end the run
            log.exception("agent run %s failed", self.run_id)
            status, error = "error", f"internal error: {type(exc).__name__}: {exc}"
        finally:
            self.close()
        return self.finish(status, answer, error)

    def start(self, task: str) -> None:
        """The first two messages, announced by `run_start`."""
        self._start = time.monotonic()
        files = list(list_files(self.env, self.env.root))
        user = task_message(task, files) + "".join(h.start(self, task, files)
                                                   for h in self.hooks)
        system = system_prompt(s["function"]["name"] for s in self.tools)
        self.messages = [{"role": "system", "content": system},
                         {"role": "user", "content": user}]
        self.emit({"type": "run_start", "time": time.time(), "task": task,
                   "model": self.model.name, "model_info": self.model.describe(),
                   "environment": self.env.metadata(), "config": asdict(self.config),
                   "hooks": [h.name for h in self.hooks], "tools": self.tools,
                   "messages": list(self.messages)})

    def step(self) -> StepOutcome:
        """One model turn and the tool calls it made (or a hint instead of its reply), or
        the run's end: its answer, or a limit reached before the turn. Progress is counted
        in `steps` and `calls_made` as it happens, so a run that fails midway reports it.
        Raises ModelError, and whatever else failed; a cancelled model reply is the
        `cancelled` status."""
        if self.steps >= self.config.max_steps:
            return StepOutcome("max_steps")
        self.steps += 1
        if self.cancel.is_set():
            return StepOutcome("cancelled")
        if sum(self.usage.values()) >= self.config.token_budget:
            return StepOutcome("budget")
        try:
            return self._step()
        except Cancelled:
            return StepOutcome("cancelled")

    def finish(self, status: str, answer: str = "", error: str | None = None) -> RunResult:
        """The result, announced by `run_end` (always the last event)."""
        if status != "error" and self.cancel.is_set():
            status = "cancelled"
        result = RunResult(self.run_id, status, answer, self.steps, self.calls_made,
                           self.usage["prompt_tokens"], self.usage["completion_tokens"],
                           round(time.monotonic() - self._start, 3), self.model.name,
                           error=error, todos=list(self.ctx.todos))
        self.emit({"type": "run_end", **result.to_dict(), "messages": self.messages})
        return result

    def close(self) -> None:
        """Stop the tool threads (they live as long as the run)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def _step(self) -> StepOutcome:
        last = self.config.answer_turn and self.steps == self.config.max_steps
        force = self.steps <= self.config.required_steps or self._force_next
        choice = "none" if last else "required" if force else "auto"
        message = self._turn(self.steps, self.messages, choice)
        if last:
            return self._answer(message)
        calls = message.get("tool_calls") or self._repair(self.steps, message)
        self._force_next = False
        if not calls:
            return self._reply(message.get("content") or "")
        self.calls_made += len(calls)
        outputs = self._outputs(self.steps, calls, self._seen)
        for call, output in zip(calls, outputs, strict=True):
            self.messages.append({"role": "tool", "tool_call_id": call.get("id", ""),
                                  "name": call["function"]["name"], "content": output})
        return StepOutcome()

    def _reply(self, content: str) -> StepOutcome:
        """A reply without tool calls: a hint instead of the end while hints are left (the
        run goes on), else the answer - unless it is markup, which is never one."""
        note, self._force_next = self._correction(content)
        if note and self.hints < self.config.corrections:
            self.hints += 1
            self.messages.append({"role": "user", "content": note})
            self.emit({"type": "user_message", "step": self.steps, "content": note})
            return StepOutcome()
        return StepOutcome("malformed") if is_markup(content) else StepOutcome("completed",
                                                                                content)

    @staticmethod
    def _answer(message: dict) -> StepOutcome:
        """The answer turn's reply is the answer: no call of it runs, no hint follows (no
        turn is left), and calls or markup are no answer."""
        content = message.get("content") or ""
        if message.get("tool_calls") or is_markup(content):
            return StepOutcome("malformed")
        return StepOutcome("completed", content)

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
        """Tool calls recovered from a reply that made none: calls of offered tools that the
        product's parser finds in its text (a model or provider that sent them as text),
        else the first hook's. The reply is rewritten to carry them, so the history shows
        the calls that ran."""
        content = message.get("content") or ""
        found = parse_tool_calls(content, tool_names(self))[1]
        repaired, source = [c.to_openai() for c in found], "parser"
        for hook in [] if repaired else self.hooks:
            repaired, source = hook.repair(self, content), hook.name
            if repaired:
                break
        if repaired:
            self.repairs[source] += 1
            message.update(content="", tool_calls=repaired)
            self.emit({"type": "call_repair", "step": step, "hook": source,
                       "original": content, "tool_calls": repaired})
        return repaired

    def _correction(self, content: str) -> tuple[str | None, bool]:
        """The hint for a reply without tool calls, and whether the next turn must call a
        tool; (None, False) when the reply is the answer. Markup always gets one (whatever
        the hooks); otherwise the first hook's."""
        if is_markup(content):
            return invented_tools_note(content, tool_names(self)) or FAKE_RESULT, False
        for hook in self.hooks:
            note, force = hook.correct(self, content)
            if note:
                return note, force
        return None, False

    def _outputs(self, step: int, calls: list[dict], seen: dict[str, str]) -> list[str]:
        """Run a turn's calls; identical repeats get a pointer instead of a second copy."""
        keys = [json.dumps([c["function"]["name"], arguments(c["function"].get("arguments"))],
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
        the run (starting threads every turn cost more than a read_file on a loaded machine:
        docs/agent.md, "Measured");
        pure-Python tools (`Tool.inline`) run on this thread, in order, meanwhile. Serial
        mode uses no thread at all."""
        parsed = [(c["function"]["name"], arguments(c["function"].get("arguments")))
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
            self.failed_writes += 1
        self.emit({"type": "tool_result", **base, **result.to_dict()})
        return result


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
