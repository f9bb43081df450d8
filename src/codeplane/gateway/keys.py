"""Server-issued API keys and their token usage, in the server database (`storage/`).

Keys are 256-bit random tokens, so a plain SHA-256 is enough to make a stolen database useless
(slow password hashes exist for guessable secrets). `codeplane keys create/revoke` write the
database; every replica sees a new key at once (a lookup that misses its snapshot asks the
database) and a revocation within a second (the snapshot is re-read at most once a second).

Budgets and tokens-per-minute hold across replicas: a call reserves its likely cost with one
conditional UPDATE of the key's usage row (`used + held + tokens <= budget`) and of its row for
its token bucket (`level after refill >= n`), which the database applies
atomically, so N replicas serving N concurrent calls can never each spend the same tokens. Each
reservation is also a `key_holds` row naming its replica: the tokens a killed replica held are
given back by whichever replica notices its lease expired (`release_dead`). Keys without a
budget need no such check: their usage is summed in memory and written every 10 seconds.

The web UI signs in with a key and then holds a session (`open_session`): a random token
for the browser's cookie, stored as its SHA-256 with the key's id and an expiry, so the cookie
is never the key, a sign-out deletes it, and revoking the key ends every session it had.

A `keys.json` (+ `key_usage.json`) from before the database is imported once and renamed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import delete, select, update
from sqlalchemy.engine import Connection

from codeplane.config import ConfigError, Settings
from codeplane.config.gateway import PRIORITIES
from codeplane.gateway.admission import SharedBuckets
from codeplane.storage.database import Database, DatabaseError, Replica
from codeplane.storage.tables import api_keys, key_holds, key_rate, key_usage, ui_sessions

if TYPE_CHECKING:
    from sqlalchemy.engine import Row

log = logging.getLogger("codeplane.gateway")

PREFIX = "cp-"
# Tenants name what a key may see (workspaces, runs); compartments may use them in file names.
TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
SNAPSHOT_S = 1.0  # how stale a replica's view of revocations may be
FLUSH_S = 10.0  # unbudgeted usage: a crash loses at most this much of it


@dataclass
class ApiKey:
    id: str
    name: str
    hash: str
    hint: str  # first characters, to recognise a key in listings
    created: float
    rpm: int | None = None
    tpm: int | None = None
    budget_tokens: int | None = None
    priority: str = "agent"
    revoked: bool = False
    tenant: str = ""  # empty in a keys.json written before tenants: the key's own name

    def __post_init__(self) -> None:
        self.tenant = self.tenant or self.name

    @classmethod
    def from_row(cls, row: Row) -> ApiKey:
        return cls(**{f.name: getattr(row, f.name) for f in fields(cls)})


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class KeyStore:
    """The keys of one server database. `replica` is set in a serving process (budget holds
    name it); the CLI's store has none and never reserves."""

    def __init__(self, db: Database, replica: Replica | None = None) -> None:
        self.db, self.replica = db, replica
        self.rate = SharedBuckets(db, key_rate, key_rate.c.key_id)  # tokens per minute
        self._keys: dict[str, ApiKey] = {}  # by hash: this replica's snapshot
        self._loaded = float("-inf")
        self._lock = threading.Lock()
        self._unflushed: dict[str, int] = {}  # unbudgeted usage not yet written, by key id
        self._flushed = time.monotonic()

    @classmethod
    def from_settings(cls, settings: Settings, replica: Replica | None = None) -> KeyStore:
        """The configured database's key store, with any legacy `keys.json` imported."""
        store = cls(replica.db if replica else Database.from_settings(settings), replica)
        store.import_json(settings.server_dir)
        return store

    # -- CLI side ------------------------------------------------------------------------

    def create(self, name: str, rpm: int | None = None, tpm: int | None = None,
               budget_tokens: int | None = None, priority: str = "agent",
               tenant: str | None = None) -> tuple[ApiKey, str]:
        """A new key; its tenant defaults to its name, so keys share nothing unless the
        operator puts them in one tenant on purpose."""
        if priority not in PRIORITIES:
            raise ValueError(f"unknown priority {priority!r}; use {', '.join(PRIORITIES)}")
        tenant = tenant or name
        if not TENANT.match(tenant):
            raise ValueError(f"tenant {tenant!r} must be 1-64 letters, digits, '.', '_' or "
                             "'-', starting with a letter or digit")
        secret = PREFIX + secrets.token_urlsafe(32)
        key = ApiKey(id=secrets.token_hex(4), name=name, hash=digest(secret),
                     hint=secret[:7], created=time.time(), rpm=rpm, tpm=tpm,
                     budget_tokens=budget_tokens, priority=priority, tenant=tenant)
        with self.db.lock(f"keys:{name}"), self.db.write() as conn:
            if conn.execute(select(api_keys.c.id).where(
                    api_keys.c.name == name, api_keys.c.revoked.is_(False))).first():
                raise ValueError(f"an active key named {name!r} exists; revoke it first")
            _insert(conn, [key], {})
        return key, secret

    def revoke(self, name_or_id: str) -> ApiKey:
        with self.db.write() as conn:
            row = conn.execute(select(api_keys).where(
                (api_keys.c.name == name_or_id) | (api_keys.c.id == name_or_id),
                api_keys.c.revoked.is_(False)).limit(1)).first()
            if row is None:
                raise KeyError(name_or_id)
            conn.execute(update(api_keys).where(api_keys.c.id == row.id).values(revoked=True))
            conn.execute(delete(ui_sessions).where(ui_sessions.c.key_id == row.id))
        key = ApiKey.from_row(row)
        key.revoked = True
        return key

    def all(self) -> list[ApiKey]:
        with self.db.read() as conn:
            rows = conn.execute(select(api_keys).order_by(api_keys.c.created)).all()
        return [ApiKey.from_row(row) for row in rows]

    def active(self) -> list[ApiKey]:
        return [k for k in self.all() if not k.revoked]

    def import_json(self, server_dir: Path) -> int:
        """Move keys from a `keys.json` (and their usage from `key_usage.json`) into the
        database once; the files are renamed `*.imported`. Returns how many keys came in."""
        source = server_dir / "keys.json"
        if not source.is_file():
            return 0
        usage_file = server_dir / "key_usage.json"
        try:
            data = json.loads(source.read_text())
            usage = json.loads(usage_file.read_text()) if usage_file.is_file() else {}
        except ValueError as exc:  # refuse to start rather than lose keys silently
            raise ConfigError(f"{source} is not valid JSON ({exc}); fix it or remove it") from None
        try:
            keys = [ApiKey(**entry) for entry in data["keys"]]
        except (TypeError, KeyError) as exc:
            raise ConfigError(f"{source}: not a key list ({exc}); fix it or remove it") from None
        with self.db.lock("keys:import"), self.db.write() as conn:
            added = _insert(conn, keys, usage)
        for path in (source, usage_file):
            if path.is_file():
                path.replace(path.with_name(path.name + ".imported"))
        log.info("imported %d API keys from %s into the database", added, source)
        return added

    # -- server side ---------------------------------------------------------------------

    def lookup(self, secret: str) -> ApiKey | None:
        """The active key with this secret. A key missing from the snapshot is looked up in
        the database itself, so one created on another replica works at once. An unreadable
        database refuses every key (fail closed), never a 500."""
        return self._find(api_keys.c.hash, digest(secret))

    def open_session(self, key: ApiKey, ttl_s: float) -> str:
        """A new web-UI session for `key`, valid for `ttl_s` seconds: its token, which only
        the browser's cookie holds. Expired sessions are dropped on the way."""
        token, now = secrets.token_urlsafe(32), time.time()
        with self.db.write() as conn:
            conn.execute(delete(ui_sessions).where(ui_sessions.c.expires <= now))
            conn.execute(ui_sessions.insert().values(id=digest(token), key_id=key.id,
                                                     created=now, expires=now + ttl_s))
        return token

    def session_key(self, token: str) -> ApiKey | None:
        """The active key a live session acts for; None for an unknown or expired session,
        or one whose key was revoked (and, like `lookup`, when the database is unreadable)."""
        try:
            with self.db.read() as conn:
                key_id = conn.scalar(select(ui_sessions.c.key_id).where(
                    ui_sessions.c.id == digest(token), ui_sessions.c.expires > time.time()))
        except DatabaseError as exc:
            log.error("UI sessions unreadable, every session is refused: %s", exc)
            return None
        return self.by_id(key_id) if key_id else None

    def close_session(self, token: str) -> None:
        with self.db.write() as conn:
            conn.execute(delete(ui_sessions).where(ui_sessions.c.id == digest(token)))

    def has_active(self) -> bool:
        """Any unrevoked key (from the snapshot: at most one query a second); True when the
        database cannot say, so nobody is let in anonymously for want of an answer."""
        try:
            return any(not k.revoked for k in self._snapshot().values())
        except DatabaseError:
            return True

    def by_id(self, key_id: str) -> ApiKey | None:
        """The active key with this id (the auth gate's principal names keys by id)."""
        return self._find(api_keys.c.id, key_id)

    def _find(self, column, value: str) -> ApiKey | None:
        try:
            key = next((k for k in self._snapshot().values()
                        if getattr(k, column.name) == value), None)
            if key is None:
                with self.db.read() as conn:
                    row = conn.execute(select(api_keys).where(column == value)).first()
                key = ApiKey.from_row(row) if row else None
        except DatabaseError as exc:
            log.error("API keys unreadable, every key is refused: %s", exc)
            return None
        return key if key and not key.revoked else None

    def _snapshot(self) -> dict[str, ApiKey]:
        now = time.monotonic()
        with self._lock:
            if now - self._loaded >= SNAPSHOT_S:
                self._keys = {k.hash: k for k in self.all()}
                self._loaded = now
            return self._keys

    def used(self, key: ApiKey) -> int:
        with self.db.read() as conn:
            used = conn.scalar(select(key_usage.c.used).where(key_usage.c.key_id == key.id))
        return (used or 0) + self._unflushed.get(key.id, 0)

    def held(self, key: ApiKey) -> int:
        """Tokens reserved by calls in flight on every replica."""
        with self.db.read() as conn:
            return conn.scalar(select(key_usage.c.held).where(
                key_usage.c.key_id == key.id)) or 0

    def reserve(self, key: ApiKey, tokens: int) -> bool:
        """Hold `tokens` of the key's budget for a call about to start; False (nothing held)
        if used + held + tokens would pass the budget. One conditional UPDATE: the database
        decides, so concurrent calls on any number of replicas cannot overspend."""
        if key.budget_tokens is None:
            return True
        with self.db.write() as conn:
            won = conn.execute(update(key_usage).where(
                key_usage.c.key_id == key.id,
                key_usage.c.used + key_usage.c.held + tokens <= key.budget_tokens,
            ).values(held=key_usage.c.held + tokens)).rowcount == 1
            if won:
                conn.execute(key_holds.insert().values(
                    id=uuid.uuid4().hex, key_id=key.id, tokens=tokens, replica=self._replica_id))
        return won

    def take_rate(self, key: ApiKey, tokens: int, now: float | None = None) -> float:
        """Take `tokens` from the key's tokens-per-minute bucket: 0.0 if taken, else the
        seconds until they will be there (nothing taken); one bucket for every replica
        (`admission.SharedBuckets`)."""
        return self.rate.take(key.id, key.tpm, tokens, now) if key.tpm else 0.0

    def adjust_rate(self, key: ApiKey, tokens: int, now: float | None = None) -> None:
        """Spend `tokens` more of the bucket (negative: give back what a call that did not
        run, or used less than it took, held), never above a minute's worth."""
        if key.tpm:
            self.rate.spend(key.id, key.tpm, tokens, now)

    def settle(self, key: ApiKey, held: int, used: int) -> None:
        """Replace a reservation by what the call really used (budget and this minute)."""
        self.adjust_rate(key, used - held)
        if key.budget_tokens is None:
            self.charge(key, used)
            return
        with self.db.write() as conn:
            hold = conn.execute(select(key_holds.c.id).where(
                key_holds.c.key_id == key.id, key_holds.c.replica == self._replica_id,
                key_holds.c.tokens == held).limit(1)).scalar()
            released = hold is not None and conn.execute(
                delete(key_holds).where(key_holds.c.id == hold)).rowcount == 1
            conn.execute(update(key_usage).where(key_usage.c.key_id == key.id).values(
                held=key_usage.c.held - (held if released else 0),
                used=key_usage.c.used + used))

    def charge(self, key: ApiKey, tokens: int) -> None:
        """Count tokens of an unbudgeted key; written with the next flush."""
        if tokens:
            with self._lock:
                self._unflushed[key.id] = self._unflushed.get(key.id, 0) + tokens
            if time.monotonic() - self._flushed > FLUSH_S:
                self.flush()

    def flush(self) -> None:
        with self._lock:
            pending, self._unflushed = self._unflushed, {}
            self._flushed = time.monotonic()
        if pending:
            with self.db.write() as conn:
                for key_id, tokens in pending.items():
                    conn.execute(update(key_usage).where(key_usage.c.key_id == key_id)
                                 .values(used=key_usage.c.used + tokens))

    def release_dead(self) -> int:
        """Give back the budget tokens held by replicas whose lease expired (their calls died
        with them); each hold is released once, whoever runs this. Returns how many."""
        if self.replica is None:
            return 0
        with self.db.read() as conn:
            holds = conn.execute(select(key_holds).where(
                key_holds.c.replica.not_in(self.replica.live_ids()))).all()
        released = 0
        for hold in holds:
            with self.db.write() as conn:
                if conn.execute(delete(key_holds).where(key_holds.c.id == hold.id)).rowcount:
                    conn.execute(update(key_usage).where(key_usage.c.key_id == hold.key_id)
                                 .values(held=key_usage.c.held - hold.tokens))
                    released += 1
        return released

    @property
    def _replica_id(self) -> str:
        return self.replica.id if self.replica else "cli"


def _insert(conn: Connection, keys: Iterable[ApiKey], usage: dict[str, int]) -> int:
    """Add keys (and their usage rows) that are not stored yet; returns how many were new."""
    added = 0
    for key in keys:
        exists = conn.execute(select(api_keys.c.id).where(
            (api_keys.c.id == key.id) | (api_keys.c.hash == key.hash))).first()
        if exists:
            continue
        conn.execute(api_keys.insert().values(
            **{f.name: getattr(key, f.name) for f in fields(ApiKey)}))
        conn.execute(key_usage.insert().values(key_id=key.id, used=int(usage.get(key.id, 0)),
                                               held=0))
        added += 1
    return added
