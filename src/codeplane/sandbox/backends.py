"""Workspace backends by name: the table, and the table built for one caller.

A row is a backend class and the settings model it is built with; `Backends` builds a row's
class as `cls(settings, services)` when a workspace is opened on it, with the services its
composition root injected (`BackendServices`: the server's fleet, the caller's tenant). A
program without those services (`codeplane agent`, the tools, RL) opens workspaces through
`open_workspace`, and a backend that needs one refuses there (the pool: PoolUnavailable).
Adding a backend is one module (its class and settings model) and one row here.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from codeplane.sandbox.microvm import MicroVMBackend, MicroVMSettings
from codeplane.sandbox.pool import PoolBackend
from codeplane.sandbox.runner import BwrapRunner, HostRunner, Runner
from codeplane.sandbox.workspace import (
    Backend,
    BackendServices,
    LocalWorkspace,
    UnknownBackend,
    Workspace,
)

if TYPE_CHECKING:
    from codeplane.sandbox.fleet import Sandbox


class NoSettings(BaseModel):
    """The settings model of a backend that has no settings."""

    model_config = {"extra": "forbid"}


class LocalBackend(ABC):
    """A directory on this machine, its commands through a runner: no settings, no services."""

    def __init__(self, settings: NoSettings, services: BackendServices) -> None:
        self.settings, self.services = settings, services

    def open(self, root: Path, network: bool) -> Workspace:
        return LocalWorkspace(root, self.runner(root, network))

    @abstractmethod
    def runner(self, root: Path, network: bool) -> Runner:
        """The runner of this backend's commands."""


class BwrapBackend(LocalBackend):
    """Commands in a bubblewrap sandbox (fails closed: SandboxUnavailable where it cannot)."""

    def runner(self, root: Path, network: bool) -> Runner:
        return BwrapRunner(root, network=network)


class HostBackend(LocalBackend):
    """Commands on the host, unsandboxed: callers offer it only when asked explicitly
    (--no-sandbox, a server with allow_unsandboxed)."""

    def runner(self, root: Path, network: bool) -> Runner:
        return HostRunner(root)


@dataclass(frozen=True)
class Row:
    cls: Callable[[Any, BackendServices], Backend]  # built as cls(settings, services)
    settings: type[BaseModel]  # what `cls` is built with (defaults unless the caller sets it)


DEFAULT_BACKEND = "bwrap"
# name -> row. `host` is unsandboxed (offered only when asked); `pool` needs a server's fleet.
BACKENDS: dict[str, Row] = {
    "bwrap": Row(BwrapBackend, NoSettings),
    "host": Row(HostBackend, NoSettings),
    "pool": Row(PoolBackend, NoSettings),
    "microvm": Row(MicroVMBackend, MicroVMSettings),
}


class Backends:
    """The table as one program uses it: its services injected, its backends' settings
    (validated by each row's model: a dict or the model itself; unnamed backends get their
    defaults)."""

    def __init__(self, services: BackendServices | None = None,
                 settings: Mapping[str, BaseModel | dict[str, Any]] | None = None) -> None:
        self.services = services or BackendServices()
        self.settings = {name: _row(name).settings.model_validate(value)
                         for name, value in (settings or {}).items()}

    def for_caller(self, tenant: str, sandbox: Sandbox | None = None) -> Backends:
        """The same table for one caller: its tenant, and a sandbox it holds, if any."""
        return Backends(dataclasses.replace(self.services, tenant=tenant, sandbox=sandbox),
                        self.settings)

    def open(self, root: Path, backend: str = DEFAULT_BACKEND,
             network: bool = False) -> Workspace:
        """The workspace for `root` on the named backend. Fails closed: the bwrap backend
        raises SandboxUnavailable if it cannot create a sandbox here."""
        row = _row(backend)
        settings = self.settings[backend] if backend in self.settings else row.settings()
        return row.cls(settings, self.services).open(root, network)


def _row(name: str) -> Row:
    row = BACKENDS.get(name)
    if row is None:
        raise UnknownBackend(f"unknown workspace backend {name!r}; available: "
                             f"{', '.join(BACKENDS)}")
    return row


def open_workspace(root: Path, backend: str = DEFAULT_BACKEND,
                   network: bool = False) -> Workspace:
    """The workspace for `root` on a backend that needs no services."""
    return Backends().open(root, backend, network)
