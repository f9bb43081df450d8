"""The database's tables as the code reads and writes them (SQLAlchemy Core).

The schema itself is created and changed only by the Alembic migrations in `migrations/`;
`tests/test_database.py` checks that the migrated schema and these definitions agree. No
source code a client sent is stored in any of them: search keeps encrypted paths, HMACs and
rotated vectors; background runs keep what docs/background.md lists (their checkouts live on
the replica's disk), and agent runs their events, which hold code only from workspaces under
`serve.workspace_roots` (already on the server), as the background runs' do.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
)

from codeplane.storage.runlog import run_log

metadata = MetaData()

# A serving process's lease: work owned by a replica whose heartbeat is stale is taken over.
replicas = Table(
    "replicas", metadata,
    Column("id", String(128), primary_key=True),
    Column("host", String(255), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("started", Float, nullable=False),
    Column("heartbeat", Float, nullable=False),
)

api_keys = Table(
    "api_keys", metadata,
    Column("id", String(16), primary_key=True),
    Column("name", String(255), nullable=False),
    Column("hash", String(64), nullable=False, unique=True),
    Column("hint", String(16), nullable=False),
    Column("created", Float, nullable=False),
    Column("rpm", Integer),
    Column("tpm", Integer),
    Column("budget_tokens", BigInteger),
    Column("priority", String(32), nullable=False),
    Column("revoked", Boolean, nullable=False, default=False),
    Column("tenant", String(64), nullable=False),
)

# One row per key: `used` tokens so far, `held` by calls in flight on any replica. The budget
# check is one conditional UPDATE of this row, so replicas cannot overspend it together.
key_usage = Table(
    "key_usage", metadata,
    Column("key_id", String(16), primary_key=True),
    Column("used", BigInteger, nullable=False, default=0),
    Column("held", BigInteger, nullable=False, default=0),
)

# Each reservation, so the tokens a killed replica held are given back by whoever notices.
key_holds = Table(
    "key_holds", metadata,
    Column("id", String(32), primary_key=True),
    Column("key_id", String(16), nullable=False),
    Column("tokens", BigInteger, nullable=False),
    Column("replica", String(128), nullable=False),
    Index("key_holds_replica", "replica"),
)

# A token bucket per key with a `tpm` (a minute's worth of burst, refilled continuously): a
# call takes its share with one conditional UPDATE that refills and spends in one step.
key_rate = Table(
    "key_rate", metadata,
    Column("key_id", String(16), primary_key=True),
    Column("level", Float, nullable=False),
    Column("updated", Float, nullable=False),  # wall-clock seconds of the last change
)

search_workspaces = Table(
    "search_workspaces", metadata,
    Column("tenant", String(64), primary_key=True),
    Column("ws", String(128), primary_key=True),
    Column("sid", String(64), nullable=False, unique=True),
    Column("key_id", String(64), nullable=False),
    Column("model", String(255), nullable=False),
    Column("created", Float, nullable=False),
)

search_nodes = Table(
    "search_nodes", metadata,
    Column("ws", String(64), primary_key=True),
    Column("path", Text, primary_key=True),
    Column("parent", Text),
    Column("hash", String(128), nullable=False),
    Column("is_dir", Boolean, nullable=False),
    Index("search_nodes_parent", "ws", "parent"),
)

search_cache = Table(
    "search_cache", metadata,
    Column("scope", String(64), primary_key=True),
    Column("ckey", String(128), primary_key=True),
    Column("vector", LargeBinary, nullable=False),
)

background_runs = Table(
    "background_runs", metadata,
    Column("id", String(32), primary_key=True),
    Column("tenant", String(64), nullable=False),
    Column("repo", Text, nullable=False),
    Column("ref", Text, nullable=False),
    Column("task", Text, nullable=False),
    Column("model", String(255), nullable=False),
    Column("status", String(32), nullable=False),
    Column("created", Float, nullable=False),
    Column("updated", Float, nullable=False),
    Column("branch", Text),
    Column("commit_sha", String(64)),
    Column("patch", Text),
    Column("error", Text),
    Column("owner", String(128)),  # the replica working on it (its checkout is on that host)
    Index("background_runs_by_tenant", "tenant", "created"),
    Index("background_runs_by_owner", "owner", "status"),
)

background_events = run_log("background_events", metadata, 32)

# Agent runs' records. `cancel_requested` is set by whichever replica was asked to cancel;
# the owner polls for it (agent/runs.py).
agent_runs = Table(
    "agent_runs", metadata,
    Column("id", String(64), primary_key=True),
    Column("tenant", String(64), nullable=False),
    Column("owner", String(128), nullable=False),
    Column("status", String(32), nullable=False),
    Column("created", Float, nullable=False),
    Column("updated", Float, nullable=False),
    Column("error", Text),
    Column("cancel_requested", Float),
    Index("agent_runs_by_tenant", "tenant", "status"),
    Index("agent_runs_by_owner", "owner", "status"),
)

# Agent runs' events, append-only and numbered per run (the SSE event id). They hold what the
# in-memory transcript held: the run works on code under serve.workspace_roots, which already
# lives on the server (the background runs' stance); pruned with the run's record.
agent_events = run_log("agent_events", metadata, 64)

# The sandbox fleet's records: the sandbox itself (its tree, its processes) is on the owner's
# host; this row lets any replica list it and says when its owner died (`state` "gone").
sandboxes = Table(
    "sandboxes", metadata,
    Column("id", String(64), primary_key=True),
    Column("tenant", String(64)),  # NULL while it waits in a warm pool
    Column("backend", String(32), nullable=False),  # the clone strategy that made it
    Column("state", String(16), nullable=False),  # pooled | active | gone
    Column("owner", String(128), nullable=False),  # the replica whose host holds it
    Column("repo", Text, nullable=False),
    Column("ref", Text, nullable=False),
    Column("commit_sha", String(64), nullable=False),
    Column("holder", String(128), nullable=False),
    Column("created", Float, nullable=False),
    Column("last_used", Float, nullable=False),
    Index("sandboxes_by_tenant", "tenant", "state"),
    Index("sandboxes_by_owner", "owner", "state"),
)

# Request-rate token buckets shared by every worker and replica (`gateway/admission.py`):
# "rpm:<key id>", "ip_rpm:<address>", "ip_tpm:<address>".
rate_buckets = Table(
    "rate_buckets", metadata,
    Column("name", String(160), primary_key=True),
    Column("level", Float, nullable=False),
    Column("updated", Float, nullable=False),
    Index("rate_buckets_by_updated", "updated"),
)

# The web UI's sessions: the SHA-256 of the token in the browser's cookie (never the token),
# the key it acts for (revoking the key ends them) and when it expires (`gateway/keys.py`).
ui_sessions = Table(
    "ui_sessions", metadata,
    Column("id", String(64), primary_key=True),
    Column("key_id", String(16), nullable=False),
    Column("created", Float, nullable=False),
    Column("expires", Float, nullable=False),
    Index("ui_sessions_by_key", "key_id"),
    Index("ui_sessions_by_expiry", "expires"),
)
