"""The web UI's sign-in sessions: a random token in the browser's cookie, its SHA-256 here
with the key it belongs to and when it expires (`gateway/keys.py`).

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"


def upgrade() -> None:
    op.create_table(
        "ui_sessions",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("key_id", sa.String(16), nullable=False),
        sa.Column("created", sa.Float, nullable=False),
        sa.Column("expires", sa.Float, nullable=False))
    op.create_index("ui_sessions_by_key", "ui_sessions", ["key_id"])
    op.create_index("ui_sessions_by_expiry", "ui_sessions", ["expires"])
