"""A real PostgreSQL for tests: Debian's PostgreSQL 15 binaries, a scratch cluster started on a
free loopback port with password (SCRAM) authentication, stopped at the end of the session.
Import the fixtures into a test module: `from pgserver import pg_server, pg_url`.

PostgreSQL refuses to run as root; under root the cluster belongs to the `postgres` user
(`runuser`), in a directory that user owns.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from s3server import _free_ports

BIN = Path(os.environ.get("CODEPLANE_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))
USER, PASSWORD = "codeplane", "codeplane-test-password"


@dataclass(frozen=True)
class PgServer:
    port: int

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{USER}:{PASSWORD}@127.0.0.1:{self.port}/{database}"

    def admin(self, sql: str) -> None:
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(sql)


def _as_owner(command: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command


def _wait_ready(server: PgServer, proc: subprocess.Popen, deadline: float, log: Path) -> None:
    import psycopg

    while True:
        try:
            with psycopg.connect(server.url(), connect_timeout=2):
                return
        except psycopg.OperationalError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"PostgreSQL did not start; see {log}") from None
            time.sleep(0.2)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    if not (BIN / "postgres").is_file():
        pytest.skip(f"PostgreSQL binaries missing in {BIN}: apt-get install postgresql-15")
    root = Path(tempfile.mkdtemp(prefix="codeplane-pg-"))  # not under root's private tmp
    if os.geteuid() == 0:
        owner = pwd.getpwnam("postgres")
        os.chown(root, owner.pw_uid, owner.pw_gid)
    (root / "pw").write_text(PASSWORD)
    os.chmod(root / "pw", 0o644)
    data, log_path = root / "data", root / "postgres.log"
    subprocess.run(_as_owner([str(BIN / "initdb"), "-D", str(data), "-U", USER,
                              f"--pwfile={root / 'pw'}", "--auth=scram-sha-256", "-E", "UTF8",
                              "--no-sync"]), check=True, capture_output=True)
    port = _free_ports(1)[0]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            _as_owner([str(BIN / "postgres"), "-D", str(data), "-p", str(port),
                       "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={root}",
                       "-c", "fsync=off", "-c", "synchronous_commit=off",
                       "-c", "full_page_writes=off", "-c", "max_connections=200"]),
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = PgServer(port)
    try:
        _wait_ready(server, proc, time.monotonic() + 60, log_path)
        yield server
    finally:
        # fast shutdown (scratch data, no checkpoint wait), sent to the process group: as
        # root, `proc` is `runuser`, which does not pass SIGINT on to postgres
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def pg_url(pg_server: PgServer) -> Iterator[str]:
    """A fresh, empty database of its own for one test."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    pg_server.admin(f"CREATE DATABASE {name}")
    yield pg_server.url(name)
    pg_server.admin(f"DROP DATABASE {name} WITH (FORCE)")
