"""The composition root's product: every long-lived service of one server, built once.

Routes reach a service through `request.app.state.services` (one typed attribute each), so
there is one place that builds them, one that closes them, and no route creates state on
first use.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from codeplane.agent.records import RunRecords
from codeplane.agent.runs import RunManager
from codeplane.agent.services import tool_services
from codeplane.agent.toolset import ToolServices
from codeplane.background.records import BackgroundRecords
from codeplane.background.service import BackgroundService
from codeplane.config import ConfigError, Settings
from codeplane.core.metrics import Metrics
from codeplane.events.log import EventLog
from codeplane.gateway.keys import KeyStore
from codeplane.gateway.providers.base import ProviderServices
from codeplane.gateway.router import Gateway
from codeplane.models.embed import EmbedderUnavailable
from codeplane.models.embedders import Embedders
from codeplane.models.engine import Engine, EngineCrashed
from codeplane.models.metrics import EngineCollector
from codeplane.models.pull import WeightsError
from codeplane.models.registry import UnknownModel
from codeplane.sandbox import Backends, BackendServices
from codeplane.sandbox.fleet import Fleet
from codeplane.sandbox.records import SandboxRecords
from codeplane.storage import Database, ObjectStore, Replica, StorageError
from codeplane.tab import preload
from codeplane.tab.service import TabService

if TYPE_CHECKING:
    from codeplane.search.service import SearchService

log = logging.getLogger("codeplane.server")


@dataclass
class Services:
    settings: Settings
    engine: Engine
    metrics: Metrics
    keys: KeyStore  # the one key store: the auth gate and the gateway's limits share it
    gateway: Gateway
    tab: TabService
    runs: RunManager  # agent runs: tenant-scoped, capped, each ends with `run_end`
    events: EventLog  # the event lake: usage, apply outcomes, agent steps (no source code)
    background: BackgroundService  # background agents: durable runs in pooled sandboxes
    fleet: Fleet  # sandboxes: copy-on-write workspaces, warm pools, reaped after a crash
    backends: Backends  # the workspace backend table, the fleet injected (a route adds the caller)
    db: Database  # every durable row (keys, usage, search metadata, runs), shared by replicas
    replica: Replica  # this process's lease in `db`; sweeps take over what dead ones left
    store: ObjectStore  # the event lake and LanceDB tables
    embedders: Embedders  # each embedding model loaded once: search and the gateway share it
    tools: ToolServices  # what agent runs' tools reach: the index, the apply model (engine)
    owns_engine: bool = True  # a shared engine (tests, embedding callers) outlives the app
    _search: SearchService | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def search(self) -> SearchService:
        """Private search, built on first use: opening LanceDB is slow, and most servers
        (and tests) never index. Built once, under a lock (sync routes run on a
        thread pool), and closed with the rest."""
        with self._lock:
            if self._search is None:
                from codeplane.search.service import SearchService

                self._search = SearchService(self.settings, self.embedders, sql=self.db,
                                             store=self.store)
            return self._search

    def start(self) -> asyncio.Task:
        """Background work of a starting server, on its event loop: the Tab model loads when
        codeplane.toml (or the environment) sets a key of `[tab]` (and `preload` is not off)."""
        return asyncio.create_task(self._preload_tab())

    async def _preload_tab(self) -> None:
        if not preload.preloaded(self.settings):
            return
        try:
            await self.tab.warm()
        except (EngineCrashed, WeightsError, UnknownModel, OSError) as exc:  # the server
            # still serves; the first Tab request meets the same error and reports it
            log.warning("Tab model %s not preloaded: %s", self.tab.settings.model, exc)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.background.close)  # before runs: each records its end
        await asyncio.to_thread(self.runs.close)  # cancels runs still going: each ends
        await asyncio.to_thread(self.replica.close)  # after the runs recorded their end
        await asyncio.to_thread(self.fleet.close)
        await self.gateway.aclose()
        await asyncio.to_thread(self.tab.close)  # its upstream HTTP client and pool
        try:
            await asyncio.to_thread(self.events.close)
        except StorageError as exc:  # the store is down: lose telemetry, not the shutdown
            log.error("events not flushed at shutdown: %s", exc)
        with self._lock:
            if self._search is not None:
                self._search.close()
                self._search = None
        self.db.close()
        if self.owns_engine:
            self.engine.close()


def build_services(settings: Settings, engine: Engine | None = None) -> Services:
    """Everything a server needs; a bad `[indexing] embedder` table, `[storage]` or
    `router.fallbacks` raises ConfigError here, before the server takes traffic (the other
    sections were checked when settings loaded)."""
    owns_engine = engine is None
    engine = engine or Engine(settings)
    try:
        embedders = Embedders(settings.indexing.embedder, engine)
    except EmbedderUnavailable as exc:
        raise ConfigError(str(exc)) from None
    tab = TabService(engine, settings.tab)
    try:
        store = ObjectStore.from_settings(settings)
        store.sweep_staging()  # what a writer killed mid-put left behind
    except StorageError as exc:
        raise ConfigError(f"invalid [storage] settings: {exc}") from None
    db = Database.from_settings(settings)  # migrations run here, before any traffic
    replica = Replica(db, settings.storage.lease_seconds)
    keys = KeyStore.from_settings(settings, replica)
    metrics = Metrics()
    metrics.registry.register(EngineCollector(engine))
    events = EventLog(store, compact_every_s=settings.storage.compact_events_hours * 3600,
                      lock=db.lock)
    records = RunRecords(db, replica)
    sandboxes = SandboxRecords(db, replica)
    fleet = Fleet(settings.server_dir, settings.fleet, settings.serve.repo_urls, sandboxes)
    backends = Backends(BackendServices(fleet=fleet))
    runs = RunManager(settings.serve.max_runs_per_tenant, records=records)
    background_store = BackgroundRecords(db, replica)
    background_store.import_sqlite(settings.server_dir / "background" / "runs.db")
    gateway = Gateway(settings, ProviderServices(engine, metrics, embedders), metrics,
                      keys=keys, events=events)
    replica.sweeps += [keys.release_dead, background_store.interrupt_unfinished,
                       records.interrupt_orphans, sandboxes.mark_gone, gateway.limits.prune]
    replica.beat()  # the first sweep: what replicas that died before this start left
    replica.start()
    tools = tool_services(settings, engine, embedders)
    return Services(settings=settings, engine=engine, metrics=metrics, keys=keys,
                    gateway=gateway,
                    tab=tab, runs=runs, events=events,
                    background=BackgroundService(settings.server_dir, runs, fleet, backends,
                                                 settings, tools, store=background_store),
                    fleet=fleet, backends=backends, db=db, replica=replica,
                    store=store, embedders=embedders, tools=tools, owns_engine=owns_engine)
