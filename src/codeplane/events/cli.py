"""`codeplane events query|stats`: read the event lake where `[storage] objects` points.

pyarrow and DuckDB are imported inside the commands: every `codeplane` invocation loads this
module, and those imports are slow (docs/deployment.md, "Event lake").
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from codeplane.clikit import ConfigOption, JsonOption, console, fail, print_json, settings

if TYPE_CHECKING:
    from codeplane.storage import ObjectStore

events_app = typer.Typer(help="Query the event lake (Tab, apply, agent and gateway events).",
                         no_args_is_help=True)


def _store(ctx: typer.Context, config: ConfigOption) -> ObjectStore:
    from codeplane.storage import ObjectStore, StorageError

    try:
        return ObjectStore.from_settings(settings(ctx, config))
    except StorageError as exc:
        fail(str(exc))


@events_app.command("query")
def query_cmd(
    ctx: typer.Context,
    sql: Annotated[str, typer.Argument(help="SQL over the views tab_shown, tab_accepted, "
                                            "tab_rejected, tab_next_shown, "
                                            "tab_next_accepted, tab_next_rejected, "
                                            "apply_outcome, agent_step, "
                                            "gateway_usage (each with day and tenant).")],
    as_json: JsonOption = False,
    config: ConfigOption = None,
) -> None:
    """Answer one SQL statement with DuckDB over the Parquet files."""
    import duckdb

    from codeplane.events import query as lake
    from codeplane.storage import StorageError

    store = _store(ctx, config)
    try:
        columns, rows = lake.query(store, sql)
    except duckdb.Error as exc:
        fail(f"query failed: {exc}")
    except StorageError as exc:
        fail(str(exc))
    if as_json:
        print_json([dict(zip(columns, row, strict=True)) for row in rows])
        return
    table = Table(*columns)
    for row in rows:
        table.add_row(*("" if v is None else str(v) for v in row))
    console.print(table)


@events_app.command("compact")
def compact_cmd(
    ctx: typer.Context,
    day: Annotated[str | None, typer.Option(help="Only this day (YYYY-MM-DD, UTC); default: "
                                                 "every day.")] = None,
    grace: Annotated[float, typer.Option(min=0, help="Seconds a replaced file is kept for "
                                                     "queries that listed it (deleted by a "
                                                     "later run).")] = 60.0,
    as_json: JsonOption = False,
    config: ConfigOption = None,
) -> None:
    """Merge each kind/day/tenant partition's small Parquet files into one. Safe while the
    server writes and queries run; a run killed midway is finished by the next."""
    from codeplane.events.compact import compact
    from codeplane.storage import Database, StorageError

    if day is not None and not re.fullmatch(r"\d{4}-\d{2}-\d{2}", day):
        fail(f"--day {day!r}: expected YYYY-MM-DD")
    store = _store(ctx, config)
    db = Database.from_settings(settings(ctx, config))  # its lock: one compaction per partition
    try:
        done = compact(store, day, lock=db.lock, grace_s=grace)
    except (OSError, StorageError) as exc:
        fail(f"compaction failed: {exc}")
    finally:
        db.close()
    if as_json:
        print_json({"partitions": done.partitions, "merged": done.merged,
                    "deleted": done.deleted, "written": done.written})
        return
    console.print(f"compacted {done.partitions} partitions ({done.merged} files merged); "
                  f"deleted {done.deleted} replaced files")


@events_app.command("stats")
def stats_cmd(
    ctx: typer.Context,
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's events.")] = None,
    as_json: JsonOption = False,
    config: ConfigOption = None,
) -> None:
    """Tab accept rate and latency percentiles, and gateway usage per model."""
    from codeplane.events import query as lake
    from codeplane.storage import StorageError

    try:
        result = lake.stats(_store(ctx, config), tenant)
    except StorageError as exc:
        fail(str(exc))
    if as_json:
        print_json(result)
        return
    tab = result["tab"]
    rate = "-" if tab["accept_rate"] is None else f"{tab['accept_rate']:.1%}"
    console.print(f"Tab: {tab['shown']} shown, {tab['accepted']} accepted, {tab['rejected']} "
                  f"rejected; accept rate {rate}; latency p50 {_ms(tab['latency_p50_ms'])}, "
                  f"p95 {_ms(tab['latency_p95_ms'])}")
    usage = Table("model", "requests", "prompt tokens", "completion tokens", "latency p50")
    for row in result["usage"]:
        usage.add_row(str(row["model"]), str(row["requests"]), str(row["prompt_tokens"]),
                      str(row["completion_tokens"]), _ms(row["latency_p50_ms"]))
    console.print(usage)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"
