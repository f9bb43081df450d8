"""The environment server: one sandboxed workspace and the product's own tools, driven by tool
calls in the product's format (OpenAI `tool_calls`).

`EnvServer` is plain Python (tests drive it directly); the rollout manager runs each one as a
Ray actor (`ray.remote(EnvServer)`), so a crashed sandbox takes down one actor, never the
trainer. The tools are `agent/tools.py`'s `Toolset` over `agent/env.py`'s `Environment`, on a
workspace from `sandbox/workspace.py`'s backend table (bwrap by default) - no second copy of any
tool: a policy trained here meets exactly the tools the product gives it.

Faults are typed so the rollout manager can count them: `EnvFault(kind)` with kind
"sandbox_killed", "tool_timeout" or "verifier_crash". `fault_rate` injects them on purpose
(bench/rl/faults.py): the injected fault is the real failure path (the actor process exits, a
tool or the verifier raises), not a flag; never set it outside a Ray actor.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from codeplane.agent.env import Environment
from codeplane.agent.hooks import Hook, arguments, make_hooks
from codeplane.agent.loop import AgentConfig
from codeplane.agent.prompts import SYSTEM, task_message
from codeplane.agent.tools import CORE, ToolContext, Toolset, default_toolset, list_files
from codeplane.rl.tasks import SYSTEM as TASK_SYSTEM
from codeplane.rl.tasks import Task, score
from codeplane.rl.testfix import FixTask, run_fix_test
from codeplane.sandbox import DEFAULT_BACKEND, Limits, open_workspace
from codeplane.sandbox.runner import SandboxUnavailable

FAULTS = ("sandbox_killed", "tool_timeout", "verifier_crash")


class EnvFault(Exception):
    """The environment failed (not the policy): the episode is retried or masked."""

    def __init__(self, kind: str, message: str = "") -> None:
        super().__init__(f"{kind}: {message}" if message else kind)
        self.kind = kind


class EnvConfig(BaseModel):
    """`[env]`: the workspace and tools each environment server runs."""

    model_config = {"extra": "forbid", "frozen": True}
    backend: str = Field(DEFAULT_BACKEND, description="a workspace backend (sandbox.BACKENDS)")
    timeout: float = Field(30.0, gt=0, description="seconds per command")
    max_result_chars: int = Field(4000, ge=200, description="per tool output, cut as the "
                                                            "product cuts it")
    toolset: Literal["core", "full"] = Field("core", description="core: 7 tools, simpler "
                                                                 "schemas; full: all")
    tools: tuple[str, ...] = Field((), description="only these of the product's tools, by "
                                                   "name (empty: the whole toolset); their "
                                                   "schemas are most of a short prompt")
    prompt: Literal["agent", "task"] = Field(
        "agent", description="agent: the product's system prompt and file list; task: the "
                             "task family's short system prompt (rl/tasks.py) and the bare "
                             "instruction (short contexts: the trainer's CPU time grows with "
                             "them)")
    fault_rate: float = Field(0.0, ge=0, le=1, description="injected faults per call "
                                                           "(benchmarks only)")
    seed: int = 0

    @field_validator("tools")
    @classmethod
    def _known(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        known = default_toolset().tools
        unknown = sorted(set(names) - set(known))
        if unknown:
            raise ValueError(f"unknown tool(s) {', '.join(unknown)}; the product's tools: "
                             f"{', '.join(known)}")
        return names


@dataclass
class HookView:
    """What a hook reads of a running agent (`agent/hooks.py`: `env`, `toolset`, `tools`,
    `ctx`, `config`, `calls_made`, `failed_writes`), for an episode that the rollout loop
    runs instead of `Agent`. It lives in the environment server because the hooks read and
    run tools in the episode's workspace."""

    env: Environment
    toolset: Toolset
    tools: list[dict[str, Any]]
    ctx: ToolContext
    config: AgentConfig
    calls_made: int = 0
    failed_writes: int = 0


class EnvServer:
    """One workspace at a time: `reset(task, hooks)` makes a fresh copy of the task's
    snapshot, `step(tool_calls)` runs them with the product's tools, `verify(answer)` scores.
    With hooks (`agent/hooks.py`, named by the rollout), `repair` and `correct` are the
    product loop's small-model repairs over this episode's workspace."""

    def __init__(self, config: EnvConfig | None = None, scratch: str | None = None) -> None:
        self.config = config or EnvConfig()
        self.toolset: Toolset = default_toolset()
        if self.config.tools:  # a call to any other tool gets the product's unknown-tool error
            self.toolset = Toolset([self.toolset.tools[n] for n in self.config.tools])
        self.scratch = Path(scratch or tempfile.gettempdir())
        self.task: Task | None = None
        self.env: Environment | None = None
        self.ctx = ToolContext()
        self.dir: Path | None = None
        self.faults = random.Random(self.config.seed)
        self.hooks: list[Hook] = []
        self.view: HookView | None = None

    def tools(self) -> list[dict[str, Any]]:
        """The tool schemas the policy is shown, as the agent shows them."""
        core = self.config.toolset == "core"
        return self.toolset.schemas(CORE if core and not self.config.tools else None,
                                    core=core)

    def reset(self, task: Task | FixTask, hooks: tuple[str, ...] = ()
              ) -> list[dict[str, Any]]:
        """A fresh sandboxed copy of the task's repository; returns the first messages
        (the product's system prompt and task message, plus what the hooks add to it, as
        the product's loop builds it)."""
        self.close()
        self.dir = Path(tempfile.mkdtemp(prefix="rl-", dir=self.scratch))
        shutil.copytree(task.snapshot, self.dir / "repo", symlinks=True)
        try:
            workspace = open_workspace(self.dir / "repo", self.config.backend)
        except SandboxUnavailable as exc:
            raise EnvFault("sandbox_killed", str(exc)) from None
        self.env = Environment(workspace, Limits(timeout=self.config.timeout))
        self.ctx, self.task = ToolContext(), task
        self.hooks = make_hooks(hooks)
        self.view = HookView(self.env, self.toolset, self.tools(), self.ctx, AgentConfig(
            max_result_chars=self.config.max_result_chars, toolset=self.config.toolset))
        if self.config.prompt == "task":
            return [{"role": "system", "content": TASK_SYSTEM},
                    {"role": "user", "content": task.instruction}]
        files = list(list_files(self.env, self.env.root))
        added = "".join(h.start(self.view, task.instruction, files) for h in self.hooks)
        return [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": task_message(task.instruction, files) + added}]

    def step(self, tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Run one turn's calls in order; one `tool` message per call, in call order."""
        env = self._env()
        self._maybe_fault(("sandbox_killed", "tool_timeout"))
        out = []
        for call in tool_calls:
            fn = call.get("function") or {}
            name = str(fn.get("name") or "")
            try:
                result = self.toolset.execute(env, name, arguments(fn.get("arguments")),
                                              self.ctx, self.config.max_result_chars)
            except SandboxUnavailable as exc:  # the sandbox itself broke, not the call
                raise EnvFault("sandbox_killed", str(exc)) from None
            self._count(name, result.ok)
            out.append({"role": "tool", "tool_call_id": call.get("id", ""), "name": name,
                        "content": result.output})
        return out

    def repair(self, content: str) -> tuple[str, list[dict[str, Any]]] | None:
        """The first hook's tool calls recovered from a reply that made none, and that
        hook's name (None: nothing to recover, or no hooks)."""
        view = self._view()
        for hook in self.hooks:
            calls = hook.repair(view, content)  # type: ignore[arg-type]  # Agent's view
            if calls:
                return hook.name, calls
        return None

    def correct(self, content: str) -> tuple[str | None, bool]:
        """The first hook's hint for a reply without tool calls, and whether the next turn
        must call a tool; (None, False) when the reply stands as the answer."""
        view = self._view()
        for hook in self.hooks:
            note, force = hook.correct(view, content)  # type: ignore[arg-type]
            if note:
                return note, force
        return None, False

    def verify(self, answer: str) -> float:
        """The reward for a final answer; a failing-test task runs its test in this
        episode's sandbox (never on the host)."""
        if self.task is None:
            raise EnvFault("verifier_crash", "verify before reset")
        self._maybe_fault(("verifier_crash",))
        try:
            if isinstance(self.task, FixTask):
                return run_fix_test(self.task, self._env(), self._repo())
            return score(self.task, answer)
        except Exception as exc:  # a verifier bug is an environment fault, not reward 0
            raise EnvFault("verifier_crash", repr(exc)) from exc

    def close(self) -> None:
        """Drop the workspace and its copy."""
        if self.env is not None:
            self.env.close()
            self.env = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def _env(self) -> Environment:
        if self.env is None:
            raise EnvFault("sandbox_killed", "step before reset")
        return self.env

    def _repo(self) -> Path:
        if self.dir is None:
            raise EnvFault("sandbox_killed", "verify before reset")
        return self.dir / "repo"

    def _view(self) -> HookView:
        if self.view is None:
            raise EnvFault("sandbox_killed", "hooks before reset")
        return self.view

    def _count(self, name: str, ok: bool) -> None:
        """What the hooks read of the episode so far: calls made, failed writes."""
        if self.view is None:
            return
        self.view.calls_made += 1
        spec = self.toolset.get(name)
        if not ok and spec is not None and spec.access == "write":
            self.view.failed_writes += 1

    def _maybe_fault(self, kinds: tuple[str, ...]) -> None:
        """An injected fault, taking its real path: the actor process dies (the rollout
        manager sees a dead actor), or the call raises as a failing tool or verifier would."""
        if self.config.fault_rate <= 0 or self.faults.random() >= self.config.fault_rate:
            return
        kind = self.faults.choice(kinds)
        if kind == "sandbox_killed":
            self.close()
            os._exit(1)  # the whole actor process, as an OOM kill or a host reboot would
        raise EnvFault(kind, "injected")
