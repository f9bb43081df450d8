"""Server side of private search: per-workspace vector namespaces that hold no source code.

What the server persists (all under `$CODEPLANE_HOME/server/search/`, or an `s3://` LanceDB URI):
- LanceDB table `ws_<id>`: rotated vector, encrypted path, line range, HMAC'd chunk id.
- `meta.sqlite`: workspace -> key verifier, the Merkle nodes (encrypted path, HMAC hash) and the
  embedding cache (HMAC(workspace key, chunk hash) -> rotated vector).

Chunk text arrives only in upload requests, is embedded, and is dropped. Vectors are stored
multiplied by an orthogonal matrix derived from the client's server key (cosine-preserving), so
the stored vectors cannot be compared with any model's output without that key; the key itself
arrives in each request header and is held only in process memory (`_rotations`).
"""

from __future__ import annotations

import hashlib
import logging
import re
import sqlite3
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from codeplane.config import Settings
from codeplane.search.embed import Embedder, embedder_from_config

log = logging.getLogger("codeplane.search")
ENC_PATH = re.compile(r"^[A-Za-z0-9_\-/]*$")  # base64url segments joined by '/'
TOKEN = re.compile(r"^[A-Za-z0-9_\-]{1,128}$")
DEFAULT_ANN_MIN_ROWS = 20_000


class SearchError(Exception):
    status = 400


class Forbidden(SearchError):
    status = 403


class NotFound(SearchError):
    status = 404


class CacheMiss(SearchError):
    status = 409

    def __init__(self, missing: list[str]) -> None:
        super().__init__(f"{len(missing)} chunks are not in the embedding cache; send their text")
        self.missing = missing


@dataclass
class UploadChunk:
    id: str
    key: str
    start: int
    end: int
    text: str | None = None


def key_id(server_key: str) -> str:
    return hashlib.sha256(b"codeplane-key-id\0" + server_key.encode()).hexdigest()[:32]


def rotation(server_key: str, dim: int) -> np.ndarray:
    """A random orthogonal matrix seeded by the key (QR of a Gaussian, signs fixed so it is
    unique)."""
    seed = int.from_bytes(hashlib.sha256(b"codeplane-rotation\0" + server_key.encode())
                          .digest(), "big")
    gauss = np.random.default_rng(seed).standard_normal((dim, dim))
    q, r = np.linalg.qr(gauss)
    return (q * np.sign(np.diag(r))).astype(np.float32)


def _check_path(path: str) -> str:
    if not ENC_PATH.match(path) or len(path) > 4096:
        raise SearchError("paths must be encrypted tokens joined by '/'")
    return path


def _ancestors(path: str) -> list[str]:
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(len(parts))]


def _parent(path: str) -> str | None:
    return None if path == "" else (path.rsplit("/", 1)[0] if "/" in path else "")


class SearchService:
    """One per server process; thread-safe (FastAPI runs sync routes on a thread pool)."""

    def __init__(self, settings: Settings, embedder: Embedder | None = None) -> None:
        import lancedb

        cfg = settings.indexing
        root = settings.server_dir / "search"
        root.mkdir(parents=True, exist_ok=True)
        self.config = cfg
        self._embedder = embedder
        self.ann_min_rows = int(cfg.get("ann_min_rows", DEFAULT_ANN_MIN_ROWS))
        self.db = lancedb.connect(str(cfg.get("lancedb_uri") or root / "lancedb"))
        self.meta = sqlite3.connect(root / "meta.sqlite", check_same_thread=False,
                                    isolation_level=None)
        self.meta.executescript(SCHEMA)
        self._lock = threading.RLock()  # sqlite connection + table handles
        self._ws_locks: dict[str, threading.Lock] = {}
        self._rotations: OrderedDict[str, np.ndarray] = OrderedDict()
        self._tables: dict[str, object] = {}
        self._indexer = ThreadPoolExecutor(1, thread_name_prefix="ann-index")
        self._indexing: set[str] = set()

    @property
    def embedder(self) -> Embedder:
        if self._embedder is None:
            self._embedder = embedder_from_config(self.config)
        return self._embedder

    # -- auth -------------------------------------------------------------------------------
    def open_workspace(self, ws: str, server_key: str) -> dict:
        """Create the workspace bound to this key, or check the key of an existing one."""
        self._check_ws(ws)
        kid = key_id(server_key)
        with self._lock:
            row = self.meta.execute("SELECT key_id FROM workspaces WHERE ws=?", (ws,)).fetchone()
            if row is None:
                self.meta.execute("INSERT INTO workspaces VALUES (?,?,?,?)",
                                  (ws, kid, self.embedder.name, time.time()))
            elif row[0] != kid:
                raise Forbidden("this key does not open that workspace")
        return self.status(ws, server_key)

    def _auth(self, ws: str, server_key: str) -> str:
        self._check_ws(ws)
        with self._lock:
            row = self.meta.execute("SELECT key_id FROM workspaces WHERE ws=?", (ws,)).fetchone()
        if row is None:
            raise NotFound(f"workspace {ws} is not indexed on this server")
        if row[0] != key_id(server_key):
            raise Forbidden("this key does not open that workspace")
        return row[0]

    @staticmethod
    def _check_ws(ws: str) -> None:
        if not TOKEN.match(ws):
            raise SearchError("workspace ids are 1-128 characters of [A-Za-z0-9_-]")

    def _rotation(self, server_key: str) -> np.ndarray:
        kid = key_id(server_key)
        with self._lock:
            if kid not in self._rotations:
                self._rotations[kid] = rotation(server_key, self.embedder.dim)
                while len(self._rotations) > 64:
                    self._rotations.popitem(last=False)
            self._rotations.move_to_end(kid)
            return self._rotations[kid]

    # -- Merkle sync -----------------------------------------------------------------------
    def tree(self, ws: str, server_key: str, paths: list[str]) -> dict:
        """Each requested node's hash and its children's (name -> [hash, is_dir])."""
        self._auth(ws, server_key)
        out = {}
        with self._lock:
            for path in paths[:1000]:
                _check_path(path)
                own = self.meta.execute("SELECT hash FROM nodes WHERE ws=? AND path=?",
                                        (ws, path)).fetchone()
                kids = self.meta.execute(
                    "SELECT path, hash, is_dir FROM nodes WHERE ws=? AND parent=?", (ws, path))
                out[path] = {"hash": own[0] if own else None,
                             "children": {p.rsplit("/", 1)[-1]: [h, bool(d)] for p, h, d in kids}}
        return out

    def commit(self, ws: str, server_key: str, nodes: list[dict]) -> int:
        """Record directory hashes once everything under them is stored."""
        self._auth(ws, server_key)
        rows = [(ws, _check_path(n["path"]), _parent(n["path"]), str(n["hash"]), 1)
                for n in nodes]
        with self._lock:
            self.meta.execute("BEGIN")
            self.meta.executemany("INSERT OR REPLACE INTO nodes VALUES (?,?,?,?,?)", rows)
            self.meta.execute("COMMIT")
        return len(rows)

    def delete(self, ws: str, server_key: str, paths: list[str]) -> int:
        """Drop files or whole directories (by encrypted path) with their vectors."""
        self._auth(ws, server_key)
        for path in paths:
            _check_path(path)
            if not path:
                raise SearchError("refusing to delete the workspace root; delete the workspace")
        with self._ws_lock(ws):
            table = self._table(ws, create=False)
            for batch in _batched(paths, 200):
                if table is not None:
                    table.delete(_path_filter(batch))
                with self._lock:
                    self.meta.execute("BEGIN")
                    for path in batch:
                        self.meta.execute(
                            "DELETE FROM nodes WHERE ws=? AND (path=? OR substr(path,1,?)=?)",
                            (ws, path, len(path) + 1, path + "/"))
                    self.meta.execute("COMMIT")
        return len(paths)

    # -- upload ----------------------------------------------------------------------------
    def missing(self, ws: str, server_key: str, keys: list[str]) -> list[str]:
        kid = self._auth(ws, server_key)
        with self._lock:
            found = set()
            for batch in _batched(keys, 500):
                marks = ",".join("?" * len(batch))
                found |= {k for (k,) in self.meta.execute(
                    f"SELECT ckey FROM cache WHERE key_id=? AND ckey IN ({marks})",
                    (kid, *batch))}
        return [k for k in dict.fromkeys(keys) if k not in found]

    def upload(self, ws: str, server_key: str, files: list[dict]) -> dict:
        """Replace the vectors of each file, then record its Merkle leaf.

        The leaf is written last, so a client killed mid-sync leaves the file looking unsynced
        and the next run re-sends it: the server never claims a file it did not finish."""
        kid = self._auth(ws, server_key)
        chunks = {p["path"]: [UploadChunk(**c) for c in p.get("chunks", [])] for p in files}
        for path in chunks:
            _check_path(path)
        vectors, embedded = self._vectors(kid, server_key, [c for cs in chunks.values() for c in cs])
        rows = [(path, c) for path, cs in chunks.items() for c in cs]
        with self._ws_lock(ws):
            table = self._table(ws, create=True)
            for batch in _batched(list(chunks), 500):
                table.delete("path IN ({})".format(",".join(f"'{p}'" for p in batch)))
            if rows:
                table.add(_arrow_rows(rows, vectors, self.embedder.dim))
            # Ancestors appear as placeholder directories (hash "" never matches), so a later
            # sync descends to these leaves even if this one dies before its commit.
            ancestors = {a for f in files for a in _ancestors(f["path"])}
            with self._lock:
                self.meta.execute("BEGIN")
                self.meta.executemany("INSERT OR IGNORE INTO nodes VALUES (?,?,?,'',1)",
                                      [(ws, a, _parent(a)) for a in ancestors])
                self.meta.executemany(
                    "INSERT OR REPLACE INTO nodes VALUES (?,?,?,?,0)",
                    [(ws, f["path"], _parent(f["path"]), str(f["leaf"])) for f in files])
                self.meta.execute("COMMIT")
        self._maybe_build_ann(ws)
        return {"embedded": embedded, "reused": len(rows) - embedded, "stored": len(rows)}

    def _vectors(self, kid: str, server_key: str, chunks: list[UploadChunk]
                 ) -> tuple[dict[str, np.ndarray], int]:
        """Rotated vectors by cache key: from the cache, else embedded from the sent text."""
        keys = list(dict.fromkeys(c.key for c in chunks))
        for k in keys:
            if not TOKEN.match(k):
                raise SearchError("cache keys are HMAC tokens")
        out: dict[str, np.ndarray] = {}
        with self._lock:
            for batch in _batched(keys, 500):
                marks = ",".join("?" * len(batch))
                for k, blob in self.meta.execute(
                        f"SELECT ckey, vector FROM cache WHERE key_id=? AND ckey IN ({marks})",
                        (kid, *batch)):
                    out[k] = np.frombuffer(blob, dtype=np.float32)
        texts = {c.key: c.text for c in chunks if c.key not in out and c.text is not None}
        missing = [k for k in keys if k not in out and k not in texts]
        if missing:
            raise CacheMiss(missing)
        if texts:
            fresh = self.embedder.embed(list(texts.values())) @ self._rotation(server_key).T
            with self._lock:
                self.meta.execute("BEGIN")
                self.meta.executemany("INSERT OR REPLACE INTO cache VALUES (?,?,?)",
                                      [(kid, k, v.astype(np.float32).tobytes())
                                       for k, v in zip(texts, fresh)])
                self.meta.execute("COMMIT")
            out.update(zip(texts, fresh))
        return out, len(texts)

    # -- search ----------------------------------------------------------------------------
    def search(self, ws: str, server_key: str, query: str, limit: int,
               prefix: str | None = None) -> dict:
        self._auth(ws, server_key)
        limit = max(1, min(int(limit), 200))
        table = self._table(ws, create=False)
        if table is None:
            return {"results": [], "chunks": 0}
        vec = self.embedder.embed([query])[0] @ self._rotation(server_key).T
        q = table.search(vec.astype(np.float32)).distance_type("cosine").limit(limit)
        if prefix:
            q = q.where(_path_filter([_check_path(prefix)]), prefilter=True)
        if self._has_ann(table):
            q = q.nprobes(32).refine_factor(4)
        rows = q.select(["path", "start", "end"]).to_list()
        return {"results": [{"path": r["path"], "start_line": int(r["start"]),
                             "end_line": int(r["end"]), "score": round(1 - r["_distance"], 5)}
                            for r in rows],
                "chunks": table.count_rows()}

    def status(self, ws: str, server_key: str) -> dict:
        self._auth(ws, server_key)
        table = self._table(ws, create=False)
        return {"workspace": ws, "chunks": table.count_rows() if table is not None else 0,
                "model": self.embedder.name, "dim": self.embedder.dim,
                "ann_index": bool(table is not None and self._has_ann(table))}

    # -- storage helpers -------------------------------------------------------------------
    def _ws_lock(self, ws: str) -> threading.Lock:
        with self._lock:
            return self._ws_locks.setdefault(ws, threading.Lock())

    def _table(self, ws: str, create: bool):
        name = f"ws_{ws}"
        with self._lock:
            if name in self._tables:
                return self._tables[name]
            if name in self.db.list_tables().tables:
                table = self.db.open_table(name)
            elif create:
                table = self.db.create_table(name, schema=_schema(self.embedder.dim),
                                             exist_ok=True)
            else:
                return None
            self._tables[name] = table
            return table

    @staticmethod
    def _has_ann(table) -> bool:
        return any(getattr(i, "columns", None) == ["vector"] for i in table.list_indices())

    def _maybe_build_ann(self, ws: str) -> None:
        """Build an IVF-PQ index in the background once a namespace is large; rows added later
        are searched exactly alongside it until the next rebuild."""
        table = self._table(ws, create=False)
        if table is None or ws in self._indexing or self._has_ann(table):
            return
        if table.count_rows() < self.ann_min_rows:
            return
        self._indexing.add(ws)

        def build() -> None:
            try:
                with self._ws_lock(ws):
                    from lancedb.index import IvfPq

                    table.create_index("vector", config=IvfPq(distance_type="cosine",
                                                              num_sub_vectors=48))
                    table.optimize()
            except Exception:  # exact search keeps working without the index
                log.exception("ANN index build failed for workspace %s", ws)
            finally:
                self._indexing.discard(ws)

        self._indexer.submit(build)

    def close(self) -> None:
        self._indexer.shutdown(wait=True)
        self.meta.close()


SCHEMA = """
PRAGMA journal_mode=WAL;
CREATE TABLE IF NOT EXISTS workspaces (ws TEXT PRIMARY KEY, key_id TEXT, model TEXT, created REAL);
CREATE TABLE IF NOT EXISTS nodes (ws TEXT, path TEXT, parent TEXT, hash TEXT, is_dir INTEGER,
                                  PRIMARY KEY (ws, path));
CREATE INDEX IF NOT EXISTS nodes_parent ON nodes (ws, parent);
CREATE TABLE IF NOT EXISTS cache (key_id TEXT, ckey TEXT, vector BLOB, PRIMARY KEY (key_id, ckey));
"""


def _schema(dim: int) -> pa.Schema:
    return pa.schema([pa.field("chunk_id", pa.string()), pa.field("path", pa.string()),
                      pa.field("start", pa.int32()), pa.field("end", pa.int32()),
                      pa.field("vector", pa.list_(pa.float32(), dim))])


def _arrow_rows(rows: list[tuple[str, UploadChunk]], vectors: dict[str, np.ndarray],
                dim: int) -> pa.Table:
    flat = np.concatenate([vectors[c.key] for _, c in rows]).astype(np.float32)
    return pa.table({
        "chunk_id": [c.id for _, c in rows], "path": [p for p, _ in rows],
        "start": pa.array([c.start for _, c in rows], pa.int32()),
        "end": pa.array([c.end for _, c in rows], pa.int32()),
        "vector": pa.FixedSizeListArray.from_arrays(pa.array(flat), dim)})


def _path_filter(paths: list[str]) -> str:
    """Rows of these files or of anything under these directories. Paths were validated
    against ENC_PATH, so they cannot carry quotes."""
    return " OR ".join(f"path = '{p}' OR starts_with(path, '{p}/')" for p in paths)


def _batched(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i:i + size]


def service_for(app_state, settings: Settings) -> SearchService:
    """The app's SearchService, created on first use (the embedder loads lazily too)."""
    service = getattr(app_state, "search_service", None)
    if service is None:
        with _create_lock:
            service = getattr(app_state, "search_service", None)
            if service is None:
                service = app_state.search_service = SearchService(settings)
    return service


_create_lock = threading.Lock()
