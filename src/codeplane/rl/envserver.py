"""The environment server: one sandboxed workspace per episode, the workspace calls of the
product's tools, and the verifier.

An episode is the product's own `Agent` (agent/loop.py), driven by the rollout worker
(rl/rollout.py) with the policy as its `ChatModel`: the same prompt, tools, parsing, repairs,
compaction and limits as `codeplane agent`. What lives here is what must stay with the sandbox:
a fresh copy of the task's repository opened on a backend from `sandbox/workspace.py`'s table
(bwrap by default), the `Workspace` calls the agent's tools make on it, and the verifier.

`EnvServer` is plain Python. In-process (tests) `open(task)` hands the agent the workspace
itself; the rollout manager runs each server as a Ray actor (rl/actor.py), and the agent
reaches the workspace through a `RemoteWorkspace` whose calls land in `workspace` and `exec`
here, so a crashed sandbox takes down one actor, never the trainer.

Faults are typed so the rollout manager can count them: `EnvFault(kind)` with kind
"sandbox_killed", "tool_timeout" or "verifier_crash". `fault_rate` injects them on purpose
(bench/rl/faults.py) on the calls that do a sandbox's work - a command or trusted program
(`exec`) and the verifier: the injected fault is the real failure path (the actor process
exits, the call raises), not a flag; never set it outside a Ray actor.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from codeplane.agent.env import Environment
from codeplane.rl import commits, fixcommits
from codeplane.rl.tasks import Task, score
from codeplane.rl.testfix import FixTask, run_fix_test
from codeplane.sandbox import DEFAULT_BACKEND, CommandResult, Limits, open_workspace
from codeplane.sandbox.runner import SandboxUnavailable

# The `Workspace` methods a remote agent may call through `EnvServer.workspace` (exec has its
# own entry, to be cancellable; close belongs to the server).
WORKSPACE_CALLS = frozenset({"real", "read", "write", "remove", "stat", "list", "snapshot",
                             "diff", "describe"})


class EnvFault(Exception):
    """The environment failed (not the policy): the episode is retried or masked."""

    def __init__(self, kind: str, message: str = "") -> None:
        super().__init__(f"{kind}: {message}" if message else kind)
        self.kind = kind


class EnvConfig(BaseModel):
    """`[env]`: the sandbox each environment server runs (what the policy is shown, the
    agent's settings, is `[rollout]`)."""

    model_config = {"extra": "forbid", "frozen": True}
    backend: str = Field(DEFAULT_BACKEND, description="a workspace backend (sandbox.BACKENDS)")
    timeout: float = Field(30.0, gt=0, description="seconds per command")
    fault_rate: float = Field(0.0, ge=0, le=1, description="injected faults per call "
                                                           "(benchmarks only)")
    seed: int = 0


class EnvServer:
    """One workspace at a time: `reset(task)` makes a fresh copy of the task's snapshot and
    opens it, `verify(answer)` scores the episode. In-process there is nothing between the
    agent and the workspace that could fail on its own, so `fault` stays None (a `RayEnv`
    latches its transport's failures there)."""

    fault: EnvFault | None = None

    def __init__(self, config: EnvConfig | None = None, scratch: str | None = None) -> None:
        self.config = config or EnvConfig()
        self.scratch = Path(scratch or tempfile.gettempdir())
        self.task: Task | FixTask | None = None
        self.env: Environment | None = None
        self.dir: Path | None = None
        self.faults = random.Random(self.config.seed)
        self._cancels: dict[str, threading.Event] = {}  # running commands, by caller's key

    def limits(self) -> Limits:
        """The limits every command of an episode runs under."""
        return Limits(timeout=self.config.timeout)

    def reset(self, task: Task | FixTask) -> dict[str, Any]:
        """A fresh sandboxed copy of the task's repository; returns what a remote agent
        needs to know of its workspace (`root`, `sandboxed`, `describe()`)."""
        self.close()
        self.dir = Path(tempfile.mkdtemp(prefix="rl-", dir=self.scratch))
        shutil.copytree(task.snapshot, self.dir / "repo", symlinks=True)
        try:
            workspace = open_workspace(self.dir / "repo", self.config.backend)
        except SandboxUnavailable as exc:
            raise EnvFault("sandbox_killed", str(exc)) from None
        self.env = Environment(workspace, self.limits())
        self.task = task
        return {"root": str(workspace.root), "sandboxed": workspace.sandboxed,
                "describe": workspace.describe()}

    def open(self, task: Task | FixTask) -> Environment:
        """In-process: `reset`, and the episode's environment itself."""
        self.reset(task)
        return self._env()

    def workspace(self, method: str, *args: Any) -> Any:
        """One `Workspace` call on the episode's workspace: how a `RemoteWorkspace` reaches
        it. Whatever the workspace raises (a missing file, a refused path) goes back to the
        caller, whose tool handles it as it would locally."""
        if method not in WORKSPACE_CALLS:
            raise ValueError(f"no workspace call {method!r}")
        return getattr(self._env().workspace, method)(*args)

    def exec(self, command: str | list[str], limits: Limits, stderr: bool,
             key: str) -> CommandResult:
        """`Workspace.exec`, which `cancel(key)` stops as the agent's cancel stops a local
        command (the process group is killed)."""
        workspace = self._env().workspace
        self._maybe_fault(("sandbox_killed", "tool_timeout"))
        cancel = self._cancels[key] = threading.Event()
        try:
            return workspace.exec(command, limits, cancel, stderr)
        except SandboxUnavailable as exc:  # the sandbox itself broke, not the command
            raise EnvFault("sandbox_killed", str(exc)) from None
        finally:
            self._cancels.pop(key, None)

    def cancel(self, key: str) -> None:
        """Stop the command `exec` runs under `key` (nothing if it has ended)."""
        event = self._cancels.get(key)
        if event is not None:
            event.set()

    def verify(self, answer: str) -> float:
        """The reward for a final answer; a failing-test task runs its test in this
        episode's sandbox (never on the host)."""
        if self.task is None:
            raise EnvFault("verifier_crash", "verify before reset")
        self._maybe_fault(("verifier_crash",))
        try:
            if isinstance(self.task, FixTask):
                return run_fix_test(self.task, self._env(), self._repo())
            if isinstance(self.task, fixcommits.FixCommitTask):
                return fixcommits.verify(self.task, self._env(), self._repo())
            if isinstance(self.task, commits.CommitTask):
                return commits.score(self.task, answer)
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
            raise EnvFault("sandbox_killed", "workspace call before reset")
        return self.env

    def _repo(self) -> Path:
        if self.dir is None:
            raise EnvFault("sandbox_killed", "verify before reset")
        return self.dir / "repo"

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
