"""The services the agent's tools reach beyond the workspace, as a program builds them once:
`tool_services(settings, engine, embedders)` for the composition root and the CLI,
`IndexSearch`, codebase search over the client-side index (`indexing/query.py`), and
`for_caller`, a server's services for one run, whose model work is charged to its caller."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from codeplane.agent.env import Environment, ToolError
from codeplane.agent.toolset import (
    ApplyMerge,
    Charge,
    Metering,
    SearchUnavailable,
    ToolServices,
)
from codeplane.config import Settings
from codeplane.core.chat import ChatModel
from codeplane.gateway.admission import Shed
from codeplane.gateway.chat import GatewayChatModel
from codeplane.indexing.query import SNIPPET_FILE_BYTES, IndexUnavailable, search_workspace

if TYPE_CHECKING:
    from codeplane.models.embedders import Embedders
    from codeplane.models.engine import Engine

class IndexSearch:
    """The index of a workspace, found by its root under the settings' client directory and
    ranked with the settings' search server; each snippet read through the workspace.
    `root`: the index of that directory instead of the workspace's own, for a workspace that
    is a fresh copy of an indexed directory (an RL episode's copy of its task's snapshot:
    the copy's path is new every episode, its files are the snapshot's)."""

    def __init__(self, settings: Settings, embedders: Embedders | None = None,
                 root: Path | None = None) -> None:
        self.settings, self.embedders, self.root = settings, embedders, root

    def search(self, env: Environment, query: str, limit: int,
               files: bool) -> list[dict[str, Any]]:
        def read(rel: str) -> bytes:
            return env.workspace.read(env.root / Path(rel), SNIPPET_FILE_BYTES)

        try:
            return search_workspace(self.root or env.root, query, limit, self.settings,
                                    files=files, embedders=self.embedders, read=read)
        except IndexUnavailable as exc:
            raise SearchUnavailable(str(exc)) from None


def tool_services(settings: Settings, engine: Engine | None = None,
                  embedders: Embedders | None = None) -> ToolServices:
    """Search over the settings' index; code_edit merged with `engine` (with the model
    `[agent] apply_model` names), or deterministically where the program holds none."""
    return ToolServices(IndexSearch(settings, embedders),
                        ApplyMerge(engine, settings.agent.apply_model))


def for_caller(tools: ToolServices, model: ChatModel) -> ToolServices:
    """A server's services for one run: the model work of its tools (a code_edit merged by
    the apply model) charged to the key the run's chat model calls the gateway with, under
    that key's limits and budget as `/v1/apply` charges it. A model that is not the gateway's
    leaves them as they are."""
    if not isinstance(model, GatewayChatModel):
        return tools
    return tools.charged(_gateway_meter(model))


@dataclass
class _Charge:
    used: int = 0


def _gateway_meter(model: GatewayChatModel) -> Metering:
    gateway, client = model.gateway, model.client

    @contextmanager
    def meter(tokens: int) -> Iterator[Charge]:
        try:
            gateway.admit(client)
            held = gateway.hold(client, tokens)
        except Shed as exc:  # a result the model reads, not a failed run
            raise ToolError(f"the apply model was not run: {exc.message}; use "
                            "old_string/new_string") from None
        charge = _Charge()
        try:
            yield charge
        finally:
            gateway.settle(client, held, charge.used)

    return meter
