"""The server's database: SQLite embedded by default, PostgreSQL for a team, one code path.

Every durable row the server keeps (tenants' API keys and their token usage, search workspaces
with their Merkle nodes and embedding cache, background runs and their events, agent-run
records, the replicas' leases) lives here, so any number of `codeplane serve` processes on one
PostgreSQL share it. SQLAlchemy Core writes the SQL once for both dialects; Alembic owns the
schema (`storage/migrations/`), upgraded at `serve` start and by `codeplane db upgrade`.

Concurrency, the parts a second replica depends on:
- Writes run in `db.write()`: on SQLite a `BEGIN IMMEDIATE` transaction (the documented
  pysqlite recipe: the driver's own deferred BEGIN would let two writers deadlock on the lock
  upgrade), on PostgreSQL an ordinary READ COMMITTED transaction in which a conditional
  `UPDATE ... WHERE` is atomic (the row lock makes the second writer re-check the condition).
- `db.lock(name)` serialises one named piece of work across replicas (a workspace's vector
  table): a PostgreSQL advisory lock, which the server releases by itself when a replica dies
  (its connection drops); an embedded SQLite database serves one process, where a thread lock
  is the whole story.
- Migrations take the same exclusive path, so replicas starting together upgrade once.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, delete, event, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, OperationalError, ProgrammingError, SQLAlchemyError

from codeplane.config import ConfigError, Settings
from codeplane.core.procs import started_at
from codeplane.storage import tables
from codeplane.storage.modes import private_dir, private_file, private_sqlite

log = logging.getLogger("codeplane.storage")
MIGRATIONS = Path(__file__).parent / "migrations"
DEFAULT_NAME = "codeplane.db"  # under $CODEPLANE_HOME/server/


class DatabaseError(ConfigError):
    """The database is misconfigured or unreachable; the message says which and where. A
    ConfigError, so every command (and `serve` at start) reports it as one line, exit 2."""


class Database:
    """One engine (connection pool) per process; thread-safe."""

    def __init__(self, url: str) -> None:
        self.url = _driver_url(url)
        self.dialect = self.url.split(":", 1)[0].split("+", 1)[0]
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        try:
            self.engine: Engine = _engine(self.url, self.dialect)
        except (ArgumentError, SQLAlchemyError, ImportError) as exc:
            raise DatabaseError(f"storage.database: cannot use {_safe(self.url)}: {exc}") from exc

    @classmethod
    def from_settings(cls, settings: Settings, upgrade: bool = True) -> Database:
        """The configured database (default: a SQLite file under the server directory), its
        schema brought to the newest revision unless `upgrade` is False."""
        url = settings.storage.database
        if not url:
            private_dir(settings.server_dir)
            url = f"sqlite:///{settings.server_dir / DEFAULT_NAME}"
        db = cls(url)
        if upgrade:
            db.upgrade()
        return db

    @property
    def shared(self) -> bool:
        """Can several processes (hosts) use this database at once?"""
        return self.dialect == "postgresql"

    # -- transactions --------------------------------------------------------------------

    @contextmanager
    def read(self) -> Iterator[Connection]:
        """A read-only transaction (a consistent snapshot on SQLite's WAL)."""
        with self._guard(), self.engine.connect() as conn, conn.begin():
            yield conn

    @contextmanager
    def write(self) -> Iterator[Connection]:
        """A transaction that commits when the block ends, rolls back on any error."""
        with (self._guard(), self.engine.connect() as conn,
              conn.execution_options(codeplane_write=True).begin()):
            yield conn

    def insert(self, table: Any) -> Any:
        """An INSERT that offers `.on_conflict_do_nothing()` / `.on_conflict_do_update()`:
        both dialects spell upserts the same way, through their own `insert`."""
        return (postgresql.insert if self.shared else sqlite.insert)(table)

    @contextmanager
    def lock(self, name: str) -> Iterator[None]:
        """Hold `name` exclusively across every replica while the block runs."""
        with self._locks_guard:
            local = self._locks.setdefault(name, threading.Lock())
        with local:  # threads of this process queue here, not on a database connection
            if not self.shared:
                yield
                return
            key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)
            with self._guard(), self.engine.connect() as conn:
                conn.exec_driver_sql("SELECT pg_advisory_lock(%s)", (key,))
                conn.commit()
                try:
                    yield
                finally:
                    conn.exec_driver_sql("SELECT pg_advisory_unlock(%s)", (key,))
                    conn.commit()

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """Driver errors become DatabaseError naming the database (never its password)."""
        try:
            yield
        except (OperationalError, ProgrammingError) as exc:
            raise DatabaseError(f"database {_safe(self.url)}: {exc.orig}") from exc

    # -- schema --------------------------------------------------------------------------

    def upgrade(self, revision: str = "head") -> str | None:
        """Run the migrations up to `revision`; safe when several replicas start at once (they
        queue on one exclusive transaction; the later ones find nothing to do). Returns the
        revision the database is at."""
        from alembic import command
        from alembic.config import Config

        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS))
        with self._migration_lock(), self.write() as conn:
            if self.shared:  # the schema itself is the shared resource here
                conn.exec_driver_sql("SELECT pg_advisory_xact_lock(4242171)")
            config.attributes["connection"] = conn
            command.upgrade(config, revision)
            return self._revision(conn)

    def revision(self) -> str | None:
        with self.read() as conn:
            return self._revision(conn)

    @staticmethod
    def _revision(conn: Connection) -> str | None:
        from alembic.migration import MigrationContext

        return MigrationContext.configure(conn).get_current_revision()

    @contextmanager
    def _migration_lock(self) -> Iterator[None]:
        """SQLite: a file lock next to the database, so the DDL of two processes starting
        together never interleaves (BEGIN IMMEDIATE covers DML; Alembic's version check
        happens before it writes)."""
        path = self.engine.url.database
        if self.shared or not path or path == ":memory:":
            yield
            return
        with private_file(Path(f"{path}.migrate.lock")).open("a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            yield

    def close(self) -> None:
        self.engine.dispose()


class Replica:
    """This process's lease in the shared database: a row whose heartbeat it renews. Work
    owned by a replica whose heartbeat is older than `lease_s` (killed, frozen, partitioned)
    is taken over by whichever replica notices first: `sweep` callbacks run after every
    heartbeat."""

    def __init__(self, db: Database, lease_s: float) -> None:
        self.db, self.lease_s = db, lease_s
        self.id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.sweeps: list[Callable[[], object]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        now = time.time()
        with db.write() as conn:
            conn.execute(tables.replicas.insert().values(
                id=self.id, host=socket.gethostname(), pid=os.getpid(), started=now,
                heartbeat=now))

    def live_ids(self) -> Any:
        """A subquery of replicas whose lease holds now (use as `owner.in_(...)`)."""
        return select(tables.replicas.c.id).where(
            tables.replicas.c.heartbeat >= time.time() - self.lease_s)

    def start(self) -> None:
        """Renew the lease every third of its length, on a daemon thread."""
        self._thread = threading.Thread(target=self._beat, name="replica-heartbeat",
                                        daemon=True)
        self._thread.start()

    def beat(self) -> None:
        """Renew the lease once, then let each sweep take over what dead replicas left."""
        now = time.time()
        with self.db.write() as conn:
            conn.execute(update(tables.replicas).where(tables.replicas.c.id == self.id)
                         .values(heartbeat=now))
            # A replica on this host whose process is gone is dead now, not in `lease_s`: a
            # laptop server restarted after a crash must not show the old runs as running.
            here = conn.execute(select(tables.replicas.c.id, tables.replicas.c.pid,
                                       tables.replicas.c.started).where(
                tables.replicas.c.host == socket.gethostname())).all()
            gone = [row.id for row in here if not _running_since(row.pid, row.started)]
            if gone:
                conn.execute(delete(tables.replicas).where(tables.replicas.c.id.in_(gone)))
            # Long-dead leases are only history: what they owned counts as orphaned either way.
            conn.execute(delete(tables.replicas).where(
                tables.replicas.c.heartbeat < now - 10 * self.lease_s))
        for sweep in self.sweeps:
            try:
                sweep()
            except (DatabaseError, SQLAlchemyError):  # the next beat tries again
                log.exception("sweep after heartbeat failed")

    def _beat(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                self.beat()
            except (DatabaseError, SQLAlchemyError):
                log.exception("replica heartbeat failed; retrying")

    def close(self) -> None:
        """Give the lease up: what this replica still owned is anyone's to clean up."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        try:
            with self.db.write() as conn:
                conn.execute(delete(tables.replicas).where(tables.replicas.c.id == self.id))
        except DatabaseError as exc:
            log.error("replica lease not released: %s", exc)


def _running_since(pid: int, started: float) -> bool:
    """Is `pid` a live process that was already running at `started` (wall clock)? A pid
    reused by a later process is not the replica that registered it."""
    began = started_at(pid)
    if began is None:
        return pid == os.getpid()  # gone, or no /proc: only this process is known alive
    return began <= started + 1.0


def _driver_url(url: str) -> str:
    """`postgresql://` means psycopg 3 (SQLAlchemy's bare default is the older psycopg2)."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    if not url.startswith(("sqlite://", "postgresql+psycopg://")):
        raise DatabaseError(f"storage.database: unsupported URL {_safe(url)!r} (sqlite:///PATH "
                            "or postgresql://USER@HOST:PORT/DB)")
    return url


def _engine(url: str, dialect: str) -> Engine:
    if dialect == "postgresql":
        # pre_ping: a pooled connection the server dropped (restart, failover) is replaced
        # instead of failing the request that drew it.
        return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)
    path = make_url(url).database
    if path and path != ":memory:":
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        private_sqlite(Path(path))
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves (below)
        dbapi_conn.execute("PRAGMA journal_mode=WAL")
        dbapi_conn.execute("PRAGMA synchronous=NORMAL")  # WAL: durable at checkpoints, fast

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        write = conn.get_execution_options().get("codeplane_write")
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


def _safe(url: str) -> str:
    """The URL without its password, for messages and logs."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "<unparseable URL>"
