"""Server-issued API keys, stored hashed in `$CODEPLANE_HOME/server/keys.json`.

Keys are 256-bit random tokens, so a plain SHA-256 is enough to make a stolen file useless
(slow password hashes exist for guessable secrets). The CLI writes the file; a running server
notices changes by mtime, so `codeplane keys create/revoke` take effect without a restart.
Token usage (for `budget_tokens`) is kept apart in `key_usage.json`, written only by the
server, so the CLI and the server never race on one file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from codeplane.config import ConfigError
from codeplane.gateway.config import PRIORITIES

log = logging.getLogger("codeplane.gateway")

PREFIX = "cp-"
# Tenants name what a key may see (workspaces, runs); compartments may use them in file names.
TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


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
    tenant: str = ""  # empty in keys.json written before tenants: the key's own name

    def __post_init__(self) -> None:
        self.tenant = self.tenant or self.name


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class KeyStore:
    def __init__(self, server_dir: Path) -> None:
        self.file = server_dir / "keys.json"
        self.usage_file = server_dir / "key_usage.json"
        self._keys: dict[str, ApiKey] = {}  # by hash
        self._mtime: float | None = None
        self._checked = 0.0
        self.usage: dict[str, int] = self._read(self.usage_file)
        self.held: dict[str, int] = {}  # tokens reserved by calls in flight, by key id
        self._dirty = False
        self._flushed = time.monotonic()

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
        if any(k.name == name and not k.revoked for k in self.all()):
            raise ValueError(f"an active key named {name!r} exists; revoke it first")
        secret = PREFIX + secrets.token_urlsafe(32)
        key = ApiKey(id=secrets.token_hex(4), name=name, hash=digest(secret),
                     hint=secret[:7], created=time.time(), rpm=rpm, tpm=tpm,
                     budget_tokens=budget_tokens, priority=priority, tenant=tenant)
        self._save([*self.all(), key])
        return key, secret

    def revoke(self, name_or_id: str) -> ApiKey:
        keys = self.all()
        for key in keys:
            if name_or_id in (key.name, key.id) and not key.revoked:
                key.revoked = True
                self._save(keys)
                return key
        raise KeyError(name_or_id)

    def all(self) -> list[ApiKey]:
        try:
            return [ApiKey(**entry) for entry in self._read(self.file).get("keys", [])]
        except (TypeError, AttributeError) as exc:
            raise ConfigError(f"{self.file}: not a key list ({exc})") from None

    def active(self) -> list[ApiKey]:
        return [k for k in self.all() if not k.revoked]

    def _save(self, keys: list[ApiKey]) -> None:
        _write(self.file, {"keys": [asdict(k) for k in keys]})

    # -- server side ---------------------------------------------------------------------

    def lookup(self, secret: str) -> ApiKey | None:
        self._reload()
        key = self._keys.get(digest(secret))
        return key if key and not key.revoked else None

    def has_active(self) -> bool:
        """Any unrevoked key (cheap: re-reads the file at most once a second)."""
        self._reload()
        return any(not k.revoked for k in self._keys.values())

    def by_id(self, key_id: str) -> ApiKey | None:
        """The active key with this id (the auth gate's principal names keys by id)."""
        self._reload()
        return next((k for k in self._keys.values() if k.id == key_id and not k.revoked), None)

    def _reload(self) -> None:
        now = time.monotonic()
        if now - self._checked < 1.0:  # stat at most once a second
            return
        self._checked = now
        try:
            mtime = self.file.stat().st_mtime
        except FileNotFoundError:
            mtime = None
        if mtime != self._mtime:
            self._mtime = mtime
            try:
                self._keys = {k.hash: k for k in self.all()}
            except ConfigError as exc:  # hand-edited and broken: fail closed, keep serving
                log.error("%s; every API key is refused until it is fixed", exc)
                self._keys = {}

    def used(self, key: ApiKey) -> int:
        return self.usage.get(key.id, 0)

    def reserve(self, key: ApiKey, tokens: int) -> bool:
        """Hold `tokens` of the key's budget for a call about to start; False (nothing held)
        if used + held + tokens would pass the budget. Holding before the call is what stops
        N concurrent requests from each seeing the same unspent budget."""
        if key.budget_tokens is not None and (
                self.used(key) + self.held.get(key.id, 0) + tokens > key.budget_tokens):
            return False
        self.held[key.id] = self.held.get(key.id, 0) + tokens
        return True

    def settle(self, key: ApiKey, held: int, used: int) -> None:
        """Replace a reservation by what the call really used."""
        left = self.held.get(key.id, 0) - held
        if left > 0:
            self.held[key.id] = left
        else:
            self.held.pop(key.id, None)
        self.charge(key, used)

    def charge(self, key: ApiKey, tokens: int) -> None:
        if tokens:
            self.usage[key.id] = self.usage.get(key.id, 0) + tokens
            self._dirty = True
            if time.monotonic() - self._flushed > 10:  # a crash loses at most 10 s of usage
                self.flush()

    def flush(self) -> None:
        if self._dirty:
            self._dirty = False
            self._flushed = time.monotonic()
            _write(self.usage_file, self.usage)

    @staticmethod
    def _read(path: Path) -> dict:
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except ValueError as exc:
            raise ConfigError(f"{path} is not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path} does not hold a JSON object")
        return data


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh, indent=2)
    tmp.replace(path)
