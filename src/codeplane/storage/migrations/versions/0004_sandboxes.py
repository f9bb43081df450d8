"""The sandbox fleet's records (any replica lists a tenant's sandboxes; a dead replica's are
marked gone). The sandboxes themselves stay on their host's disk.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"


def upgrade() -> None:
    op.create_table(
        "sandboxes",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("tenant", sa.String(64)),
        sa.Column("backend", sa.String(32), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("owner", sa.String(128), nullable=False),
        sa.Column("repo", sa.Text, nullable=False),
        sa.Column("ref", sa.Text, nullable=False),
        sa.Column("commit_sha", sa.String(64), nullable=False),
        sa.Column("holder", sa.String(128), nullable=False),
        sa.Column("created", sa.Float, nullable=False),
        sa.Column("last_used", sa.Float, nullable=False))
    op.create_index("sandboxes_by_tenant", "sandboxes", ["tenant", "state"])
    op.create_index("sandboxes_by_owner", "sandboxes", ["owner", "state"])
