"""Everything the server keeps: replicas' leases, API keys and usage, search metadata,
background runs and their events, agent-run records.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None


def upgrade() -> None:
    op.create_table(
        "replicas",
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("started", sa.Float, nullable=False),
        sa.Column("heartbeat", sa.Float, nullable=False))
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(16), primary_key=True),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("hash", sa.String(64), nullable=False, unique=True),
        sa.Column("hint", sa.String(16), nullable=False),
        sa.Column("created", sa.Float, nullable=False),
        sa.Column("rpm", sa.Integer),
        sa.Column("tpm", sa.Integer),
        sa.Column("budget_tokens", sa.BigInteger),
        sa.Column("priority", sa.String(32), nullable=False),
        sa.Column("revoked", sa.Boolean, nullable=False),
        sa.Column("tenant", sa.String(64), nullable=False))
    op.create_table(
        "key_usage",
        sa.Column("key_id", sa.String(16), primary_key=True),
        sa.Column("used", sa.BigInteger, nullable=False),
        sa.Column("held", sa.BigInteger, nullable=False))
    op.create_table(
        "key_holds",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("key_id", sa.String(16), nullable=False),
        sa.Column("tokens", sa.BigInteger, nullable=False),
        sa.Column("replica", sa.String(128), nullable=False))
    op.create_index("key_holds_replica", "key_holds", ["replica"])
    op.create_table(
        "search_workspaces",
        sa.Column("tenant", sa.String(64), primary_key=True),
        sa.Column("ws", sa.String(128), primary_key=True),
        sa.Column("sid", sa.String(64), nullable=False, unique=True),
        sa.Column("key_id", sa.String(64), nullable=False),
        sa.Column("model", sa.String(255), nullable=False),
        sa.Column("created", sa.Float, nullable=False))
    op.create_table(
        "search_nodes",
        sa.Column("ws", sa.String(64), primary_key=True),
        sa.Column("path", sa.Text, primary_key=True),
        sa.Column("parent", sa.Text),
        sa.Column("hash", sa.String(128), nullable=False),
        sa.Column("is_dir", sa.Boolean, nullable=False))
    op.create_index("search_nodes_parent", "search_nodes", ["ws", "parent"])
    op.create_table(
        "search_cache",
        sa.Column("scope", sa.String(64), primary_key=True),
        sa.Column("ckey", sa.String(128), primary_key=True),
        sa.Column("vector", sa.LargeBinary, nullable=False))
    op.create_table(
        "background_runs",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("repo", sa.Text, nullable=False),
        sa.Column("ref", sa.Text, nullable=False),
        sa.Column("task", sa.Text, nullable=False),
        sa.Column("model", sa.String(255), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("created", sa.Float, nullable=False),
        sa.Column("updated", sa.Float, nullable=False),
        sa.Column("branch", sa.Text),
        sa.Column("commit_sha", sa.String(64)),
        sa.Column("patch", sa.Text),
        sa.Column("error", sa.Text),
        sa.Column("owner", sa.String(128)))
    op.create_index("background_runs_by_tenant", "background_runs", ["tenant", "created"])
    op.create_index("background_runs_by_owner", "background_runs", ["owner", "status"])
    op.create_table(
        "background_events",
        sa.Column("run_id", sa.String(32), primary_key=True),
        sa.Column("seq", sa.Integer, primary_key=True),
        sa.Column("body", sa.Text, nullable=False))
    op.create_table(
        "agent_runs",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("owner", sa.String(128), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("created", sa.Float, nullable=False),
        sa.Column("updated", sa.Float, nullable=False),
        sa.Column("error", sa.Text))
    op.create_index("agent_runs_by_tenant", "agent_runs", ["tenant", "status"])
