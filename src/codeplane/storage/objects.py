"""The object store: put/get/list/delete of keys under a local directory or `s3://bucket/prefix`.

One code path serves both: pyarrow's `LocalFileSystem` and `S3FileSystem` (the AWS SDK, with
its signing, retries and credential chain) behind a `SubTreeFileSystem` rooted at the
configured prefix, so Parquet datasets and DuckDB read through the very same filesystem object.
Credentials come from the standard `AWS_*` variables (or the SDK's other sources), never from
codeplane's settings file; an endpoint URL makes any S3-compatible store (MinIO, SeaweedFS,
Ceph) work.

Writes are atomic on both: bytes go to a staging key under `.staging/` and are moved to the
final key only once complete (a rename on disk, a server-side copy on S3), so a process killed
mid-write leaves at most an invisible staging object that `sweep_staging` removes later.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import pyarrow as pa
from pyarrow import fs as pafs

from codeplane.config import Settings

STAGING = ".staging"
DEFAULT_REGION = "us-east-1"  # what S3-compatible stores accept when none is configured


class StorageError(Exception):
    """The object store is misconfigured or unreachable; the message says which and where."""


class ObjectNotFound(StorageError):
    """No object under that key."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    mtime: float | None  # seconds since the epoch, when the store reports it


class ObjectStore:
    """Keys are `/`-separated relative paths; segments starting with `.` are reserved."""

    def __init__(self, filesystem: pafs.FileSystem, root: str, url: str,
                 storage_options: dict[str, str] | None = None) -> None:
        self.url = url
        self.filesystem = pafs.SubTreeFileSystem(root, filesystem)
        # For clients built on Rust's object_store (LanceDB) that take a URI, not a pyarrow
        # filesystem; they read the AWS_* credentials from the environment themselves.
        self.storage_options = storage_options or {}

    @classmethod
    def from_settings(cls, settings: Settings) -> ObjectStore:
        cfg = settings.storage
        return cls.open(cfg.objects or str(settings.server_dir / "objects"),
                        endpoint_url=cfg.endpoint_url, region=cfg.region)

    @classmethod
    def open(cls, url: str, *, endpoint_url: str | None = None,
             region: str | None = None) -> ObjectStore:
        """A store for a directory path or an `s3://bucket/prefix` URL."""
        if url.startswith("s3://"):
            return cls._open_s3(url, endpoint_url, region)
        if "://" in url:
            raise StorageError(f"storage.objects: unsupported URL {url!r} (a directory or "
                               "s3://bucket/prefix)")
        root = Path(url).expanduser().resolve()
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"storage.objects: cannot create {root}: {exc}") from exc
        return cls(pafs.LocalFileSystem(), str(root), str(root))

    @classmethod
    def _open_s3(cls, url: str, endpoint_url: str | None, region: str | None) -> ObjectStore:
        parsed = urlparse(url)
        bucket, prefix = parsed.netloc, parsed.path.strip("/")
        if not bucket:
            raise StorageError(f"storage.objects: {url!r} names no bucket")
        endpoint = (endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
                    or os.environ.get("AWS_ENDPOINT_URL"))
        options: dict = {"connect_timeout": 5, "request_timeout": 60}
        if endpoint:
            ep = urlparse(endpoint)
            if ep.scheme not in ("http", "https") or not ep.netloc:
                raise StorageError(f"storage.endpoint_url: {endpoint!r} is not http(s)://host")
            options |= {"endpoint_override": ep.netloc, "scheme": ep.scheme}
        options["region"] = (region or os.environ.get("AWS_REGION")
                             or os.environ.get("AWS_DEFAULT_REGION")
                             or (DEFAULT_REGION if endpoint else None))
        s3 = pafs.S3FileSystem(**{k: v for k, v in options.items() if v is not None})
        _check_bucket(s3, bucket, url)
        lance = {"aws_region": options["region"], "aws_endpoint": endpoint,
                 "allow_http": "true" if endpoint and endpoint.startswith("http:") else None}
        return cls(s3, f"{bucket}/{prefix}" if prefix else bucket, url.rstrip("/"),
                   {k: v for k, v in lance.items() if v is not None})

    def uri(self, key: str) -> str:
        """Where `key` lives for URI-based clients: `lancedb.connect(store.uri("vectors"),
        storage_options=store.storage_options)` puts LanceDB tables under the store."""
        _check_key(key)
        return f"{self.url}/{key}"

    @contextmanager
    def writer(self, key: str) -> Iterator[pa.NativeFile]:
        """A stream whose bytes appear under `key` only if the block ends without error."""
        _check_key(key)
        staging = f"{STAGING}/{uuid.uuid4().hex}"
        try:
            self._mkparent(staging)
            with self.filesystem.open_output_stream(staging) as out:
                yield out
            self._mkparent(key)
            self.filesystem.move(staging, key)
        except BaseException:
            self._discard(staging)
            raise

    def put(self, key: str, data: bytes) -> None:
        with self.writer(key) as out:
            out.write(data)

    def get(self, key: str) -> bytes:
        _check_key(key)
        try:
            with self.filesystem.open_input_stream(key) as stream:
                return stream.read()
        except FileNotFoundError as exc:
            raise ObjectNotFound(f"no object {key!r} in {self.url}") from exc
        except OSError as exc:
            raise StorageError(f"{self.url}: reading {key!r} failed: {exc}") from exc

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Complete objects whose key starts with the directory `prefix` (staging excluded)."""
        base = prefix.strip("/")
        if base:
            _check_key(base)
        return [info for info in self._entries(base) if not info.key.startswith(STAGING + "/")]

    def delete(self, key: str) -> None:
        """Remove `key`; a missing key is not an error (deletes are retried after crashes)."""
        _check_key(key)
        self._discard(key)

    def sweep_staging(self, older_than_s: float = 3600.0) -> int:
        """Remove staging objects a crashed writer left behind; returns how many."""
        cutoff = time.time() - older_than_s
        stale = [info for info in self._entries(STAGING)
                 if info.mtime is not None and info.mtime < cutoff]
        for info in stale:
            self._discard(info.key)
        return len(stale)

    def _entries(self, base: str) -> list[ObjectInfo]:
        selector = pafs.FileSelector(base, recursive=True, allow_not_found=True)
        try:
            infos = self.filesystem.get_file_info(selector)
        except OSError as exc:
            raise StorageError(f"{self.url}: listing {base or '/'} failed: {exc}") from exc
        return sorted((ObjectInfo(i.path, i.size or 0,
                                  i.mtime.timestamp() if i.mtime else None)
                       for i in infos if i.type == pafs.FileType.File), key=lambda o: o.key)

    def _mkparent(self, key: str) -> None:
        # Local directories must exist before a file or rename lands in them; on S3 this only
        # writes a directory marker, so both stores take the same path.
        parent = key.rpartition("/")[0]
        if parent:
            self.filesystem.create_dir(parent, recursive=True)

    def _discard(self, key: str) -> None:
        try:
            self.filesystem.delete_file(key)
        except FileNotFoundError:
            pass


def _check_key(key: str) -> None:
    """Refuse keys that could escape the store's root or collide with its staging area."""
    parts = key.split("/")
    if not key or "\\" in key or any(not p or p.startswith(".") for p in parts):
        raise StorageError(f"invalid object key {key!r}: relative, '/'-separated, no empty or "
                           "'.'-prefixed segments")


def _check_bucket(s3: pafs.S3FileSystem, bucket: str, url: str) -> None:
    try:
        info = s3.get_file_info(bucket)
    except OSError as exc:
        raise StorageError(f"storage.objects: cannot reach {url}: {exc}") from exc
    if info.type == pafs.FileType.NotFound:
        raise StorageError(f"storage.objects: bucket {bucket!r} of {url} does not exist "
                           "(create it first)")
