"""An environment server in its own Ray actor (`RayEnv`), and the workspace an episode's agent
sees through it (`RemoteWorkspace`).

The agent - the product's loop, its tools and hooks - runs in the rollout worker next to the
sampler; the sandbox runs in the actor. `RemoteWorkspace` is the `Workspace` protocol
(sandbox/workspace.py) with every call going to the actor that owns the workspace, so the
product's tools run unchanged against a sandbox in another process. Not a row of the backend
table: a backend is made from a directory on this machine, this one from an actor.

What the workspace raises (a missing file, a refused path) comes back as itself, and the tool
handles it as it would locally. A failure of the server - its process dead, a call past
`call_timeout`, a broken sandbox, a fault injected on purpose - becomes `EnvFault` and is
latched in `RayEnv.fault`: the tools turn any exception into an error result for the model,
so the rollout worker reads the latch after every step and ends the episode as that fault
(counted, retried, masked; never trained on). Once latched, every later call fails at once
instead of waiting on a dead actor.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

from codeplane.agent.env import Environment
from codeplane.rl.envserver import EnvConfig, EnvFault, EnvServer
from codeplane.rl.tasks import Task
from codeplane.rl.testfix import FixTask
from codeplane.sandbox import CommandResult, Entry, FileStat, Limits, Snapshot

CANCEL_POLL_S = 0.2  # how often a worker waiting on a remote command looks at its cancel flag
# Calls one actor serves at once: a turn's parallel tool calls (AgentConfig.max_calls_per_turn)
# and a cancel that must get through while a command runs.
CONCURRENCY = 16


class RayEnv:
    """An `EnvServer` in its own Ray actor process; killed on close."""

    def __init__(self, config: EnvConfig, call_timeout: float, scratch: str | None = None,
                 num_cpus: float = 0.0) -> None:
        import ray

        self._ray = ray
        self.config, self.call_timeout = config, call_timeout
        self.fault: EnvFault | None = None
        self.actor = ray.remote(num_cpus=num_cpus, max_restarts=0,
                                max_concurrency=CONCURRENCY)(EnvServer).remote(config, scratch)

    def open(self, task: Task | FixTask) -> Environment:
        """A fresh copy of the task's repository in the actor, as the agent's environment."""
        opened = self._call("reset", task)
        return Environment(RemoteWorkspace(self, opened), Limits(timeout=self.config.timeout))

    def verify(self, answer: str) -> float:
        return self._call("verify", answer)

    def close(self) -> None:
        try:
            self._call("close")
        finally:
            self._ray.kill(self.actor)

    def workspace(self, method: str, *args: Any) -> Any:
        """A `Workspace` call on the episode's workspace in the actor."""
        return self._call("workspace", method, *args)

    def exec(self, command: str | list[str], limits: Limits, cancel: threading.Event | None,
             stderr: bool) -> CommandResult:
        """`Workspace.exec` in the actor; the agent's `cancel` reaches the command there."""
        if self.fault is not None:
            raise self.fault
        key = uuid.uuid4().hex
        ref = self.actor.exec.remote(command, limits, stderr, key)
        deadline = time.monotonic() + self.call_timeout
        while (cancel is not None and time.monotonic() < deadline
               and not self._ray.wait([ref], timeout=CANCEL_POLL_S)[0]):
            if cancel.is_set():
                self.actor.cancel.remote(key)
                break
        return self._get(ref, "exec")

    def _call(self, method: str, *args: Any) -> Any:
        if self.fault is not None:
            raise self.fault
        return self._get(getattr(self.actor, method).remote(*args), method)

    def _get(self, ref: Any, method: str) -> Any:
        ray = self._ray
        try:
            return ray.get(ref, timeout=self.call_timeout)
        except ray.exceptions.GetTimeoutError:
            raise self._latch("tool_timeout", f"{method} took over {self.call_timeout}s"
                              ) from None
        except ray.exceptions.RayActorError as exc:
            raise self._latch("sandbox_killed", type(exc).__name__) from None
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, EnvFault):
                raise self._latch(cause.kind, str(cause)) from None
            if method in ("workspace", "exec"):
                raise cause from None  # the workspace's own answer, as a local one raises it
            raise self._latch("verifier_crash" if method == "verify" else "sandbox_killed",
                              str(cause)[:200]) from None

    def _latch(self, kind: str, message: str) -> EnvFault:
        """The server's first failure, kept: the episode ends as this fault."""
        if self.fault is None:
            self.fault = EnvFault(kind, message)
        return self.fault


class RemoteWorkspace:
    """The `Workspace` protocol over a `RayEnv`: each call runs in the actor that owns the
    sandbox. `close` gives nothing back: the server drops the workspace at its next reset."""

    def __init__(self, env: RayEnv, opened: dict[str, Any]) -> None:
        self.env = env
        self.root = Path(opened["root"])
        self.sandboxed = bool(opened["sandboxed"])
        self._described = dict(opened["describe"])

    def real(self, path: Path) -> Path:
        return self.env.workspace("real", path)

    def read(self, path: Path, max_bytes: int) -> bytes:
        return self.env.workspace("read", path, max_bytes)

    def write(self, path: Path, data: bytes) -> None:
        self.env.workspace("write", path, data)

    def remove(self, path: Path) -> None:
        self.env.workspace("remove", path)

    def stat(self, path: Path) -> FileStat | None:
        return self.env.workspace("stat", path)

    def list(self, path: Path) -> list[Entry]:
        return self.env.workspace("list", path)

    def exec(self, command: str | list[str], limits: Limits,
             cancel: threading.Event | None = None, stderr: bool = True) -> CommandResult:
        return self.env.exec(command, limits, cancel, stderr)

    def snapshot(self) -> Snapshot:
        return self.env.workspace("snapshot")

    def diff(self, since: Snapshot) -> str:
        return self.env.workspace("diff", since)

    def describe(self) -> dict[str, Any]:
        return dict(self._described)

    def close(self) -> None:
        """Nothing to give back here (see the class docstring)."""
