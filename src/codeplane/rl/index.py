"""A training run's codebase search: the product's index of every task's repository snapshot,
and each episode's `codebase_search` over it.

The run indexes each snapshot (the directory `EnvServer.reset` copies for an episode: one per
sdist, local repository or failing-test task) once, with the product's own incremental
indexer (`indexing.sync`, what `codeplane index` runs), under settings of its own: client state
under `[search] home`, the search server the product's. By default a `codeplane serve` child
process on a loopback port for the run's lifetime (`server = "local"`, its data under the
same home: `core/serve.py`, as the quickstart starts one; the composition root is a layer
above rl); `server = URL` uses a running `codeplane serve` instead. The home outlives the
run, so a second run or a resume re-syncs every snapshot in one round trip each and embeds
nothing that did not change; one key file for the home lets the server's embedding cache
(scoped by key) serve chunks that several snapshots share.

An episode's `codebase_search` is the product's `IndexSearch` pointed at its task's snapshot
(`IndexSearch(root=...)`): the same ranking, the same output, with every snippet read through
the episode's workspace (a `RemoteWorkspace` when the sandbox is in a Ray actor), so where
the copy lives never matters and the output is what `codeplane agent` shows on the snapshot.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import ExitStack
from pathlib import Path
from typing import Self
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, field_validator

from codeplane.agent.services import IndexSearch
from codeplane.agent.toolset import ToolServices
from codeplane.config import IndexingSettings, Settings, load_settings
from codeplane.core.serve import child_server
from codeplane.indexing.sync import SyncReport, sync
from codeplane.rl.commits import CommitTask
from codeplane.rl.tasks import Task
from codeplane.rl.testfix import FixTask

LOCAL, NONE = "local", "none"
UPLOAD_BATCH = 32  # chunks per upload request (the product's default is 256)


class SearchConfig(BaseModel):
    """`[search]`: where the run's index lives and which search server ranks it."""

    model_config = {"extra": "forbid", "frozen": True}
    server: str = Field(LOCAL, description=(
        '"local": a `codeplane serve` child process on a loopback port for the run; '
        'a URL ("http://127.0.0.1:8000"): a running codeplane server; "none": no index '
        '(codebase_search answers "index unavailable", as on a workspace never indexed)'))
    home: str = Field("~/.codeplane/rl/index", description=(
        "the index's home: client state per snapshot, the key file and a local server's data; "
        "kept across runs and resumes, which re-embed nothing unchanged"))

    @field_validator("server")
    @classmethod
    def _server(cls, value: str) -> str:
        if value in (LOCAL, NONE):
            return value
        url = urlsplit(value)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f'"local", "none" or an http(s) URL of a codeplane server, not '
                             f'{value!r}')
        return value.rstrip("/")

    @property
    def home_dir(self) -> Path:
        return Path(self.home).expanduser()


class RunIndex:
    """The run's index: `open()` (starts a local server if configured), `index(snapshots)`,
    `services(task)` for each episode, `close()`."""

    def __init__(self, config: SearchConfig) -> None:
        self.config = config
        self.settings: Settings | None = None
        self._server = ExitStack()

    def open(self) -> Self:
        cfg = self.config
        if cfg.server == NONE:
            return self
        home = cfg.home_dir
        home.mkdir(parents=True, exist_ok=True)
        models = home / "models"
        if not models.exists():  # the user's pulled weights: the embedder a local server runs
            models.symlink_to(load_settings().models_dir, target_is_directory=True)
        settings = load_settings(home=home)
        url = cfg.server
        if url == LOCAL:
            url = self._server.enter_context(child_server(home))
        # One key for every snapshot: the embedding cache is scoped by key, so chunks that
        # several snapshots share (versions, failing-test copies) are embedded once. Small
        # upload batches: on a loaded machine one of 256 chunks outlasted the client's HTTP
        # timeout (as bench/agent's search_setup found); the home's codeplane.toml may say
        # otherwise.
        indexing = IndexingSettings.model_validate({
            "key_file": home / "key", "batch_chunks": UPLOAD_BATCH,
            **settings.indexing.model_dump(exclude_unset=True)})
        self.settings = settings.model_copy(update={"server": url, "indexing": indexing})
        return self

    def index(self, snapshots: Iterable[str]) -> list[SyncReport]:
        """Sync each distinct snapshot once, as `codeplane index` does; an unchanged one costs
        a round trip and embeds nothing."""
        if self.settings is None:
            return []
        return [sync(Path(root), self.settings) for root in sorted(set(snapshots))]

    def services(self, task: Task | FixTask | CommitTask) -> ToolServices:
        """An episode's tool services: search over its task snapshot's index."""
        if self.settings is None:
            return ToolServices()
        return ToolServices(search=IndexSearch(self.settings, root=Path(task.snapshot)))

    def close(self) -> None:
        self._server.close()
