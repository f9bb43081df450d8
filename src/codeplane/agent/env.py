"""The Environment every tool runs against: a `Workspace` (any backend) plus command limits.

One interface for the product and for RL training: `codeplane agent`, `codeplane tool`, the
server's agent runs and future training environment servers all build an `Environment` on a
workspace and call the same `Toolset` on it. Paths given by the model are resolved here and
refused if they (or any symlink along them) lead outside the workspace.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

from codeplane.core.files import Refused, is_git_name
from codeplane.sandbox import (
    DEFAULT_BACKEND,
    Backends,
    CommandResult,
    Limits,
    UnknownBackend,
    Workspace,
)

TOOL_OUTPUT_BYTES = 64 << 20  # what a trusted tool (rg, ruff) may print before it is killed


class ToolError(Exception):
    """A tool cannot do what was asked; the message goes back to the model verbatim."""


class Environment:
    """A workspace as the tools see it: model-given paths resolved and confined, commands
    run under this run's limits."""

    def __init__(self, workspace: Workspace, limits: Limits | None = None) -> None:
        self.workspace = workspace
        self.root = workspace.root
        self.limits = limits or Limits()

    def resolve(self, path: str, write: bool = False) -> Path:
        """Absolute real path inside the workspace; ToolError for anything that escapes.

        Writes into git metadata (`.git` at any depth, as `files.is_git_name` reads it) are
        refused too: a planted hook or config would run later on the host, outside any
        sandbox (the sandbox mounts every `.git` read-only for the same reason)."""
        if not isinstance(path, str) or not path.strip():
            raise ToolError("path must be a non-empty string")
        raw = Path(path.strip())
        inner = str(self.root).lstrip("/") + "/"
        if str(raw).startswith(inner):  # small models drop the leading "/" of the root
            raw = Path(str(raw)[len(inner):])
        try:
            real = self.workspace.real(raw)
        except Refused as exc:
            raise ToolError(f"{exc}; only files under {self.root} are accessible") from None
        if write and any(is_git_name(part) for part in real.relative_to(self.root).parts):
            raise ToolError(f"path {path!r} is inside .git, which the agent may not modify")
        return real

    def relative(self, path: Path) -> str:
        return "." if path == self.root else str(path.relative_to(self.root))

    def run(self, command: str, timeout: float | None = None,
            cancel: threading.Event | None = None) -> CommandResult:
        limits = self.limits
        if timeout is not None:
            limits = dataclasses.replace(limits, timeout=min(timeout, limits.timeout))
        return self.workspace.exec(command, limits, cancel)

    def exec(self, argv: list[str], timeout: float = 60, stderr: bool = False
             ) -> CommandResult:
        """A trusted program (absolute path) over the workspace, read-only, inside the
        sandbox: how the harness runs ripgrep and ruff, so nothing in the workspace is ever
        read or executed by a process on the host. Output is stdout (plus stderr if asked),
        uncut up to TOOL_OUTPUT_BYTES."""
        limits = dataclasses.replace(self.limits, timeout=min(timeout, self.limits.timeout),
                                     output_bytes=TOOL_OUTPUT_BYTES,
                                     drain_bytes=TOOL_OUTPUT_BYTES)
        return self.workspace.exec(argv, limits, stderr=stderr)

    def close(self) -> None:
        """Give the workspace back (a pooled backend reuses it)."""
        self.workspace.close()

    def metadata(self) -> dict[str, Any]:
        return {**self.workspace.describe(), "network": self.limits.network,
                "timeout": self.limits.timeout}


def local_environment(root: Path, sandbox: bool = True, network: bool = False,
                      timeout: float = 120.0, backend: str | None = None,
                      backends: Backends | None = None) -> Environment:
    """The environment for a directory on this machine, on `backend` (default bwrap;
    `sandbox=False` means host, as --no-sandbox asks) of `backends` (a server's, for its
    caller; default: the table without services). Fails closed: raises SandboxUnavailable
    if bubblewrap cannot run."""
    if not root.is_dir():
        raise ToolError(f"workspace {root} is not a directory")
    name = backend or (DEFAULT_BACKEND if sandbox else "host")
    try:
        workspace = (backends or Backends()).open(root, name, network)
    except UnknownBackend as exc:
        raise ToolError(str(exc)) from None
    return Environment(workspace, Limits(network=network, timeout=timeout))
