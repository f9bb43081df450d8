"""Server side of private search: per-workspace vector namespaces that hold no source code.

What the server persists:
- LanceDB table `ws_<sid>` under the object store's `search/lancedb/` (a local directory or
  `s3://bucket/prefix/search/lancedb`): rotated vector, encrypted path, line range, HMAC'd chunk
  id; `sid` is derived from (tenant, workspace id), so tenants never share a table.
- In the server database (`storage/tables.py`): (tenant, workspace) -> storage id and key
  verifier and the embedding model its vectors came from, the Merkle nodes (encrypted path,
  HMAC hash) and the embedding cache ((tenant, key, model) scope, HMAC(chunk) -> rotated
  vector). A workspace whose vectors came from another model than the one the server now runs
  is emptied when it is next opened, so the client's next sync re-embeds everything.

Replicas share both. Writes to one workspace's table hold the database lock `search:<sid>`
(across replicas), so two uploads of the same file never interleave their delete and add: a
re-sent upload (after a replica died mid-way) replaces the rows, never duplicates them.

Server-side embedding: chunk text arrives only in upload requests, is embedded, and is dropped.
Vectors are stored multiplied by an orthogonal matrix derived from the client's server key
(cosine-preserving); the key arrives in each request header and is held only in process memory.
Client-side embedding: the client sends vectors already rotated by a key the server never sees,
and rotated query vectors; no text arrives at all (docs/indexing.md, "Threat model").
"""

from __future__ import annotations

import base64
import hashlib
import logging
import sqlite3
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, closing
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
from sqlalchemy import Executable, delete, func, select

from codeplane.config import Settings
from codeplane.core.principal import LOCAL_TENANT
from codeplane.models.embed import Embedder, rotation
from codeplane.models.embedders import Embedders
from codeplane.search.schemas import UploadChunk, UploadFile
from codeplane.storage import Database, ObjectStore
from codeplane.storage.tables import search_cache as CACHE
from codeplane.storage.tables import search_nodes as NODES
from codeplane.storage.tables import search_workspaces as WORKSPACES

log = logging.getLogger("codeplane.search")


class SearchError(Exception):
    status = 400
    code: str | None = None


class Forbidden(SearchError):
    status = 403


class QuotaExceeded(SearchError):
    status = 403
    code = "workspace_quota"


class NotFound(SearchError):
    status = 404


class Busy(SearchError):
    status = 503
    code = "embedder_busy"


class CacheMiss(SearchError):
    status = 409

    def __init__(self, missing: list[str]) -> None:
        super().__init__(f"{len(missing)} chunks are not in the embedding cache; send their text "
                         "or vector")
        self.missing = missing


@dataclass(frozen=True)
class IndexedWorkspace:
    """A tenant's workspace as stored: `sid` names its LanceDB table and Merkle rows, `scope`
    partitions the embedding cache by tenant, key and embedding model."""

    sid: str
    scope: str


def key_id(server_key: str) -> str:
    return hashlib.sha256(b"codeplane-key-id\0" + server_key.encode()).hexdigest()[:32]


def storage_id(tenant: str, ws: str) -> str:
    """Per-tenant storage name, so two tenants may use the same workspace id without sharing a
    table (ids are client-chosen)."""
    return "s" + hashlib.sha256(f"{tenant}\0{ws}".encode()).hexdigest()[:40]


def cache_scope(tenant: str, kid: str, model: str) -> str:
    """Cached vectors are shared by the workspaces of one key inside one tenant, never across
    tenants (that would let a tenant probe whether another holds a given chunk), and never
    across embedding models (another model's vector for the same chunk ranks on other
    footing)."""
    return hashlib.sha256(f"{tenant}\0{kid}\0{model}".encode()).hexdigest()[:32]


def _ancestors(path: str) -> list[str]:
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(len(parts))]


def _parent(path: str) -> str | None:
    return None if path == "" else (path.rsplit("/", 1)[0] if "/" in path else "")


class SearchService:
    """One per server process; thread-safe (FastAPI runs sync routes on a thread pool).

    Every method takes the caller's tenant first: a workspace is found only inside its tenant,
    so another tenant's workspace is "not found" (404) whatever key is presented."""

    def __init__(self, settings: Settings, embedders: Embedders | None = None,
                 sql: Database | None = None, store: ObjectStore | None = None) -> None:
        """`embedders`: the program's (the server's composition root passes its own, which
        the gateway shares); without, one of this service's own from `[indexing] embedder`."""
        import lancedb

        cfg = settings.indexing
        self.embedders = embedders or Embedders(cfg.embedder)
        self.ann_min_rows = cfg.ann_min_rows
        self.max_workspaces = cfg.max_workspaces_per_tenant
        self._embed_slots = threading.BoundedSemaphore(cfg.embed_concurrency)
        self._embed_wait = cfg.embed_wait
        self._owns_sql = sql is None
        self.sql = sql or Database.from_settings(settings)
        store = store or ObjectStore.from_settings(settings)
        legacy = settings.server_dir / "search"
        _import_legacy(legacy / "meta.sqlite", self.sql)
        uri = cfg.lancedb_uri or _lance_uri(store, legacy / "lancedb")
        # Interval 0: every read sees what other replicas committed (a table handle is cached).
        self.db = lancedb.connect(str(uri), read_consistency_interval=timedelta(0),
                                  storage_options=store.storage_options or None)
        self._lock = threading.RLock()  # table handles and the rotation cache
        self._rotations: OrderedDict[str, np.ndarray] = OrderedDict()
        self._tables: dict[str, object] = {}
        self._indexer = ThreadPoolExecutor(1, thread_name_prefix="ann-index")
        self._indexing: set[str] = set()

    @property
    def embedder(self) -> Embedder:
        return self.embedders.index()

    # -- workspaces --------------------------------------------------------------------------
    def open_workspace(self, tenant: str, ws: str, server_key: str) -> dict:
        """Create the tenant's workspace bound to this key, or check the key of an existing one."""
        kid, model = key_id(server_key), self.embedder.name  # loads it outside the lock
        # The tenant's lock: the quota count and the insert are one step on every replica.
        with self.sql.lock(f"search-tenant:{tenant}"), self.sql.write() as db:
            row = db.execute(select(
                WORKSPACES.c.key_id, WORKSPACES.c.model, WORKSPACES.c.sid).where(
                WORKSPACES.c.tenant == tenant, WORKSPACES.c.ws == ws)).first()
            if row is None:
                count = db.scalar(select(func.count()).select_from(WORKSPACES).where(
                    WORKSPACES.c.tenant == tenant))
                if count >= self.max_workspaces:
                    raise QuotaExceeded(
                        f"this tenant already has {count} workspaces, the limit "
                        f"(indexing.max_workspaces_per_tenant); delete one first "
                        f"(`codeplane index --forget DIR`)")
                db.execute(WORKSPACES.insert().values(
                    tenant=tenant, ws=ws, sid=storage_id(tenant, ws), key_id=kid,
                    model=model, created=time.time()))
            elif row[0] != kid:
                raise Forbidden("this key does not open that workspace")
        if row is not None and row[1] != model:
            # a workspace embedded by another model: emptied (so the client re-sends every
            # file) and recorded under the model that fills it from now on
            self._empty(row[2], WORKSPACES.update().where(
                WORKSPACES.c.tenant == tenant, WORKSPACES.c.ws == ws).values(model=model))
            log.info("workspace %s of tenant %s was embedded by another model; emptied for "
                     "re-embedding with %s", ws, tenant, model)
        return self.status(tenant, ws, server_key)

    def delete_workspace(self, tenant: str, ws: str, server_key: str) -> dict:
        """Drop the workspace's vectors, Merkle nodes and registration (frees quota)."""
        space = self._auth(tenant, ws, server_key)
        self._empty(space.sid, delete(WORKSPACES).where(WORKSPACES.c.tenant == tenant,
                                                         WORKSPACES.c.ws == ws))
        return {"workspace": ws, "deleted": True}

    def _empty(self, sid: str, then: Executable) -> None:
        """Drop a workspace's vector table and Merkle nodes and run `then` on its registration,
        in one write under the workspace's lock. `sid` is the stored one (a workspace from
        before tenants keeps its id as its sid)."""
        with self._ws_lock(sid):
            name = f"ws_{sid}"
            with self._lock:
                self._tables.pop(name, None)
                if name in self.db.list_tables().tables:
                    self.db.drop_table(name)
            with self.sql.write() as db:
                db.execute(delete(NODES).where(NODES.c.ws == sid))
                db.execute(then)

    def _auth(self, tenant: str, ws: str, server_key: str) -> IndexedWorkspace:
        with self.sql.read() as db:
            row = db.execute(select(WORKSPACES.c.sid, WORKSPACES.c.key_id).where(
                WORKSPACES.c.tenant == tenant, WORKSPACES.c.ws == ws)).first()
        if row is None:
            raise NotFound(f"workspace {ws} is not indexed on this server")
        if row[1] != key_id(server_key):
            raise Forbidden("this key does not open that workspace")
        return IndexedWorkspace(row[0], cache_scope(tenant, row[1], self.embedder.name))

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
    def tree(self, tenant: str, ws: str, server_key: str, paths: list[str]) -> dict:
        """Each requested node's hash and its children's (name -> [hash, is_dir])."""
        sid = self._auth(tenant, ws, server_key).sid
        out = {}
        with self.sql.read() as db:
            for path in paths:
                own = db.execute(select(NODES.c.hash).where(
                    NODES.c.ws == sid, NODES.c.path == path)).first()
                kids = db.execute(select(NODES.c.path, NODES.c.hash, NODES.c.is_dir).where(
                    NODES.c.ws == sid, NODES.c.parent == path))
                out[path] = {"hash": own[0] if own else None,
                             "children": {p.rsplit("/", 1)[-1]: [h, bool(d)] for p, h, d in kids}}
        return out

    def commit(self, tenant: str, ws: str, server_key: str, nodes: list) -> int:
        """Record directory hashes once everything under them is stored."""
        sid = self._auth(tenant, ws, server_key).sid
        if nodes:
            with self.sql.write() as db:
                db.execute(self._upsert_nodes(),
                           [_node(sid, n.path, n.hash, True) for n in nodes])
        return len(nodes)

    def delete(self, tenant: str, ws: str, server_key: str, paths: list[str]) -> int:
        """Drop files or whole directories (by encrypted path) with their vectors."""
        sid = self._auth(tenant, ws, server_key).sid
        if "" in paths:
            raise SearchError("refusing to delete the workspace root; delete the workspace")
        with self._ws_lock(sid):
            table = self._table(sid, create=False)
            for batch in _batched(paths, 200):
                if table is not None:
                    table.delete(_path_filter(batch))
                with self.sql.write() as db:
                    for path in batch:
                        db.execute(delete(NODES).where(NODES.c.ws == sid, (
                            NODES.c.path == path) | (
                            func.substr(NODES.c.path, 1, len(path) + 1) == path + "/")))
        return len(paths)

    # -- upload ----------------------------------------------------------------------------
    def missing(self, tenant: str, ws: str, server_key: str, keys: list[str]) -> list[str]:
        scope = self._auth(tenant, ws, server_key).scope
        found = set(self._cached(scope, keys))
        return [k for k in dict.fromkeys(keys) if k not in found]

    def upload(self, tenant: str, ws: str, server_key: str, files: list[UploadFile]) -> dict:
        """Replace the vectors of each file, then record its Merkle leaf.

        The leaf is written last, so a client killed mid-sync leaves the file looking unsynced
        and the next run re-sends it: the server never claims a file it did not finish."""
        space = self._auth(tenant, ws, server_key)
        if len({f.path for f in files}) != len(files):
            raise SearchError("each file may appear once per upload")
        chunks = [c for f in files for c in f.chunks]
        vectors, embedded = self._vectors(space.scope, server_key, chunks)
        rows = [(f.path, c) for f in files for c in f.chunks]
        with self._ws_lock(space.sid):
            table = self._table(space.sid, create=True)
            for batch in _batched([f.path for f in files], 500):
                table.delete("path IN ({})".format(",".join(f"'{p}'" for p in batch)))
            if rows:
                table.add(_arrow_rows(rows, vectors, self.embedder.dim))
            # Ancestors appear as placeholder directories (hash "" never matches), so a later
            # sync descends to these leaves even if this one dies before its commit.
            ancestors = {a for f in files for a in _ancestors(f.path)}
            with self.sql.write() as db:
                if ancestors:
                    db.execute(self.sql.insert(NODES).on_conflict_do_nothing(),
                               [_node(space.sid, a, "", True) for a in ancestors])
                if files:
                    db.execute(self._upsert_nodes(),
                               [_node(space.sid, f.path, f.leaf, False) for f in files])
        self._maybe_build_ann(space.sid)
        return {"embedded": embedded, "reused": len(rows) - embedded, "stored": len(rows)}

    def _cached(self, scope: str, keys: list[str]) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        with self.sql.read() as db:
            for batch in _batched(list(dict.fromkeys(keys)), 500):
                for k, blob in db.execute(select(CACHE.c.ckey, CACHE.c.vector).where(
                        CACHE.c.scope == scope, CACHE.c.ckey.in_(batch))):
                    out[k] = np.frombuffer(blob, dtype=np.float32)
        return out

    def _vectors(self, scope: str, server_key: str, chunks: list[UploadChunk]
                 ) -> tuple[dict[str, np.ndarray], int]:
        """Rotated vectors by cache key: sent by the client (client-side embedding), from the
        cache, else embedded here from the sent text."""
        sent = {c.key: self._decode(c.vector) for c in chunks if c.vector is not None}
        out = self._cached(scope, [c.key for c in chunks if c.key not in sent])
        texts = {c.key: c.text for c in chunks
                 if c.key not in out and c.key not in sent and c.text is not None}
        missing = [k for k in dict.fromkeys(c.key for c in chunks)
                   if k not in out and k not in texts and k not in sent]
        if missing:
            raise CacheMiss(missing)
        fresh = dict(sent)
        if texts:
            embedded = self._embed(list(texts.values())) @ self._rotation(server_key).T
            fresh.update(zip(texts, embedded.astype(np.float32)))
        if fresh:
            insert = self.sql.insert(CACHE)
            with self.sql.write() as db:
                db.execute(insert.on_conflict_do_update(
                    index_elements=[CACHE.c.scope, CACHE.c.ckey],
                    set_={"vector": insert.excluded.vector}),
                    [{"scope": scope, "ckey": k, "vector": v.tobytes()}
                     for k, v in fresh.items()])
        out.update(fresh)
        return out, len(fresh)

    def _decode(self, b64: str) -> np.ndarray:
        """A client-sent rotated vector: exactly `dim` finite float32s, renormalised (cosine
        search assumes unit rows; a client cannot skew scores with a long vector)."""
        try:
            raw = base64.b64decode(b64, validate=True)
        except ValueError:
            raise SearchError("vector must be standard base64") from None
        dim = self.embedder.dim
        if len(raw) != 4 * dim:
            raise SearchError(f"vector must hold {dim} float32 values ({4 * dim} bytes), "
                              f"not {len(raw)} bytes")
        vec = np.frombuffer(raw, dtype="<f4").astype(np.float32)
        norm = float(np.linalg.norm(vec)) if np.isfinite(vec).all() else 0.0
        if not norm or not np.isfinite(norm):
            raise SearchError("vector must be finite and non-zero")
        return vec / norm

    def _embed(self, texts: list[str]) -> np.ndarray:
        """Embed under the service's concurrency limit; a full queue answers 503, not a pile of
        blocked threads."""
        if not self._embed_slots.acquire(timeout=self._embed_wait):
            raise Busy("the embedder is busy; retry shortly")
        try:
            return self.embedder.embed(texts)
        finally:
            self._embed_slots.release()

    # -- search ----------------------------------------------------------------------------
    def search(self, tenant: str, ws: str, server_key: str, query: str | None, limit: int,
               prefix: str | None = None, vector: str | None = None) -> dict:
        """Nearest chunks to the query text (embedded here) or to a client-sent rotated
        query vector (client-side embedding mode: the query never reaches the server)."""
        sid = self._auth(tenant, ws, server_key).sid
        table = self._table(sid, create=False)
        if table is None:
            return {"results": [], "chunks": 0}
        if vector is not None:
            vec = self._decode(vector)
        else:
            vec = self._embed([query or ""])[0] @ self._rotation(server_key).T
        q = table.search(vec.astype(np.float32)).distance_type("cosine").limit(limit)
        if prefix:
            q = q.where(_path_filter([prefix]), prefilter=True)
        if self._has_ann(table):
            q = q.nprobes(32).refine_factor(4)
        # `_distance` named explicitly: LanceDB warns on stderr for every query that leaves it out
        rows = q.select(["path", "start", "end", "_distance"]).to_list()
        return {"results": [{"path": r["path"], "start_line": int(r["start"]),
                             "end_line": int(r["end"]), "score": round(1 - r["_distance"], 5)}
                            for r in rows],
                "chunks": table.count_rows()}

    def status(self, tenant: str, ws: str, server_key: str) -> dict:
        sid = self._auth(tenant, ws, server_key).sid
        table = self._table(sid, create=False)
        return {"workspace": ws, "chunks": table.count_rows() if table is not None else 0,
                "model": self.embedder.name, "dim": self.embedder.dim,
                "ann_index": bool(table is not None and self._has_ann(table))}

    # -- storage helpers -------------------------------------------------------------------
    def _ws_lock(self, sid: str) -> AbstractContextManager[None]:
        """The workspace's vector table, exclusively, across every replica."""
        return self.sql.lock(f"search:{sid}")

    def _upsert_nodes(self):
        insert = self.sql.insert(NODES)
        return insert.on_conflict_do_update(
            index_elements=[NODES.c.ws, NODES.c.path],
            set_={"parent": insert.excluded.parent, "hash": insert.excluded.hash,
                  "is_dir": insert.excluded.is_dir})

    def _table(self, sid: str, create: bool):
        name = f"ws_{sid}"
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

    def _maybe_build_ann(self, sid: str) -> None:
        """Build an IVF-PQ index in the background once a namespace is large; rows added later
        are searched exactly alongside it until the next rebuild."""
        table = self._table(sid, create=False)
        if table is None or sid in self._indexing or self._has_ann(table):
            return
        if table.count_rows() < self.ann_min_rows:
            return
        self._indexing.add(sid)

        def build() -> None:
            try:
                with self._ws_lock(sid):
                    from lancedb.index import IvfPq

                    table.create_index("vector", config=IvfPq(distance_type="cosine",
                                                              num_sub_vectors=48))
                    table.optimize()
            except Exception:  # exact search keeps working without the index
                log.exception("ANN index build failed for workspace table %s", sid)
            finally:
                self._indexing.discard(sid)

        self._indexer.submit(build)

    def close(self) -> None:
        self._indexer.shutdown(wait=True)
        if self._owns_sql:
            self.sql.close()


def _node(sid: str, path: str, hash_: str, is_dir: bool) -> dict:
    return {"ws": sid, "path": path, "parent": _parent(path), "hash": hash_, "is_dir": is_dir}


def _lance_uri(store: ObjectStore, legacy: Path) -> str:
    """LanceDB's home under the object store; a local store first adopts the directory an
    older version kept under `server/search/lancedb` (one rename, nothing re-embedded)."""
    uri = store.uri("search/lancedb")
    if "://" not in uri and legacy.is_dir() and not Path(uri).exists():
        Path(uri).parent.mkdir(parents=True, exist_ok=True)
        legacy.replace(uri)
    return uri


def _import_legacy(path: Path, sql: Database) -> None:
    """Copy a `meta.sqlite` from before the server database into it once (then renamed
    `*.imported`), so workspaces, Merkle nodes and cached vectors survive the upgrade."""
    if not path.is_file():
        return
    with closing(sqlite3.connect(path, isolation_level=None)) as old:
        _migrate(old)
        workspaces = old.execute("SELECT tenant, ws, sid, key_id, model, created "
                                 "FROM workspaces").fetchall()
        nodes = old.execute("SELECT ws, path, parent, hash, is_dir FROM nodes").fetchall()
        cache = old.execute("SELECT key_id, ckey, vector FROM cache").fetchall()
    with sql.write() as db:
        for table, rows in ((WORKSPACES, workspaces), (NODES, nodes), (CACHE, cache)):
            names = [c.name for c in table.columns]
            for batch in _batched(rows, 500):
                db.execute(sql.insert(table).on_conflict_do_nothing(),
                           [dict(zip(names, row, strict=True)) for row in batch])
    path.replace(path.with_name(path.name + ".imported"))
    log.info("imported %d search workspaces from %s into the database", len(workspaces), path)


SCHEMA = """
PRAGMA journal_mode=WAL;
CREATE TABLE IF NOT EXISTS workspaces (tenant TEXT, ws TEXT, sid TEXT UNIQUE, key_id TEXT,
                                       model TEXT, created REAL, PRIMARY KEY (tenant, ws));
CREATE TABLE IF NOT EXISTS nodes (ws TEXT, path TEXT, parent TEXT, hash TEXT, is_dir INTEGER,
                                  PRIMARY KEY (ws, path));
CREATE INDEX IF NOT EXISTS nodes_parent ON nodes (ws, parent);
CREATE TABLE IF NOT EXISTS cache (key_id TEXT, ckey TEXT, vector BLOB, PRIMARY KEY (key_id, ckey));
"""


def _migrate(db: sqlite3.Connection) -> None:
    """Bring a legacy `meta.sqlite` to its last schema before import; a store from before
    tenants keeps its workspaces under the loopback tenant, with their old table names (`sid` =
    workspace id), so nothing is re-embedded."""
    columns = [row[1] for row in db.execute("PRAGMA table_info(workspaces)")]
    if columns and "tenant" not in columns:
        db.executescript(
            "BEGIN; ALTER TABLE workspaces RENAME TO workspaces_v1;" + SCHEMA.split(";", 1)[1]
            + f"INSERT INTO workspaces SELECT '{LOCAL_TENANT}', ws, ws, key_id, model, created "
            "FROM workspaces_v1; DROP TABLE workspaces_v1; COMMIT;")
    db.executescript(SCHEMA)


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
