"""The event lake: usage events as Parquet files on the object store, queried with DuckDB.

`EventLog.emit(kind, tenant, fields)` validates against a per-kind whitelist of scalar fields
(so no source code can reach the lake), batches in memory and flushes one Parquet file per
kind, day and tenant under `events/v1/kind=.../day=YYYY-MM-DD/tenant=.../part-<uuid>.parquet`.
`query.connect(store)` gives a DuckDB connection with one view per kind.
"""

from codeplane.events.log import EventLog
from codeplane.events.schema import KINDS, SCHEMA_VERSION, EventError

__all__ = ["KINDS", "SCHEMA_VERSION", "EventError", "EventLog"]
