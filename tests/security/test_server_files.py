"""The server's files are the server user's alone (audit 2026-11-28, L6): the server directory
and what sits in it are 0700 (directories) and 0600 (files), the SQLite database and its WAL
included, whether a command made them first or an older version left them readable."""

from __future__ import annotations

import stat
from pathlib import Path

from conftest import LiveServer, free_port, make_settings
from typer.testing import CliRunner

from codeplane.server.app import create_app


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def private(server_dir: Path) -> dict[str, int]:
    """Mode of the server directory and of everything directly in it that is not private."""
    loose = {str(p.relative_to(server_dir.parent)): oct(mode(p))
             for p in [server_dir, *server_dir.iterdir()]
             if mode(p) != (0o700 if p.is_dir() else 0o600)}
    return loose


def test_a_new_server_home_is_private(tmp_path, engine):
    settings = make_settings(tmp_path / "home")
    server = LiveServer(create_app(settings, engine=engine), free_port()).start()
    try:
        server_dir = settings.server_dir
        assert (server_dir / "codeplane.db").is_file()
        assert (server_dir / "codeplane.db-wal").is_file()
        assert private(server_dir) == {}
    finally:
        server.stop()


def test_the_first_command_makes_the_database_private(tmp_path, monkeypatch):
    from codeplane.cli import app

    home = tmp_path / "home"
    monkeypatch.setenv("CODEPLANE_HOME", str(home))
    result = CliRunner().invoke(app, ["keys", "create", "ci", "--json"])
    assert result.exit_code == 0, result.output
    assert mode(home / "server") == 0o700 and mode(home / "server" / "codeplane.db") == 0o600


def test_loose_modes_left_by_an_older_version_are_tightened_at_start(tmp_path, engine):
    settings = make_settings(tmp_path / "home")
    LiveServer(create_app(settings, engine=engine), free_port()).start().stop()
    server_dir = settings.server_dir
    (server_dir / "background").mkdir()  # as background runs left it (the audit's 0755)
    server_dir.chmod(0o755)
    for path in server_dir.iterdir():
        path.chmod(0o755 if path.is_dir() else 0o644)
    assert private(server_dir)
    server = LiveServer(create_app(settings, engine=engine), free_port()).start()
    try:
        assert private(server_dir) == {}
    finally:
        server.stop()


def test_a_database_elsewhere_is_private_too(tmp_path):
    from codeplane.storage.database import Database

    path = tmp_path / "elsewhere" / "team.db"
    db = Database(f"sqlite:///{path}")
    db.upgrade()
    db.close()
    assert mode(path) == 0o600
    assert all(mode(p) == 0o600 for p in path.parent.iterdir())
