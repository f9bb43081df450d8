"""Agent runs' records in the server database: who runs what, where, and how it ended.

A run's transcript holds source code, so it stays in the memory of the replica running it
(`runs.py`); only this record is shared: its tenant, owning replica, status and error. That
is enough for the two things replicas must agree on: the per-tenant cap on running runs
(counted over every live replica, under the tenant's database lock) and that no run stays
"running" after its replica died (whoever notices the expired lease marks it interrupted).
"""

from __future__ import annotations

import time

from sqlalchemy import func, select, update

from codeplane.storage import Database, Replica
from codeplane.storage.tables import agent_runs as RUNS

INTERRUPTED = "the server running this agent run stopped before it ended"


class RunRecords:
    def __init__(self, db: Database, replica: Replica) -> None:
        self.db, self.replica = db, replica

    def claim(self, tenant: str, run_id: str, limit: int) -> int | None:
        """Record a new running run of `tenant` unless it already has `limit` running on
        live replicas: None when recorded, else how many are running."""
        live = RUNS.c.owner.in_(self.replica.live_ids())
        with self.db.lock(f"agent-runs:{tenant}"), self.db.write() as conn:
            running = conn.scalar(select(func.count()).select_from(RUNS).where(
                RUNS.c.tenant == tenant, RUNS.c.status == "running", live))
            if running >= limit:
                return running
            now = time.time()
            conn.execute(RUNS.insert().values(id=run_id, tenant=tenant, owner=self.replica.id,
                                              status="running", created=now, updated=now))
        return None

    def finish(self, run_id: str, status: str, error: str | None) -> None:
        with self.db.write() as conn:
            conn.execute(update(RUNS).where(RUNS.c.id == run_id).values(
                status=status, error=error, updated=time.time()))

    def get(self, tenant: str, run_id: str) -> dict | None:
        with self.db.read() as conn:
            row = conn.execute(select(RUNS).where(RUNS.c.id == run_id,
                                                  RUNS.c.tenant == tenant)).first()
        return dict(row._mapping) if row else None

    def interrupt_orphans(self) -> int:
        """Mark "interrupted" every running run whose replica's lease expired; returns how
        many (one conditional UPDATE: replicas noticing together do it once)."""
        with self.db.write() as conn:
            return conn.execute(update(RUNS).where(
                RUNS.c.status == "running",
                RUNS.c.owner.not_in(self.replica.live_ids())).values(
                status="interrupted", error=INTERRUPTED, updated=time.time())).rowcount
