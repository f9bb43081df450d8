"""Alembic's entry point: the caller (`Database.upgrade`) hands over an open connection inside
its exclusive transaction, so migrations never open connections of their own."""

from alembic import context

context.configure(connection=context.config.attributes["connection"],
                  render_as_batch=True)  # SQLite changes columns by copying tables
with context.begin_transaction():
    context.run_migrations()
