"""Shared request-rate buckets (a key's requests per minute, a client address's requests and
tokens per minute), so those limits hold across workers and replicas like `key_rate` does.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"


def upgrade() -> None:
    op.create_table(
        "rate_buckets",
        sa.Column("name", sa.String(160), primary_key=True),
        sa.Column("level", sa.Float, nullable=False),
        sa.Column("updated", sa.Float, nullable=False))
    op.create_index("rate_buckets_by_updated", "rate_buckets", ["updated"])
