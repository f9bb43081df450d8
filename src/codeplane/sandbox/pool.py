"""The `pool` workspace backend: workspaces in sandboxes of the server's fleet (`fleet.py`).

The fleet and the caller's tenant are injected (`BackendServices`) by the composition root:
`server/services.py` builds the server's backends with its fleet, and a route binds the
caller (`Backends.for_caller`). Outside a server there is no fleet, and the backend refuses.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from codeplane.sandbox.runner import BwrapRunner
from codeplane.sandbox.workspace import BackendServices, LocalWorkspace, UnknownBackend, Workspace

if TYPE_CHECKING:
    from codeplane.sandbox.backends import NoSettings
    from codeplane.sandbox.fleet import Fleet, Sandbox


class PoolUnavailable(UnknownBackend):
    """The `pool` backend was opened without a server's fleet and a caller's tenant."""


class PooledWorkspace(LocalWorkspace):
    """A fleet sandbox behind the `Workspace` interface: reads, writes and commands go through
    the sandbox's tree and bubblewrap runner; closing gives the sandbox back, unless the
    caller keeps it (`release=False`: a background run holds one sandbox across several agent
    turns, each of which closes its workspace, and releases it itself when the run ends)."""

    def __init__(self, fleet: Fleet, box: Sandbox, release: bool = True,
                 network: bool = False) -> None:
        runner = BwrapRunner(box.workspace, network=True, cgroup=box.cgroup) if network \
            else box.runner()
        super().__init__(box.workspace, runner)
        self.fleet, self.box, self.release = fleet, box, release

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "backend": "pool", "sandbox": self.box.id}

    def close(self) -> None:
        if self.release:
            self.fleet.release(self.box.id)


class PoolBackend:
    """A sandbox of the git repository `root` at its HEAD, for the caller's tenant (warm from
    the fleet's pool when one is ready). The workspace's root is the sandbox's tree, not
    `root`: changes stay in the sandbox, which closing the workspace releases. With a sandbox
    the caller holds (`services.sandbox`), `root` is that sandbox's tree and the workspace is
    the sandbox's own; closing it releases nothing."""

    def __init__(self, settings: NoSettings, services: BackendServices) -> None:
        self.services = services

    def open(self, root: Path, network: bool) -> Workspace:
        fleet, tenant, held = self.services.fleet, self.services.tenant, self.services.sandbox
        if fleet is None or tenant is None:
            raise PoolUnavailable("the pool backend needs a server's sandbox fleet: use it "
                                  "through `codeplane serve` (agent runs with backend \"pool\")")
        if held is None:
            return fleet.open(tenant, root, network=network)
        if Path(os.path.realpath(root)) != Path(os.path.realpath(held.workspace)):
            raise ValueError(f"{root} is not the tree of the held sandbox {held.id}")
        return PooledWorkspace(fleet, held, release=False, network=network)
