"""A run's event log in the server database: its events as JSON, numbered per run from 1 (the
SSE event id, which makes `Last-Event-ID` resumption exact), read back after a number.

Agent runs and background agents each keep one, in a table of this shape
(`storage/tables.py`: `run_log("agent_events", ...)`, `run_log("background_events", ...)`);
what a run's records decide (who numbers the events, when a run ends) stays with them.
"""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import Column, Integer, MetaData, String, Table, Text, func, select
from sqlalchemy.engine import Connection

Event = dict[str, Any]


def run_log(name: str, metadata: MetaData, id_length: int) -> Table:
    """The table of one kind of run's events: (run id, number) -> the event's JSON."""
    return Table(
        name, metadata,
        Column("run_id", String(id_length), primary_key=True),
        Column("seq", Integer, primary_key=True),
        Column("body", Text, nullable=False),
    )


def write(conn: Connection, log: Table, run_id: str, seq: int, event: Event) -> None:
    """Store `event` as the run's number `seq` (IntegrityError if that number is taken)."""
    conn.execute(log.insert().values(run_id=run_id, seq=seq,
                                     body=json.dumps(event, default=str)))


def append(conn: Connection, log: Table, run_id: str, event: Event) -> int:
    """Store `event` after whatever the run stored last; its number."""
    seq = conn.scalar(select(func.coalesce(func.max(log.c.seq), 0)).where(
        log.c.run_id == run_id)) + 1
    write(conn, log, run_id, seq, event)
    return seq


def read(conn: Connection, log: Table, run_id: str, after: int = 0) -> list[tuple[int, Event]]:
    """The run's events numbered above `after`, in order."""
    rows = conn.execute(select(log.c.seq, log.c.body).where(
        log.c.run_id == run_id, log.c.seq > after).order_by(log.c.seq)).all()
    return [(seq, json.loads(body)) for seq, body in rows]
