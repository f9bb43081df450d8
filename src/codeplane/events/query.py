"""DuckDB over the event lake: one view per kind, read through pyarrow datasets.

DuckDB's own S3 reader (the httpfs extension) is downloaded at run time, which codeplane never
does; pyarrow datasets on the store's filesystem work for a directory and S3 alike, and DuckDB
scans them with filter and projection pushdown (a `day = ...` filter reads only that day's
files). The connection then disables external access, so a query cannot read or write files
on its own.

Compaction (`compact.py`) replaces files while queries run: a listing skips the files a
compact file replaces, and a query whose file was deleted under it (it listed just before a
compaction finished) is answered again from a fresh listing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import duckdb
import pyarrow.dataset as ds

from codeplane.events.compact import live
from codeplane.events.schema import KINDS, PARTITIONS, PREFIX, view_schema
from codeplane.storage import ObjectStore

T = TypeVar("T")
ATTEMPTS = 10  # listings a query is tried on before a vanished file is reported


def connect(store: ObjectStore) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB with a view per event kind (empty views for kinds never seen)."""
    con = duckdb.connect(":memory:")
    files = live(store, [info.key for info in store.list(PREFIX)
                         if info.key.endswith(".parquet")])
    for kind in KINDS:
        base = f"{PREFIX}/kind={kind}"
        paths = [key for key in files if key.startswith(base + "/")]
        dataset = ds.dataset(paths, schema=view_schema(kind), format="parquet",
                             filesystem=store.filesystem, partition_base_dir=base,
                             partitioning=ds.partitioning(PARTITIONS, flavor="hive"))
        con.register(kind, dataset)
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
    return con


def query(store: ObjectStore, sql: str) -> tuple[list[str], list[tuple]]:
    """Run one SQL statement; returns column names and rows (duckdb.Error on bad SQL)."""
    def run(con: duckdb.DuckDBPyConnection) -> tuple[list[str], list[tuple]]:
        cursor = con.execute(sql)
        return [d[0] for d in cursor.description or []], cursor.fetchall()

    return _relisting(store, run)


def stats(store: ObjectStore, tenant: str | None = None) -> dict[str, Any]:
    """Tab accept rate and latency percentiles, and gateway usage per model."""
    return _relisting(store, lambda con: _stats(con, tenant))


def _relisting(store: ObjectStore, answer: Callable[[duckdb.DuckDBPyConnection], T]) -> T:
    """`answer` over a fresh listing, again if a listed file vanished mid-query (a
    compaction deleted it): the new listing has the compact file that holds its rows."""
    for _ in range(ATTEMPTS - 1):
        try:
            return answer(connect(store))
        except FileNotFoundError:  # a compact file's footer, gone before it was read
            continue
        except duckdb.Error as exc:
            if "reading the stream registered" not in str(exc):  # the SQL, not the files
                raise
    return answer(connect(store))


def _stats(con: duckdb.DuckDBPyConnection, tenant: str | None) -> dict[str, Any]:
    where, args = ("WHERE tenant = ?", [tenant]) if tenant else ("", [])
    shown, p50, p95 = con.execute(
        "SELECT count(*), quantile_cont(latency_ms, 0.5), quantile_cont(latency_ms, 0.95) "
        f"FROM tab_shown {where}", args).fetchone()
    accepted = con.execute(f"SELECT count(*) FROM tab_accepted {where}", args).fetchone()[0]
    rejected = con.execute(f"SELECT count(*) FROM tab_rejected {where}", args).fetchone()[0]
    usage = con.execute(
        "SELECT model, count(*) AS requests, coalesce(sum(prompt_tokens), 0) AS prompt_tokens, "
        "coalesce(sum(completion_tokens), 0) AS completion_tokens, "
        "quantile_cont(latency_ms, 0.5) AS latency_p50_ms "
        f"FROM gateway_usage {where} GROUP BY model ORDER BY requests DESC, model", args)
    columns = [d[0] for d in usage.description]
    return {
        "tab": {"shown": shown, "accepted": accepted, "rejected": rejected,
                "accept_rate": accepted / shown if shown else None,
                "latency_p50_ms": p50, "latency_p95_ms": p95},
        "usage": [dict(zip(columns, row, strict=True)) for row in usage.fetchall()],
    }
