"""Each key's tokens-per-minute bucket, in the database so the limit holds across replicas.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"


def upgrade() -> None:
    op.create_table(
        "key_rate",
        sa.Column("key_id", sa.String(16), primary_key=True),
        sa.Column("level", sa.Float, nullable=False),
        sa.Column("updated", sa.Float, nullable=False))
