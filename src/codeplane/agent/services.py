"""The services the agent's tools reach beyond the workspace, as a program builds them once:
`tool_services(settings, engine, embedders)` for the composition root and the CLI, and
`IndexSearch`, codebase search over the client-side index (`indexing/api.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from codeplane.agent.env import Environment
from codeplane.agent.toolset import ApplyMerge, SearchUnavailable, ToolServices
from codeplane.config import Settings
from codeplane.indexing.api import SNIPPET_FILE_BYTES, IndexUnavailable, search_workspace

if TYPE_CHECKING:
    from codeplane.models.embedders import Embedders
    from codeplane.models.engine import Engine

APPLY_MODEL = "code-small"  # `[agent] apply_model` unset: the model /v1/apply defaults to


class IndexSearch:
    """The index of a workspace, found by its root under the settings' client directory and
    ranked with the settings' search server; each snippet read through the workspace."""

    def __init__(self, settings: Settings, embedders: Embedders | None = None) -> None:
        self.settings, self.embedders = settings, embedders

    def search(self, env: Environment, query: str, limit: int,
               files: bool) -> list[dict[str, Any]]:
        def read(rel: str) -> bytes:
            return env.workspace.read(env.root / Path(rel), SNIPPET_FILE_BYTES)

        try:
            return search_workspace(env.root, query, limit, self.settings, files=files,
                                    embedders=self.embedders, read=read)
        except IndexUnavailable as exc:
            raise SearchUnavailable(str(exc)) from None


def tool_services(settings: Settings, engine: Engine | None = None,
                  embedders: Embedders | None = None) -> ToolServices:
    """Search over the settings' index; code_edit merged with `engine` (with the model
    `[agent] apply_model` names), or deterministically where the program holds none."""
    model = settings.agent.get("apply_model", APPLY_MODEL)
    return ToolServices(IndexSearch(settings, embedders), ApplyMerge(engine, model))
