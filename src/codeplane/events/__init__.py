"""The event lake: usage events as Parquet files on the object store, queried with DuckDB.

`EventLog.emit(kind, tenant, fields)` validates against a per-kind whitelist of scalar fields
(so no source code can reach the lake), batches in memory and flushes one Parquet file per
kind, day and tenant under `events/v1/kind=.../day=YYYY-MM-DD/tenant=.../part-<uuid>.parquet`.
`query.connect(store)` gives a DuckDB connection with one view per kind.

Import from the modules (`events.log.EventLog`, `events.schema`, `events.query`): this package
is loaded by every `codeplane` command (the CLI mount), and pyarrow is slow to import
(docs/deployment.md, "Event lake").
"""
