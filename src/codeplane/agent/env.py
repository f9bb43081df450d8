"""The Environment every tool runs against: a workspace root plus a command runner.

One interface for the product and for RL training: `codeplane agent`, `codeplane tool`, the
server's agent runs and future training environment servers all build a `LocalEnvironment` and
call the same tool functions on it. Paths given by the model are resolved here and refused if
they (or any symlink along them) lead outside the workspace.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any, Protocol

from codeplane.sandbox import BwrapRunner, CommandResult, HostRunner, Limits, Runner
from codeplane.sandbox.files import Refused, confine

TOOL_OUTPUT_BYTES = 64 << 20  # what a trusted tool (rg, ruff) may print before it is killed


class ToolError(Exception):
    """A tool cannot do what was asked; the message goes back to the model verbatim."""


class Environment(Protocol):
    root: Path
    limits: Limits

    def resolve(self, path: str, write: bool = False) -> Path: ...

    def run(self, command: str, timeout: float | None = None,
            cancel: threading.Event | None = None) -> CommandResult: ...

    def exec(self, argv: list[str], timeout: float = 60, stderr: bool = False
             ) -> CommandResult: ...

    def metadata(self) -> dict[str, Any]: ...


class LocalEnvironment:
    """A directory on this machine; commands go through `runner` (bubblewrap by default)."""

    def __init__(self, root: Path, runner: Runner, limits: Limits | None = None) -> None:
        self.root = root.resolve()
        self.runner = runner
        self.limits = limits or Limits()

    def resolve(self, path: str, write: bool = False) -> Path:
        """Absolute real path inside the workspace; ToolError for anything that escapes.

        Writes into `.git` are refused too: a planted hook would run later on the host,
        outside any sandbox (the sandbox mounts `.git` read-only for the same reason)."""
        if not isinstance(path, str) or not path.strip():
            raise ToolError("path must be a non-empty string")
        raw = Path(path.strip())
        inner = str(self.root).lstrip("/") + "/"
        if str(raw).startswith(inner):  # small models drop the leading "/" of the root
            raw = Path(str(raw)[len(inner):])
        try:
            real = confine(self.root, raw)
        except Refused as exc:
            raise ToolError(f"{exc}; only files under {self.root} are accessible") from None
        git = self.root / ".git"
        if write and (real == git or git in real.parents):
            raise ToolError(f"path {path!r} is inside .git, which the agent may not modify")
        return real

    def relative(self, path: Path) -> str:
        return "." if path == self.root else str(path.relative_to(self.root))

    def run(self, command: str, timeout: float | None = None,
            cancel: threading.Event | None = None) -> CommandResult:
        limits = self.limits
        if timeout is not None:
            limits = dataclasses.replace(limits, timeout=min(timeout, limits.timeout))
        return self.runner.run(command, self.root, limits, cancel)

    def exec(self, argv: list[str], timeout: float = 60, stderr: bool = False
             ) -> CommandResult:
        """A trusted program (absolute path) over the workspace, read-only, inside the
        sandbox: how the harness runs ripgrep and ruff, so nothing in the workspace is ever
        read or executed by a process on the host. Output is stdout (plus stderr if asked),
        uncut up to TOOL_OUTPUT_BYTES."""
        limits = dataclasses.replace(self.limits, timeout=min(timeout, self.limits.timeout),
                                     output_bytes=TOOL_OUTPUT_BYTES,
                                     drain_bytes=TOOL_OUTPUT_BYTES)
        return self.runner.exec(argv, self.root, limits, stderr)

    def metadata(self) -> dict[str, Any]:
        return {"root": str(self.root), "sandboxed": self.runner.sandboxed,
                **self.runner.describe(), "network": self.limits.network,
                "timeout": self.limits.timeout}


def local_environment(root: Path, sandbox: bool = True, network: bool = False,
                      timeout: float = 120.0) -> LocalEnvironment:
    """The default environment. Fails closed: raises SandboxUnavailable if bubblewrap cannot
    run, unless the caller explicitly asked for `sandbox=False` (--no-sandbox)."""
    if not root.is_dir():
        raise ToolError(f"workspace {root} is not a directory")
    runner: Runner = BwrapRunner(root, network=network) if sandbox else HostRunner(root)
    return LocalEnvironment(root, runner, Limits(network=network, timeout=timeout))
