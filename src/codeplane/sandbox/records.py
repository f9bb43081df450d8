"""The fleet's sandbox records in the server database, so every replica lists a tenant's
sandboxes wherever they live and a dead replica's are shown as gone.

Only the record moves here: a sandbox's tree, mounts and processes stay on the host that made
it (`owner`), and that host's reaper (`reaper.py`, its own crash journal on disk) still cleans
them up. States: `pooled` (warm, no tenant yet), `active` (a tenant holds it), `gone` (its
replica's lease expired: the sandbox died with it). A gone record is kept for `GONE_KEEP_S` so
its tenant can see what happened, then dropped by the sweep.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import delete, select, update

from codeplane.storage import Database, Replica
from codeplane.storage.tables import sandboxes as BOXES

GONE_KEEP_S = 86400.0
FIELDS = ("id", "repo", "ref", "commit_sha", "backend", "created", "holder", "state", "owner",
          "last_used")


class SandboxRecords:
    def __init__(self, db: Database, replica: Replica) -> None:
        self.db, self.replica = db, replica

    def add(self, sandbox_id: str, tenant: str | None, backend: str, repo: str, ref: str,
            commit: str, holder: str) -> None:
        """Record a sandbox this replica just made (pooled while it has no tenant)."""
        now = time.time()
        with self.db.write() as conn:
            conn.execute(BOXES.insert().values(
                id=sandbox_id, tenant=tenant, backend=backend, repo=repo, ref=ref,
                commit_sha=commit, holder=holder, owner=self.replica.id, created=now,
                last_used=now, state="active" if tenant else "pooled"))

    def assign(self, sandbox_id: str, tenant: str, ref: str, holder: str) -> None:
        """A pooled sandbox handed to `tenant`."""
        with self.db.write() as conn:
            conn.execute(update(BOXES).where(BOXES.c.id == sandbox_id).values(
                tenant=tenant, ref=ref, holder=holder, state="active", last_used=time.time()))

    def touch(self, sandbox_id: str) -> None:
        with self.db.write() as conn:
            conn.execute(update(BOXES).where(BOXES.c.id == sandbox_id)
                         .values(last_used=time.time()))

    def remove(self, sandbox_id: str) -> None:
        """The sandbox is gone for good (released, or removed at shutdown)."""
        with self.db.write() as conn:
            conn.execute(delete(BOXES).where(BOXES.c.id == sandbox_id))

    def get(self, tenant: str, sandbox_id: str) -> dict[str, Any] | None:
        """The tenant's sandbox record, on any replica (another tenant's is missing)."""
        with self.db.read() as conn:
            row = conn.execute(select(*(BOXES.c[f] for f in FIELDS)).where(
                BOXES.c.id == sandbox_id, BOXES.c.tenant == tenant)).first()
        return dict(row._mapping) if row else None

    def list(self, tenant: str) -> list[dict[str, Any]]:
        """Every sandbox record of `tenant`, on every replica, oldest first."""
        with self.db.read() as conn:
            rows = conn.execute(select(*(BOXES.c[f] for f in FIELDS)).where(
                BOXES.c.tenant == tenant).order_by(BOXES.c.created)).all()
        return [dict(row._mapping) for row in rows]

    def forget(self, tenant: str, sandbox_id: str) -> bool:
        """Drop the tenant's record of a gone sandbox; False if there is none."""
        with self.db.write() as conn:
            return conn.execute(delete(BOXES).where(
                BOXES.c.id == sandbox_id, BOXES.c.tenant == tenant,
                BOXES.c.state == "gone")).rowcount == 1

    def mark_gone(self) -> int:
        """Sweep: the sandboxes of replicas whose lease expired are gone (their host's reaper
        removes what is left of them); long-gone records are dropped. Returns how many were
        marked (one conditional UPDATE: replicas sweeping together count each once)."""
        now = time.time()
        dead = BOXES.c.owner.not_in(self.replica.live_ids())
        with self.db.write() as conn:
            conn.execute(delete(BOXES).where(BOXES.c.tenant.is_(None), dead))  # warm pools
            marked = conn.execute(update(BOXES).where(
                BOXES.c.state != "gone", dead)
                .values(state="gone", last_used=now)).rowcount
            conn.execute(delete(BOXES).where(BOXES.c.state == "gone",
                                             BOXES.c.last_used < now - GONE_KEEP_S))
        return marked
