"""Event-lake compaction on a directory and on S3 (a real SeaweedFS on loopback): a
partition's small files become one, readers during a compaction see every row exactly once,
and a compaction cut short at any point is finished by the next run.
"""

from __future__ import annotations

import json
import threading
from datetime import UTC, datetime
from pathlib import Path

from test_events import _cli, store, store_url  # noqa: F401  (fixtures)
from upstreams.scripted import wait_for

from codeplane.events import query as lake
from codeplane.events.compact import COMPACT, compact
from codeplane.events.log import EventLog
from codeplane.storage import ObjectStore

pytest_plugins = ["s3server"]
DAY = datetime(2026, 11, 20, 12, 0, tzinfo=UTC)
COUNT = "SELECT count(*), count(DISTINCT suggestion_id) FROM tab_shown"


def _batches(objects: ObjectStore, batches: int, rows: int, tenant: str = "acme",
             start: int = 0) -> None:
    """`batches` flushes of `rows` tab_shown events each, one file per flush."""
    events = EventLog(objects)
    for b in range(start, start + batches):
        for r in range(rows):
            events.emit("tab_shown", tenant, {"suggestion_id": f"s{b}-{r}", "latency_ms": 1.0},
                        at=DAY)
        events.flush()
    events.close()


def _files(objects: ObjectStore) -> list[str]:
    return [i.key.rpartition("/")[2] for i in objects.list("events")
            if i.key.endswith(".parquet")]


def test_a_partitions_files_become_one_and_a_second_run_changes_nothing(store):  # noqa: F811
    _batches(store, 6, 5)
    _batches(store, 2, 5, tenant="beta", start=100)
    before = lake.query(store, "SELECT tenant, count(*) FROM tab_shown GROUP BY 1 ORDER BY 1")
    done = compact(store, grace_s=0)
    assert (done.partitions, done.merged, done.deleted) == (2, 8, 8)
    names = _files(store)
    assert len(names) == 2 and all(n.startswith(COMPACT) for n in names)
    assert lake.query(store, "SELECT tenant, count(*) FROM tab_shown GROUP BY 1 ORDER BY 1") \
        == before
    again = compact(store, grace_s=0)
    assert (again.partitions, again.deleted) == (0, 0) and _files(store) == names
    assert compact(store, day="2026-11-19").partitions == 0  # another day: untouched


def test_a_compaction_cut_short_anywhere_is_finished_by_the_next_run(store):  # noqa: F811
    """A long grace leaves the state of a run killed after its compact file landed (the
    replaced files still there); deleting some by hand, that of one killed mid-delete.
    Readers count every row once in both, and the next run finishes the job."""
    _batches(store, 4, 5)
    first = compact(store, grace_s=3600)
    assert (first.partitions, first.deleted) == (1, 0) and len(_files(store)) == 5
    assert lake.query(store, COUNT)[1] == [(20, 20)]
    replaced = [i.key for i in store.list("events")
                if not i.key.rpartition("/")[2].startswith(COMPACT)]
    _batches(store, 1, 5, start=4)  # a flush after the compaction: read, not replaced
    store.delete(replaced[0])  # killed after deleting one replaced file
    assert lake.query(store, COUNT)[1] == [(25, 25)]
    second = compact(store, grace_s=0)  # finishes the deletes, merges compact + new file
    assert second.partitions == 1 and len(_files(store)) == 1
    assert lake.query(store, COUNT)[1] == [(25, 25)]


def test_readers_during_compactions_see_every_row_once(store):  # noqa: F811
    """Readers query in a loop while rounds of "flush a batch, compact with no grace" run:
    no reader ever counts a row twice (count = distinct ids) or misses a row that was
    written before it started."""
    _batches(store, 8, 5)
    written = [40]  # rows committed so far
    stop, seen, errors = threading.Event(), [], []

    def reader() -> None:
        while not stop.is_set():
            floor = written[0]
            try:
                (total, distinct), = lake.query(store, COUNT)[1]
            except Exception as exc:  # noqa: BLE001  (reported below: a reader never fails)
                errors.append(repr(exc))
                return
            seen.append((floor, total, distinct))

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        for round_ in range(4):
            compact(store, grace_s=0)
            _batches(store, 2, 5, start=100 + 2 * round_)
            written[0] += 10
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert not errors, errors
    assert len(seen) >= 4
    assert all(total == distinct >= floor for floor, total, distinct in seen), seen
    assert lake.query(store, COUNT)[1] == [(80, 80)]


def test_cli_compact(store, store_url, tmp_path: Path) -> None:  # noqa: F811
    _batches(store, 3, 2)
    bad = _cli(store_url, tmp_path, "compact", "--day", "yesterday")
    assert bad.exit_code == 2 and "YYYY-MM-DD" in bad.stderr
    result = _cli(store_url, tmp_path, "compact", "--day", "2026-11-20", "--grace", "0",
                  "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["merged"] == 3 and len(_files(store)) == 1


def test_serve_compacts_closed_days_only_when_asked(tmp_path: Path) -> None:
    lake_store = ObjectStore.open(str(tmp_path / "objects"))
    _batches(lake_store, 2, 2)  # a closed day
    events = EventLog(lake_store, flush_seconds=0.05, compact_every_s=0.05)
    events.emit("tab_shown", "acme", {"suggestion_id": "today"})
    events.flush()
    events.emit("tab_shown", "acme", {"suggestion_id": "today-2"})
    events.flush()
    wait_for(lambda: sum(n.startswith(COMPACT) for n in _files(lake_store)) == 1, 30,
             "for the closed day's compaction")
    events.close()
    assert len(_files(lake_store)) == 5  # today's two untouched; the replaced two kept (grace)
    assert lake.query(lake_store, COUNT)[1] == [(6, 6)]
