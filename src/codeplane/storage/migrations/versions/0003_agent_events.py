"""Agent runs' events in the database (any replica streams any run) and a cancel flag the
owning replica polls (any replica can cancel any run).

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"


def upgrade() -> None:
    op.create_table(
        "agent_events",
        sa.Column("run_id", sa.String(64), primary_key=True),
        sa.Column("seq", sa.Integer, primary_key=True),
        sa.Column("body", sa.Text, nullable=False))
    with op.batch_alter_table("agent_runs") as batch:
        batch.add_column(sa.Column("cancel_requested", sa.Float))
    op.create_index("agent_runs_by_owner", "agent_runs", ["owner", "status"])
