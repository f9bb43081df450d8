"""Agent runs in the server database: who runs what, where, how it ended, and every event of
its transcript, so any replica can show and stream any run of the caller's tenant.

The run itself (its thread, its sandbox, its model calls) lives on the replica that started
it (`owner`); everything a watcher needs is here:
- the per-tenant cap on running runs, counted over every live replica under the tenant's
  database lock;
- the events, append-only and numbered per run (the SSE event id, so `Last-Event-ID`
  resumes exactly). They hold what the in-memory transcript held (tool outputs include code
  from the workspace, which lies under `serve.workspace_roots`: code already on the server,
  the stance background runs take), and are deleted with the record once the tenant has more
  than `keep_finished` finished runs;
- a cancel flag any replica may set and the owner polls (`runs.py`);
- no run stays "running" after its replica died: whoever notices the expired lease marks it
  interrupted and appends a final `interrupted` event, which ends every watcher's stream.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.exc import IntegrityError

from codeplane.storage import Database, Replica, runlog
from codeplane.storage.tables import agent_events as EVENTS
from codeplane.storage.tables import agent_runs as RUNS

INTERRUPTED = "the server running this agent run stopped before it ended"
Event = dict[str, Any]


class RunTaken(Exception):
    """The run's event slot is taken: another replica declared this run interrupted (its
    owner's lease had lapsed), so the owner must stop."""


class RunRecords:
    def __init__(self, db: Database, replica: Replica, keep_finished: int = 100) -> None:
        self.db, self.replica, self.keep_finished = db, replica, keep_finished

    def claim(self, tenant: str, run_id: str, limit: int) -> int | None:
        """Record a new running run of `tenant` unless it already has `limit` running on
        live replicas: None when recorded, else how many are running. The tenant's finished
        runs past `keep_finished` are forgotten (record and events), oldest first."""
        live = RUNS.c.owner.in_(self.replica.live_ids())
        with self.db.lock(f"agent-runs:{tenant}"), self.db.write() as conn:
            running = conn.scalar(select(func.count()).select_from(RUNS).where(
                RUNS.c.tenant == tenant, RUNS.c.status == "running", live))
            if running >= limit:
                return running
            now = time.time()
            conn.execute(RUNS.insert().values(id=run_id, tenant=tenant, owner=self.replica.id,
                                              status="running", created=now, updated=now))
            old = list(conn.scalars(select(RUNS.c.id).where(
                RUNS.c.tenant == tenant, RUNS.c.status != "running").order_by(
                RUNS.c.updated.desc()).offset(self.keep_finished)))
            if old:
                conn.execute(delete(EVENTS).where(EVENTS.c.run_id.in_(old)))
                conn.execute(delete(RUNS).where(RUNS.c.id.in_(old)))
        return None

    def finish(self, run_id: str, status: str, error: str | None) -> None:
        """The run's terminal status, unless another replica already declared it
        interrupted (that verdict, and its final event, stand)."""
        with self.db.write() as conn:
            conn.execute(update(RUNS).where(RUNS.c.id == run_id, RUNS.c.status == "running")
                         .values(status=status, error=error, updated=time.time()))

    def get(self, tenant: str, run_id: str) -> dict | None:
        with self.db.read() as conn:
            row = conn.execute(select(RUNS).where(RUNS.c.id == run_id,
                                                  RUNS.c.tenant == tenant)).first()
        return dict(row._mapping) if row else None

    def append(self, run_id: str, seq: int, event: Event) -> None:
        """Store the owner's event number `seq`; RunTaken if that number is taken (the run
        was declared interrupted meanwhile)."""
        try:
            with self.db.write() as conn:
                runlog.write(conn, EVENTS, run_id, seq, event)
        except IntegrityError:
            raise RunTaken(run_id) from None

    def tail(self, tenant: str, run_id: str, after: int = 0) -> tuple[str, list[tuple[int, Event]]] | None:
        """The run's status, then its events numbered above `after` (read in that order, so
        a terminal status comes with the event that ended the run); None if `tenant` has no
        such run."""
        with self.db.read() as conn:
            status = conn.scalar(select(RUNS.c.status).where(RUNS.c.id == run_id,
                                                             RUNS.c.tenant == tenant))
            if status is None:
                return None
            return status, runlog.read(conn, EVENTS, run_id, after)

    def request_cancel(self, tenant: str, run_id: str) -> bool:
        """Flag the tenant's running run for cancellation; False if it is not running."""
        with self.db.write() as conn:
            return conn.execute(update(RUNS).where(
                RUNS.c.id == run_id, RUNS.c.tenant == tenant, RUNS.c.status == "running")
                .values(cancel_requested=time.time())).rowcount == 1

    def cancelled(self, run_ids: list[str]) -> list[str]:
        """Which of these runs someone asked (on any replica) to cancel."""
        with self.db.read() as conn:
            return list(conn.scalars(select(RUNS.c.id).where(
                RUNS.c.id.in_(run_ids), RUNS.c.cancel_requested.is_not(None))))

    def interrupt_orphans(self) -> int:
        """Mark "interrupted", with a final `interrupted` event, every running run whose
        replica's lease expired; returns how many. The status change is conditional, so of
        several replicas noticing at once exactly one writes the event."""
        orphaned = (RUNS.c.status == "running") & RUNS.c.owner.not_in(self.replica.live_ids())
        with self.db.read() as conn:
            ids = list(conn.scalars(select(RUNS.c.id).where(orphaned)))
        done = 0
        for run_id in ids:
            with self.db.write() as conn:
                if conn.execute(update(RUNS).where(RUNS.c.id == run_id, orphaned).values(
                        status="interrupted", error=INTERRUPTED, updated=time.time())).rowcount:
                    # after whatever the run stored last (the owner numbers its own events)
                    runlog.append(conn, EVENTS, run_id, {
                        "type": "interrupted", "run_id": run_id, "status": "interrupted",
                        "error": INTERRUPTED})
                    done += 1
        return done

