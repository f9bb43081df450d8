"""Client-held workspace keys and everything derived from them.

One 32-byte master key per workspace, stored only under `$CODEPLANE_HOME/client/` (mode 0600).
Teammates who share the key file get matching encrypted paths and share the server's embedding
cache. Sub-keys (HKDF) separate duties so the server only ever sees what it needs:

- `path_key` (AES-SIV, never leaves the client): deterministic authenticated encryption of each
  path segment, so equal paths give equal ciphertexts and prefix filters still work.
- `mac_key` (never leaves the client): HMACs for Merkle leaves, chunk ids and cache keys, so the
  server cannot confirm a guessed file content by hashing it.
- `server_key` (sent in each request, kept only in server memory): seeds the orthogonal rotation
  the server applies to the vectors it embeds (server-side mode) and authenticates the workspace.
- `rotation_key` (never leaves the client): seeds the rotation in client-side embedding mode, so
  there the server cannot undo the rotation it stores.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from pathlib import Path

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESSIV
from cryptography.hazmat.primitives.kdf.hkdf import HKDF


class KeyFileError(Exception):
    """The key file is missing or malformed."""


def _hkdf(master: bytes, info: str, length: int) -> bytes:
    return HKDF(hashes.SHA256(), length, salt=None, info=info.encode()).derive(master)


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class WorkspaceKeys:
    def __init__(self, master: bytes) -> None:
        self.path_key = _hkdf(master, "codeplane/path", 64)
        self.mac_key = _hkdf(master, "codeplane/mac", 32)
        self.server_key = b64(_hkdf(master, "codeplane/server", 32))
        self.rotation_key = b64(_hkdf(master, "codeplane/rotation", 32))

    def mac(self, *parts: bytes | str) -> str:
        msg = b"\0".join(p.encode() if isinstance(p, str) else p for p in parts)
        return hmac.new(self.mac_key, msg, hashlib.sha256).hexdigest()[:32]


class PathCipher:
    """Encrypt a workspace-relative POSIX path segment by segment (AES-SIV, no nonce: the same
    segment always maps to the same token, which is what lets the server match paths and
    prefixes; it leaks only the directory shape and segment equality)."""

    def __init__(self, keys: WorkspaceKeys) -> None:
        self._siv = AESSIV(keys.path_key)
        self._enc: dict[str, str] = {}
        self._dec: dict[str, str] = {}

    def segment(self, name: str) -> str:
        token = self._enc.get(name)
        if token is None:
            token = b64(self._siv.encrypt(name.encode(), None))
            self._enc[name], self._dec[token] = token, name
        return token

    def encrypt(self, rel: str) -> str:
        return "/".join(self.segment(s) for s in rel.split("/")) if rel else ""

    def decrypt(self, enc: str) -> str:
        """Raise cryptography.exceptions.InvalidTag on a token not made with this key."""
        out = []
        for token in enc.split("/"):
            name = self._dec.get(token)
            if name is None:
                name = self._siv.decrypt(unb64(token), None).decode()
                self._dec[token] = name
            out.append(name)
        return "/".join(out)


def load_or_create(path: Path) -> WorkspaceKeys:
    if path.is_file():
        raw = path.read_text().strip()
        try:
            master = unb64(raw)
        except ValueError as exc:
            raise KeyFileError(f"{path}: not a codeplane workspace key") from exc
        if len(master) != 32:
            raise KeyFileError(f"{path}: a workspace key is 32 bytes (43 base64 characters)")
        return WorkspaceKeys(master)
    path.parent.mkdir(parents=True, exist_ok=True)
    master = secrets.token_bytes(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(b64(master) + "\n")
    return WorkspaceKeys(master)
