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
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from codeplane.agent.env import Environment
from codeplane.agent.hooks import arguments
from codeplane.agent.prompts import SYSTEM, task_message
from codeplane.agent.tools import CORE, ToolContext, Toolset, default_toolset, list_files
from codeplane.rl.tasks import SYSTEM as TASK_SYSTEM
from codeplane.rl.tasks import Task, score
from codeplane.sandbox import DEFAULT_BACKEND, Limits, open_workspace
from codeplane.sandbox.runner import SandboxUnavailable

FAULTS = ("sandbox_killed", "tool_timeout", "verifier_crash")
# Tool subsets by `[env] toolset` ("full": every tool). "search" is what the locate family
# needs; two schemas instead of seven keep the prompt (and the trainer's CPU time) short.
TOOLSETS = {"core": CORE, "search": ["grep", "read_file"]}


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
    toolset: Literal["core", "search", "full"] = Field(
        "core", description="core: 7 tools, simpler schemas; search: grep and read_file "
                            "only; full: all")
    prompt: Literal["agent", "task"] = Field(
        "agent", description="agent: the product's system prompt and file list; task: the "
                             "task family's short system prompt (rl/tasks.py) and the bare "
                             "instruction (short contexts: the trainer's CPU time grows with "
                             "them)")
    fault_rate: float = Field(0.0, ge=0, le=1, description="injected faults per call "
                                                           "(benchmarks only)")
    seed: int = 0


class EnvServer:
    """One workspace at a time: `reset(task)` makes a fresh copy of the task's snapshot,
    `step(tool_calls)` runs them with the product's tools, `verify(answer)` scores."""

    def __init__(self, config: EnvConfig | None = None, scratch: str | None = None) -> None:
        self.config = config or EnvConfig()
        self.toolset: Toolset = default_toolset()
        self.scratch = Path(scratch or tempfile.gettempdir())
        self.task: Task | None = None
        self.env: Environment | None = None
        self.ctx = ToolContext()
        self.dir: Path | None = None
        self.faults = random.Random(self.config.seed)

    def tools(self) -> list[dict[str, Any]]:
        """The tool schemas the policy is shown, as the agent shows them."""
        if self.config.toolset == "full":
            return self.toolset.schemas()
        return self.toolset.schemas(TOOLSETS[self.config.toolset], core=True)

    def reset(self, task: Task) -> list[dict[str, Any]]:
        """A fresh sandboxed copy of the task's repository; returns the first messages
        (the product's system prompt and task message)."""
        self.close()
        self.dir = Path(tempfile.mkdtemp(prefix="rl-", dir=self.scratch))
        shutil.copytree(task.snapshot, self.dir / "repo", symlinks=True)
        try:
            workspace = open_workspace(self.dir / "repo", self.config.backend)
        except SandboxUnavailable as exc:
            raise EnvFault("sandbox_killed", str(exc)) from None
        self.env = Environment(workspace, Limits(timeout=self.config.timeout))
        self.ctx, self.task = ToolContext(), task
        if self.config.prompt == "task":
            return [{"role": "system", "content": TASK_SYSTEM},
                    {"role": "user", "content": task.instruction}]
        files = list(list_files(self.env, self.env.root))
        return [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": task_message(task.instruction, files)}]

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
            out.append({"role": "tool", "tool_call_id": call.get("id", ""), "name": name,
                        "content": result.output})
        return out

    def verify(self, answer: str) -> float:
        """The reward for a final answer."""
        if self.task is None:
            raise EnvFault("verifier_crash", "verify before reset")
        self._maybe_fault(("verifier_crash",))
        try:
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
