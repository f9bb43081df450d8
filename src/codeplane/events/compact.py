"""Event-lake compaction: merge a partition's (kind, day, tenant) small Parquet files into one.

Every flush writes one small file per partition, so a busy day accumulates thousands. A
compaction reads a partition's live files with DuckDB, writes them as one
`compact-<uuid>.parquet` whose footer names every file it replaces
(`codeplane.events.replaces`), and only later deletes those files. Readers (`query.py`) skip
any file a compact file present in their listing replaces, so at every moment a listing shows
each row exactly once:
- before the compact file lands (an atomic put): the small files;
- after it: the compact file, its replaced files skipped until deleted;
- a file written after the compaction listed the partition is not replaced: still read.

The replaced files are deleted `grace_s` after their compact file was written, so a reader
that listed just before is not left without a file it is reading (it would also re-list and
retry: `query.py`). A compaction killed at any point is finished by the next run: a torn
compact file never lands (staging, swept at start), and one that landed has its replaced
files deleted. Two compactions of one partition must not interleave (each would replace the
same files): they hold the database lock `events-compact:<partition>`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import duckdb
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from codeplane.events.schema import PREFIX, file_schema
from codeplane.storage import ObjectInfo, ObjectStore

COMPACT = "compact-"
REPLACES = b"codeplane.events.replaces"
Lock = Callable[[str], AbstractContextManager]


@dataclass
class Compaction:
    """What one run did: partitions merged, files merged into them, replaced files deleted."""
    partitions: int = 0
    merged: int = 0
    deleted: int = 0
    written: list[str] = field(default_factory=list)


def replaced(store: ObjectStore, keys: list[str]) -> dict[str, set[str]]:
    """For each compact file among `keys`, the keys it replaces (read from its footer)."""
    found = {}
    for key in keys:
        if key.rpartition("/")[2].startswith(COMPACT):
            try:
                meta = pq.read_schema(key, filesystem=store.filesystem).metadata or {}
            except OSError as exc:  # S3 names a vanished key in a plain OSError
                raise FileNotFoundError(f"{key}: {exc}") from exc
            found[key] = set(json.loads(meta.get(REPLACES, b"[]")))
    return found


def live(store: ObjectStore, keys: list[str]) -> list[str]:
    """The files of a listing a reader reads: every row once (see the module docstring)."""
    skip = set().union(*replaced(store, keys).values())
    return [key for key in keys if key not in skip]


def compact(store: ObjectStore, day: str | None = None, lock: Lock | None = None,
            grace_s: float = 60.0, before: str | None = None) -> Compaction:
    """Compact every partition (of `day`, or of days before `before`, or all) with more than
    one live file, and delete what compact files replaced more than `grace_s` ago."""
    done = Compaction()
    for directory in _partitions(store):
        part_day = directory.split("/day=", 1)[1].split("/", 1)[0]
        if (day is not None and part_day != day) or (before is not None and part_day >= before):
            continue
        with (lock or _no_lock)(f"events-compact:{directory}"):
            _compact_partition(store, directory, grace_s, done)
    return done


def _no_lock(_name: str) -> AbstractContextManager:
    return nullcontext()


def _partitions(store: ObjectStore) -> list[str]:
    """The partition directories (kind/day/tenant) that hold event files."""
    return sorted({info.key.rpartition("/")[0] for info in _files(store, PREFIX)})


def _files(store: ObjectStore, prefix: str) -> list[ObjectInfo]:
    return [info for info in store.list(prefix) if info.key.endswith(".parquet")]


def _compact_partition(store: ObjectStore, directory: str, grace_s: float,
                       done: Compaction) -> None:
    """Finish earlier compactions (delete what they replaced, once past the grace time),
    then merge the live files if there are several; listed under the partition's lock."""
    infos = _files(store, directory)
    keys = [i.key for i in infos]
    stamps = {i.key: i.mtime or 0.0 for i in infos}
    old = replaced(store, keys)
    for compact_key, gone in old.items():
        if stamps[compact_key] <= time.time() - grace_s:
            for key in sorted(gone & set(keys)):
                store.delete(key)
                done.deleted += 1
    keys = [i.key for i in _files(store, directory)]
    current = live(store, keys)
    if len(current) < 2:
        return
    kind = directory.split("kind=", 1)[1].split("/", 1)[0]
    schema = file_schema(kind)
    con = duckdb.connect(":memory:")
    con.register("part", ds.dataset(current, schema=schema, format="parquet",
                                    filesystem=store.filesystem))
    con.execute("SET enable_external_access = false")
    table = con.sql("SELECT * FROM part ORDER BY ts").to_arrow_table()
    meta = {**(schema.metadata or {}), REPLACES: json.dumps(sorted(keys)).encode()}
    key = f"{directory}/{COMPACT}{uuid.uuid4().hex}.parquet"
    with store.writer(key) as out:
        pq.write_table(table.cast(schema).replace_schema_metadata(meta), out,
                       compression="zstd")
    done.partitions += 1
    done.merged += len(current)
    done.written.append(key)
    if grace_s <= 0:  # nobody may still be reading: finish now
        for old_key in keys:
            store.delete(old_key)
            done.deleted += 1
