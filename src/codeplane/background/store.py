"""The background agents' durable record: runs, their events and their results, in one small
SQLite file under `server_dir`, so a restart loses nothing that was said.

Every write is one transaction (`with self._db:` commits or rolls back). Events carry a per-run
sequence number: it is the SSE event id, which is what makes `Last-Event-ID` resumption exact.
Hand-written over the standard library's sqlite3 rather than an ORM: three tables, a handful
of statements, and no new dependency.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, repo TEXT NOT NULL, ref TEXT NOT NULL,
    task TEXT NOT NULL, model TEXT NOT NULL, status TEXT NOT NULL, created REAL NOT NULL,
    updated REAL NOT NULL, branch TEXT, commit_sha TEXT, patch TEXT, error TEXT
);
CREATE TABLE IF NOT EXISTS events (
    run_id TEXT NOT NULL, seq INTEGER NOT NULL, body TEXT NOT NULL, PRIMARY KEY (run_id, seq)
);
CREATE INDEX IF NOT EXISTS runs_by_tenant ON runs (tenant, created);
"""
LIVE = ("queued", "running")  # statuses a run can only have while this process works on it
FIELDS = ("id", "tenant", "repo", "ref", "task", "model", "status", "created", "updated",
          "branch", "commit_sha", "error")


class Store:
    """One connection shared by the server's threads, serialised by a lock (runs publish
    events from their own threads; SQLite allows one writer at a time anyway)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.isolation_level = ""  # back to implicit transactions for `with self._db`
        self._lock = threading.Lock()
        with self._lock, self._db:
            self._db.executescript(SCHEMA)

    def create(self, run: dict[str, Any]) -> None:
        now = time.time()
        with self._lock, self._db:
            self._db.execute(
                "INSERT INTO runs (id, tenant, repo, ref, task, model, status, created, updated)"
                " VALUES (?, ?, ?, ?, ?, ?, 'running', ?, ?)",
                (run["id"], run["tenant"], run["repo"], run["ref"], run["task"], run["model"],
                 now, now))

    def update(self, run_id: str, **values: Any) -> None:
        """Set columns of a run (status, branch, commit_sha, patch, error)."""
        columns = ", ".join(f"{name} = ?" for name in values)
        with self._lock, self._db:
            self._db.execute(f"UPDATE runs SET {columns}, updated = ? WHERE id = ?",
                             (*values.values(), time.time(), run_id))

    def get(self, tenant: str, run_id: str) -> dict[str, Any] | None:
        """The run if it belongs to `tenant` (another tenant's run does not exist)."""
        with self._lock:
            row = self._db.execute(f"SELECT {', '.join(FIELDS)} FROM runs WHERE id = ? AND "
                                   "tenant = ?", (run_id, tenant)).fetchone()
        return dict(zip(FIELDS, row, strict=True)) if row else None

    def list(self, tenant: str, limit: int = 100) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute(f"SELECT {', '.join(FIELDS)} FROM runs WHERE tenant = ? "
                                    "ORDER BY created DESC LIMIT ?", (tenant, limit)).fetchall()
        return [dict(zip(FIELDS, row, strict=True)) for row in rows]

    def patch(self, run_id: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT patch FROM runs WHERE id = ?", (run_id,)).fetchone()
        return row[0] if row else None

    def append(self, run_id: str, event: dict[str, Any]) -> int:
        """Store an event as the run's next one; its sequence number (from 1)."""
        body = json.dumps(event, default=str)
        with self._lock, self._db:
            (last,) = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM events WHERE "
                                       "run_id = ?", (run_id,)).fetchone()
            self._db.execute("INSERT INTO events (run_id, seq, body) VALUES (?, ?, ?)",
                             (run_id, last + 1, body))
        return last + 1

    def events(self, run_id: str, after: int = 0) -> list[tuple[int, dict[str, Any]]]:
        """The run's events with a sequence number above `after`, in order."""
        with self._lock:
            rows = self._db.execute("SELECT seq, body FROM events WHERE run_id = ? AND seq > ?"
                                    " ORDER BY seq", (run_id, after)).fetchall()
        return [(seq, json.loads(body)) for seq, body in rows]

    def delete(self, run_id: str) -> None:
        """Forget a run: its row and its events, in one transaction."""
        with self._lock, self._db:
            self._db.execute("DELETE FROM events WHERE run_id = ?", (run_id,))
            self._db.execute("DELETE FROM runs WHERE id = ?", (run_id,))

    def last(self, run_id: str) -> tuple[int, str]:
        """The run's newest event: (sequence number, type); (0, "") if it has none."""
        with self._lock:
            row = self._db.execute("SELECT seq, body FROM events WHERE run_id = ? ORDER BY seq "
                                   "DESC LIMIT 1", (run_id,)).fetchone()
        return (row[0], json.loads(row[1])["type"]) if row else (0, "")

    def interrupt_unfinished(self) -> list[str]:
        """At start-up: runs this process did not finish were cut by a crash or restart.
        Each is marked "interrupted" with a final event, never left "running"."""
        with self._lock:
            ids = [r[0] for r in self._db.execute(
                "SELECT id FROM runs WHERE status IN (?, ?)", LIVE).fetchall()]
        for run_id in ids:  # the status first: a watcher ends on the event after it
            self.update(run_id, status="interrupted",
                        error="the server stopped while this run was going")
            self.append(run_id, {"type": "interrupted", "run_id": run_id,
                                 "error": "the server stopped while this run was going"})
        return ids

    def close(self) -> None:
        with self._lock:
            self._db.close()
