"""The background agents' durable record: runs, their events and their results, in the server
database (`storage/`), so a restart loses nothing that was said and every replica can show
any run.

Every write is one transaction. Events carry a per-run sequence number: it is the SSE event
id, which is what makes `Last-Event-ID` resumption exact. A run's checkout lives on the disk
of the replica working on it (`owner`); if that replica dies (its lease in the database
expires), whichever replica notices marks the run "interrupted" with a final event, so no run
is ever left "running" by a process that no longer exists.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from contextlib import closing
from pathlib import Path
from typing import Any

from sqlalchemy import delete, select, update

from codeplane.storage import Database, Replica, runlog
from codeplane.storage.tables import background_events as EVENTS
from codeplane.storage.tables import background_runs as RUNS

log = logging.getLogger("codeplane.background")
LIVE = ("queued", "running")  # statuses a run can only have while a live replica works on it
FIELDS = ("id", "tenant", "repo", "ref", "task", "model", "status", "created", "updated",
          "branch", "commit_sha", "error")
INTERRUPTED = "the server working on this run stopped before it ended"


class BackgroundRecords:
    """The runs of one server database; `replica` names the process that owns the runs it
    creates (None: a store used outside a server, whose runs nobody else may own)."""

    def __init__(self, db: Database, replica: Replica | None = None) -> None:
        self.db, self.replica = db, replica
        self._owns_db = False

    @classmethod
    def open(cls, path: Path) -> BackgroundRecords:
        """A store of its own in the SQLite file `path` (tools and tests)."""
        store = cls(Database(f"sqlite:///{path}"))
        store.db.upgrade()
        store._owns_db = True
        return store

    def create(self, run: dict[str, Any]) -> None:
        now = time.time()
        with self.db.write() as conn:
            conn.execute(RUNS.insert().values(
                id=run["id"], tenant=run["tenant"], repo=run["repo"], ref=run["ref"],
                task=run["task"], model=run["model"], status="running", created=now,
                updated=now, owner=self.replica.id if self.replica else None))

    def update(self, run_id: str, **values: Any) -> None:
        """Set columns of a run (status, branch, commit_sha, patch, error)."""
        with self.db.write() as conn:
            conn.execute(update(RUNS).where(RUNS.c.id == run_id)
                         .values(**values, updated=time.time()))

    def get(self, tenant: str, run_id: str) -> dict[str, Any] | None:
        """The run if it belongs to `tenant` (another tenant's run does not exist)."""
        with self.db.read() as conn:
            row = conn.execute(select(*(RUNS.c[f] for f in FIELDS)).where(
                RUNS.c.id == run_id, RUNS.c.tenant == tenant)).first()
        return dict(row._mapping) if row else None

    def list(self, tenant: str, limit: int = 100) -> list[dict[str, Any]]:
        with self.db.read() as conn:
            rows = conn.execute(select(*(RUNS.c[f] for f in FIELDS)).where(
                RUNS.c.tenant == tenant).order_by(RUNS.c.created.desc()).limit(limit)).all()
        return [dict(row._mapping) for row in rows]

    def patch(self, run_id: str) -> str | None:
        with self.db.read() as conn:
            return conn.scalar(select(RUNS.c.patch).where(RUNS.c.id == run_id))

    def append(self, run_id: str, event: dict[str, Any]) -> int:
        """Store an event as the run's next one; its sequence number (from 1)."""
        with self.db.write() as conn:
            return runlog.append(conn, EVENTS, run_id, event)

    def events(self, run_id: str, after: int = 0) -> list[tuple[int, dict[str, Any]]]:
        """The run's events with a sequence number above `after`, in order."""
        with self.db.read() as conn:
            return runlog.read(conn, EVENTS, run_id, after)

    def delete(self, run_id: str) -> None:
        """Forget a run: its row and its events, in one transaction."""
        with self.db.write() as conn:
            conn.execute(delete(EVENTS).where(EVENTS.c.run_id == run_id))
            conn.execute(delete(RUNS).where(RUNS.c.id == run_id))

    def last(self, run_id: str) -> tuple[int, str]:
        """The run's newest event: (sequence number, type); (0, "") if it has none."""
        with self.db.read() as conn:
            row = conn.execute(select(EVENTS.c.seq, EVENTS.c.body).where(
                EVENTS.c.run_id == run_id).order_by(EVENTS.c.seq.desc()).limit(1)).first()
        return (row[0], json.loads(row[1])["type"]) if row else (0, "")

    def interrupt_unfinished(self) -> list[str]:
        """Runs still "running" whose owner is gone (killed, stopped, or a store without
        replicas: every one) are marked "interrupted" with a final event. The status change is
        conditional, so of several replicas noticing at once exactly one writes the event."""
        orphaned = RUNS.c.status.in_(LIVE)
        if self.replica is not None:
            orphaned &= RUNS.c.owner.is_(None) | RUNS.c.owner.not_in(self.replica.live_ids())
        with self.db.read() as conn:
            ids = list(conn.scalars(select(RUNS.c.id).where(orphaned)))
        done = []
        for run_id in ids:  # the status first: a watcher ends on the event after it
            with self.db.write() as conn:
                if conn.execute(update(RUNS).where(RUNS.c.id == run_id, orphaned).values(
                        status="interrupted", error=INTERRUPTED, updated=time.time())).rowcount:
                    runlog.append(conn, EVENTS, run_id, {"type": "interrupted",
                                                         "run_id": run_id, "error": INTERRUPTED})
                    done.append(run_id)
        return done

    def import_sqlite(self, path: Path) -> int:
        """Copy a `runs.db` from before the server database into it once (then renamed
        `*.imported`). Its runs have no owner, so `interrupt_unfinished` ends live ones."""
        if not path.is_file():
            return 0
        with closing(sqlite3.connect(path)) as old:
            runs = old.execute(f"SELECT {', '.join(FIELDS)}, patch FROM runs").fetchall()
            events = old.execute("SELECT run_id, seq, body FROM events").fetchall()
        with self.db.write() as conn:
            if runs:
                conn.execute(self.db.insert(RUNS).on_conflict_do_nothing(),
                             [dict(zip((*FIELDS, "patch"), row, strict=True)) for row in runs])
            if events:
                conn.execute(self.db.insert(EVENTS).on_conflict_do_nothing(),
                             [{"run_id": r, "seq": s, "body": b} for r, s, b in events])
        path.replace(path.with_name(path.name + ".imported"))
        log.info("imported %d background runs from %s into the database", len(runs), path)
        return len(runs)

    def close(self) -> None:
        if self._owns_db:
            self.db.close()

