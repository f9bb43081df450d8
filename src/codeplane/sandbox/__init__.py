"""Running untrusted commands: a bubblewrap sandbox, or (only when asked) the bare host.

Both runners share one process supervisor (`runner.py`): resource limits, a wall-clock timeout
that kills everything the command started, and output capped to a predictable size.
`gitguard.py` keeps git metadata read-only and sweeps away repositories a command created;
`core/files.py` is the one resolver for host-side reads and writes of workspace files.
`workspace.py` is the interface every agent tool uses (files, commands, snapshots); its
backends are chosen by name from the table in `backends.py`.
"""

from importlib import import_module
from typing import Any

from codeplane.sandbox.runner import (
    BwrapRunner,
    CommandResult,
    HostRunner,
    Limits,
    Runner,
    SandboxUnavailable,
)
from codeplane.sandbox.workspace import (
    BackendServices,
    Entry,
    FileStat,
    Snapshot,
    UnknownBackend,
    Workspace,
)

# The backend table is loaded on first use (PEP 562): it brings pydantic and the fleet's and
# microVM's modules, while the runner needs the standard library alone (a bare python3 runs
# it, tests/test_sandbox.py) and most importers never choose a backend.
_BACKENDS = ("BACKENDS", "DEFAULT_BACKEND", "Backends", "open_workspace")

__all__ = ["BACKENDS", "DEFAULT_BACKEND", "BackendServices", "Backends", "BwrapRunner",
           "CommandResult", "Entry", "FileStat", "HostRunner", "Limits", "Runner",
           "SandboxUnavailable", "Snapshot", "UnknownBackend", "Workspace", "open_workspace"]


def __getattr__(name: str) -> Any:
    if name not in _BACKENDS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.backends"), name)
