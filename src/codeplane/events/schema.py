"""What an event may contain: a whitelist of scalar fields per kind, versioned.

The lake must never hold source code (the privacy boundary in CONTRIBUTING.md), so an event is
refused unless every field is whitelisted for its kind, has the declared scalar type, and every
string is short and single-line: identifiers, names and labels fit, code does not. A change
that alters a field's meaning bumps `SCHEMA_VERSION`, which is both a path segment
(`events/v2/...`) and a column, so readers never mix versions by accident.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime

import pyarrow as pa

SCHEMA_VERSION = 1
PREFIX = f"events/v{SCHEMA_VERSION}"
MAX_TEXT = 128  # longest string field: ids and labels, never a code snippet

_TEXT, _INT, _FLOAT, _BOOL = pa.string(), pa.int64(), pa.float64(), pa.bool_()
_TAB = {"suggestion_id": _TEXT, "model": _TEXT, "latency_ms": _FLOAT, "chars": _INT,
        "confidence": _FLOAT, "source": _TEXT, "language": _TEXT,
        # what Tab's show/hide decision read (codeplane.tab.decision.Signals): with the
        # accept/reject outcome, the data to refit it from
        "mean_logprob": _FLOAT, "min_logprob": _FLOAT, "first_logprob": _FLOAT,
        "tokens": _INT, "mid_line": _BOOL, "typed_chars": _INT, "truncated": _BOOL,
        "closes_bracket": _BOOL}
_TAB_OUTCOME = {**_TAB, "after_ms": _FLOAT}  # how long the suggestion was on screen
_TAB_NEXT = {"suggestion_id": _TEXT, "model": _TEXT, "latency_ms": _FLOAT,
             "probability": _FLOAT, "source": _TEXT, "format": _TEXT, "jump": _BOOL,
             # what next-edit Tab's show/hide rule read (codeplane.tab.nextedit.NextSignals)
             "min_logprob": _FLOAT, "sum_logprob": _FLOAT, "changed_lines": _INT,
             "distance": _INT, "agrees": _BOOL, "repeat": _BOOL}

KINDS: dict[str, dict[str, pa.DataType]] = {
    "tab_shown": _TAB,
    "tab_accepted": _TAB_OUTCOME,
    "tab_rejected": _TAB_OUTCOME,
    "tab_next_shown": _TAB_NEXT,
    "tab_next_accepted": {**_TAB_NEXT, "after_ms": _FLOAT},
    "tab_next_rejected": {**_TAB_NEXT, "after_ms": _FLOAT},
    "apply_outcome": {"model": _TEXT, "ok": _BOOL, "method": _TEXT, "format": _TEXT,
                      "seconds": _FLOAT, "output_tokens": _INT, "language": _TEXT},
    "agent_step": {"run_id": _TEXT, "step": _INT, "model": _TEXT, "tool": _TEXT,
                   "outcome": _TEXT, "latency_ms": _FLOAT, "prompt_tokens": _INT,
                   "completion_tokens": _INT, "adapter": _TEXT},
    "gateway_usage": {"model": _TEXT, "deployment": _TEXT, "key_id": _TEXT, "kind": _TEXT,
                      "status": _INT, "latency_ms": _FLOAT, "prompt_tokens": _INT,
                      "completion_tokens": _INT,
                      # the LoRA adapter version a local adapter model ran with (null: none)
                      "adapter": _TEXT},
}
# Columns every file carries before the kind's own; day and tenant live in the path (Hive
# partitions), so a query filtering on them reads only the matching files. `ts` is UTC stored
# without a zone: DuckDB hands zoned timestamps to Python only through pytz.
_BASE = [pa.field("ts", pa.timestamp("ms")), pa.field("schema_version", pa.int16())]
PARTITIONS = pa.schema([pa.field("day", pa.string()), pa.field("tenant", pa.string())])


class EventError(ValueError):
    """An event was refused: unknown kind, field outside the whitelist, or a bad value."""


def file_schema(kind: str) -> pa.Schema:
    fields = _BASE + [pa.field(name, kind_type) for name, kind_type in KINDS[kind].items()]
    return pa.schema(fields, metadata={"codeplane.events.schema_version": str(SCHEMA_VERSION),
                                       "codeplane.events.kind": kind})


def view_schema(kind: str) -> pa.Schema:
    """Columns of the query view: the file's plus the partition columns."""
    return pa.schema(list(file_schema(kind)) + list(PARTITIONS))


def validate(kind: str, tenant: str, fields: dict, at: datetime) -> dict:
    """The row to store for this event, or EventError saying what is not allowed."""
    allowed = KINDS.get(kind)
    if allowed is None:
        raise EventError(f"unknown event kind {kind!r}; known: {', '.join(KINDS)}")
    _check_text("tenant", tenant)
    if not tenant:
        raise EventError("tenant must not be empty")
    extra = sorted(set(fields) - set(allowed))
    if extra:
        raise EventError(f"{kind}: fields not in the whitelist: {', '.join(extra)}")
    for name, value in fields.items():
        _check_value(f"{kind}.{name}", allowed[name], value)
    if at.tzinfo is None:
        raise EventError("event time must be timezone-aware")
    return {"ts": at.astimezone(UTC).replace(tzinfo=None), "schema_version": SCHEMA_VERSION,
            **{name: fields.get(name) for name in allowed}}


def _check_value(name: str, kind_type: pa.DataType, value: object) -> None:
    if value is None:
        return
    if kind_type == _TEXT:
        _check_text(name, value)
    elif kind_type == _BOOL:
        if not isinstance(value, bool):
            raise EventError(f"{name}: expected true/false, got {type(value).__name__}")
    elif isinstance(value, bool) or not isinstance(value, int | float):
        raise EventError(f"{name}: expected a number, got {type(value).__name__}")
    elif kind_type == _INT and not isinstance(value, int):
        raise EventError(f"{name}: expected an integer, got {value!r}")
    elif not math.isfinite(value):
        raise EventError(f"{name}: expected a finite number, got {value!r}")


def _check_text(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise EventError(f"{name}: expected a string, got {type(value).__name__}")
    if len(value) > MAX_TEXT or any(ch < " " for ch in value):
        raise EventError(f"{name}: strings are single-line labels of at most {MAX_TEXT} "
                         "characters (source code never goes into the event lake)")
