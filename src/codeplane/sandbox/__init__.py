"""Running untrusted commands: a bubblewrap sandbox, or (only when asked) the bare host.

Both runners share one process supervisor (`runner.py`): resource limits, a wall-clock timeout
that kills everything the command started, and output capped to a predictable size.
`gitguard.py` keeps git metadata read-only and sweeps away repositories a command created;
`core/files.py` is the one resolver for host-side reads and writes of workspace files.
`workspace.py` is the interface every agent tool uses (files, commands, snapshots), with its
backends chosen by name.
"""

from codeplane.sandbox.runner import (
    BwrapRunner,
    CommandResult,
    HostRunner,
    Limits,
    Runner,
    SandboxUnavailable,
)
from codeplane.sandbox.workspace import (
    BACKENDS,
    DEFAULT_BACKEND,
    Entry,
    FileStat,
    Snapshot,
    UnknownBackend,
    Workspace,
    open_workspace,
)

__all__ = ["BACKENDS", "DEFAULT_BACKEND", "BwrapRunner", "CommandResult", "Entry", "FileStat",
           "HostRunner", "Limits", "Runner", "SandboxUnavailable", "Snapshot",
           "UnknownBackend", "Workspace", "open_workspace"]
