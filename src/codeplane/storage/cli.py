"""`codeplane db upgrade|status`: the server database's schema, outside a running server.

`codeplane serve` upgrades at start itself; an operator runs `db upgrade` to migrate before a
rolling deploy (replicas of the new version then start against a ready schema).
"""

from __future__ import annotations

import typer

from codeplane.clikit import ConfigOption, JsonOption, console, fail, print_json, settings

db_app = typer.Typer(help="The server database (SQLite or PostgreSQL): schema migrations.",
                     no_args_is_help=True)


@db_app.command("upgrade")
def upgrade_cmd(ctx: typer.Context, json_: JsonOption = False, config: ConfigOption = None) -> None:
    """Bring the schema to the newest revision (safe while replicas run or start)."""
    from codeplane.storage.database import Database, DatabaseError

    try:
        db = Database.from_settings(settings(ctx, config), upgrade=False)
        before = db.revision()
        after = db.upgrade()
        db.close()
    except DatabaseError as exc:
        fail(str(exc))
    if json_:
        print_json({"database": db.engine.url.render_as_string(hide_password=True),
                    "from": before, "to": after})
        return
    console.print(f"database at revision {after}" + (f" (was {before})" if before != after
                                                      else " (already current)"))


@db_app.command("status")
def status_cmd(ctx: typer.Context, json_: JsonOption = False, config: ConfigOption = None) -> None:
    """Which database the server uses and its schema revision (none: not created yet)."""
    from codeplane.storage.database import Database, DatabaseError

    try:
        db = Database.from_settings(settings(ctx, config), upgrade=False)
        revision = db.revision()
        db.close()
    except DatabaseError as exc:
        fail(str(exc))
    url = db.engine.url.render_as_string(hide_password=True)
    if json_:
        print_json({"database": url, "revision": revision})
        return
    console.print(f"{url}: revision {revision or 'none (run codeplane db upgrade)'}")
