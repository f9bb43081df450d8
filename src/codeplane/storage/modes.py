"""Who may read the server's files: the server's user alone.

Everything the server persists locally sits under one directory (`$CODEPLANE_HOME/server/`,
CONTRIBUTING.md), so that directory is kept 0700: nothing below it can be reached by another
user whatever its own mode. What sits directly in it is made 0700 (directories) or 0600
(files) as well, and so is an SQLite database kept elsewhere, with its WAL, shared-memory and
lock files: an older version left them 0755/0644, and `tighten` at start fixes that.
"""

from __future__ import annotations

import os
from pathlib import Path

DIR_MODE, FILE_MODE = 0o700, 0o600


def private_dir(path: Path) -> Path:
    """`path`, created if missing, mode 0700 (its parents are created as the umask says)."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(DIR_MODE)
    return path


def private_file(path: Path) -> Path:
    """`path` created empty at 0600 if missing (so no reader ever sees a wider mode), or
    set to 0600."""
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, FILE_MODE))
    path.chmod(FILE_MODE)
    return path


def private_sqlite(path: Path) -> None:
    """An SQLite database 0600 before SQLite opens it (the WAL and shared-memory files it
    makes get the database's mode), and those files 0600 if an older version left them."""
    private_file(path)
    for companion in (f"{path}-wal", f"{path}-shm"):
        if os.path.exists(companion):
            os.chmod(companion, FILE_MODE)


def tighten(server_dir: Path) -> None:
    """The server directory 0700, and each entry directly in it 0700 or 0600 (symbolic
    links are left alone: their modes mean nothing, and their targets are not ours)."""
    private_dir(server_dir)
    for entry in server_dir.iterdir():
        if entry.is_symlink():
            continue
        entry.chmod(DIR_MODE if entry.is_dir() else FILE_MODE)
