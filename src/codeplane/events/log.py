"""EventLog: batch validated events in memory and flush them to the object store as Parquet.

Emitting never touches the network (request handlers call it); a background thread flushes
when `flush_events` are pending or `flush_seconds` have passed, and `close()` flushes the rest.
The buffer is bounded: while the store is unreachable events wait, and once `max_pending` wait,
new ones are dropped and counted rather than growing memory without limit. With
`compact_every_s` the same thread also compacts the days before today every so often
(`compact.py`; off by default: `codeplane events compact` does it on demand).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import defaultdict
from datetime import UTC, datetime
from typing import TYPE_CHECKING
from urllib.parse import quote

import pyarrow as pa
import pyarrow.parquet as pq

from codeplane.events.schema import PREFIX, EventError, file_schema, validate
from codeplane.storage import ObjectStore, StorageError

if TYPE_CHECKING:
    from codeplane.events.compact import Lock

log = logging.getLogger(__name__)

Pending = tuple[str, str, dict]  # kind, tenant, row


class EventLog:
    def __init__(self, store: ObjectStore, *, flush_events: int = 5000,
                 flush_seconds: float = 60.0, max_pending: int = 100_000,
                 compact_every_s: float = 0.0, lock: Lock | None = None) -> None:
        self.store = store
        self.compact_every_s, self.lock = compact_every_s, lock
        self._compacted = time.monotonic()
        self.flush_events = flush_events
        self.flush_seconds = flush_seconds
        self.max_pending = max_pending
        self.dropped = 0
        self.rejected = 0  # events `record` refused (a field out of its whitelist)
        self._pending: list[Pending] = []
        self._lock = threading.Lock()
        self._flushing = threading.Lock()  # one flush at a time: files never interleave
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="events-flush", daemon=True)
        self._thread.start()

    def emit(self, kind: str, tenant: str, fields: dict, at: datetime | None = None) -> None:
        """Queue one event; EventError if its kind or any field is not allowed."""
        row = validate(kind, tenant, fields, at or datetime.now(UTC))
        with self._lock:
            if self._closed:
                raise EventError("the event log is closed")
            if len(self._pending) >= self.max_pending:
                self.dropped += 1
                return
            self._pending.append((kind, tenant, row))
            if len(self._pending) >= self.flush_events:
                self._wake.set()

    def record(self, kind: str, tenant: str, fields: dict) -> None:
        """`emit` for request handlers: an event the schema refuses is logged and counted,
        never allowed to fail the user's request (the event is telemetry, not the answer)."""
        try:
            self.emit(kind, tenant, fields)
        except EventError as exc:
            self.rejected += 1
            log.warning("event %s refused: %s", kind, exc)

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def flush(self) -> list[str]:
        """Write everything pending now; returns the new object keys. A group the store
        refuses goes back into the buffer (bounded) and StorageError is raised after the
        others were written."""
        with self._flushing:
            with self._lock:
                batch, self._pending = self._pending, []
            written, failed, error = [], [], None
            for (kind, day, tenant), rows in _groups(batch).items():
                try:
                    written.append(self._write(kind, day, tenant, rows))
                except (OSError, StorageError) as exc:
                    failed += [(kind, tenant, row) for row in rows]
                    error = exc
            if error is not None:
                self._requeue(failed)
                raise StorageError(f"event flush to {self.store.url} failed: {error}")
            return written

    def close(self) -> None:
        """Stop the flusher and write what is left (raises if the store refuses it)."""
        with self._lock:
            self._closed = True
        self._wake.set()
        self._thread.join()
        self.flush()

    def _write(self, kind: str, day: str, tenant: str, rows: list[dict]) -> str:
        key = (f"{PREFIX}/kind={kind}/day={day}/tenant={quote(tenant, safe='')}/"
               f"part-{uuid.uuid4().hex}.parquet")
        table = pa.Table.from_pylist(rows, schema=file_schema(kind))
        with self.store.writer(key) as out:
            pq.write_table(table, out, compression="zstd")
        return key

    def _requeue(self, rows: list[Pending]) -> None:
        with self._lock:
            room = max(0, self.max_pending - len(self._pending))
            self.dropped += max(0, len(rows) - room)
            self._pending[:0] = rows[:room]

    def _run(self) -> None:
        while True:
            self._wake.wait(self.flush_seconds)
            self._wake.clear()
            with self._lock:
                if self._closed:
                    return
            if self.pending():
                try:
                    self.flush()
                except StorageError as exc:  # kept for the next round; logged, not fatal
                    log.warning("%s (%d events pending)", exc, self.pending())
            if self.compact_every_s and time.monotonic() - self._compacted >= self.compact_every_s:
                self._compacted = time.monotonic()
                self._compact()

    def _compact(self) -> None:
        """Compact the closed days (today's files still grow); a failure waits for the next
        round, like a flush."""
        from codeplane.events.compact import compact  # DuckDB: loaded only when used

        today = datetime.now(UTC).strftime("%Y-%m-%d")
        try:
            done = compact(self.store, before=today, lock=self.lock)
        except (OSError, StorageError) as exc:
            log.warning("event compaction failed: %s", exc)
            return
        if done.partitions or done.deleted:
            log.info("events compacted: %d partitions, %d files merged, %d deleted",
                     done.partitions, done.merged, done.deleted)


def _groups(batch: list[Pending]) -> dict[tuple[str, str, str], list[dict]]:
    groups: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for kind, tenant, row in batch:
        day = row["ts"].strftime("%Y-%m-%d")  # ts is UTC already
        groups[(kind, day, tenant)].append(row)
    return groups
