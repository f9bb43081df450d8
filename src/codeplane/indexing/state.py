"""Everything the client persists about a workspace, in one SQLite file under
`$CODEPLANE_HOME/client/workspaces/<id>/`: file hashes (so re-scans only rehash files whose
(mtime, size) changed), chunk line ranges and their status, a BM25 index over the chunks
(SQLite FTS5, so lexical search works before and while the server embeds), and sync progress.
The workspace key sits next to it (mode 0600) unless settings name a shared key file.
"""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
import uuid
from dataclasses import dataclass
from pathlib import Path

from codeplane.config import Settings
from codeplane.indexing.workspace_keys import PathCipher, WorkspaceKeys, load_or_create

SCHEMA = """
PRAGMA journal_mode=WAL;
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT);
CREATE TABLE IF NOT EXISTS files (path TEXT PRIMARY KEY, mtime_ns INTEGER, size INTEGER,
                                  sha TEXT, binary INTEGER);
CREATE TABLE IF NOT EXISTS chunks (id INTEGER PRIMARY KEY, path TEXT, start INTEGER,
                                   "end" INTEGER, ckey TEXT, status TEXT);
CREATE INDEX IF NOT EXISTS chunks_path ON chunks (path);
CREATE VIRTUAL TABLE IF NOT EXISTS chunk_fts USING fts5(tokens);
CREATE TABLE IF NOT EXISTS nodes (path TEXT PRIMARY KEY, hash TEXT);
"""
IDENT = re.compile(r"[A-Za-z0-9_]+")
CAMEL = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|[0-9]+")


def lexical_tokens(text: str) -> list[str]:
    """Identifier-aware tokens: `install_requires` and `getHTTPResponse` yield their parts
    plus the whole identifier: code names things by joined words, and a query spells them apart
    (docs/indexing.md, "Numbers behind the code's comments")."""
    out: list[str] = []
    for ident in IDENT.findall(text):
        parts = [p.lower() for piece in ident.split("_") for p in CAMEL.findall(piece)]
        out += [p for p in parts if len(p) > 1]
        whole = ident.replace("_", "").lower()
        if len(parts) > 1 and whole:
            out.append(whole)
    return out


@dataclass
class ChunkRow:
    path: str
    start: int
    end: int
    key: str
    status: str  # "pending" (not yet on the server), "indexed", "secret" (never uploaded)


def workspace_dir(settings: Settings, root: Path) -> Path:
    digest = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]
    return settings.client_dir / "workspaces" / digest


class WorkspaceState:
    def __init__(self, root: Path, settings: Settings, create: bool = True) -> None:
        self.root = root.resolve()
        self.dir = workspace_dir(settings, self.root)
        if not create and not (self.dir / "state.sqlite").is_file():
            raise FileNotFoundError(self.dir / "state.sqlite")
        self.dir.mkdir(parents=True, exist_ok=True)
        key_file = settings.indexing.key_file
        self.keys: WorkspaceKeys = load_or_create(
            key_file.expanduser() if key_file else self.dir / "key")
        self.cipher = PathCipher(self.keys)
        self.db = sqlite3.connect(self.dir / "state.sqlite", isolation_level=None, timeout=30)
        self.db.executescript(SCHEMA)
        if self.get("workspace_id") is None:
            self.put("workspace_id", uuid.uuid4().hex)
            self.put("root", str(self.root))

    @property
    def workspace_id(self) -> str:
        return str(self.get("workspace_id"))

    def get(self, key: str):
        row = self.db.execute("SELECT v FROM meta WHERE k=?", (key,)).fetchone()
        return json.loads(row[0]) if row else None

    def put(self, key: str, value) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta VALUES (?,?)", (key, json.dumps(value)))

    # -- files ------------------------------------------------------------------------------
    def known_files(self) -> dict[str, tuple[int, int, str, bool]]:
        return {p: (m, s, h, bool(b)) for p, m, s, h, b in self.db.execute(
            "SELECT path, mtime_ns, size, sha, binary FROM files")}

    def save_files(self, upserts: list[tuple], removed: list[str]) -> None:
        self.db.execute("BEGIN")
        self.db.executemany("INSERT OR REPLACE INTO files VALUES (?,?,?,?,?)", upserts)
        self.db.executemany("DELETE FROM files WHERE path=?", [(p,) for p in removed])
        self.db.execute("COMMIT")

    def save_nodes(self, nodes: dict[str, str]) -> None:
        self.db.execute("BEGIN")
        self.db.execute("DELETE FROM nodes")
        self.db.executemany("INSERT INTO nodes VALUES (?,?)", nodes.items())
        self.db.execute("COMMIT")

    # -- chunks -----------------------------------------------------------------------------
    def replace_chunks(self, path: str, rows: list[tuple[int, int, str, str, str]]) -> None:
        """rows: (start, end, cache key, status, text) for one file."""
        self.db.execute("BEGIN")
        self._drop(["path=?"], [path])
        for start, end, key, status, text in rows:
            cur = self.db.execute('INSERT INTO chunks (path, start, "end", ckey, status) '
                                  "VALUES (?,?,?,?,?)", (path, start, end, key, status))
            self.db.execute("INSERT INTO chunk_fts (rowid, tokens) VALUES (?,?)",
                            (cur.lastrowid, " ".join(lexical_tokens(f"{path}\n{text}"))))
        self.db.execute("COMMIT")

    def drop_chunks(self, paths: list[str]) -> None:
        """Forget chunks of these files or of anything under these directories."""
        self.db.execute("BEGIN")
        for path in paths:
            self._drop(["path=? OR substr(path,1,?)=?"], [path, len(path) + 1, path + "/"])
        self.db.execute("COMMIT")

    def _drop(self, where: list[str], args: list) -> None:
        ids = [i for (i,) in self.db.execute(f"SELECT id FROM chunks WHERE {where[0]}", args)]
        self.db.executemany("DELETE FROM chunk_fts WHERE rowid=?", [(i,) for i in ids])
        self.db.executemany("DELETE FROM chunks WHERE id=?", [(i,) for i in ids])

    def mark_indexed(self, paths: list[str] | None) -> None:
        """Chunks of these files (None: of every file) are now on the server."""
        if paths is None:
            self.db.execute("UPDATE chunks SET status='indexed' WHERE status='pending'")
            return
        self.db.executemany("UPDATE chunks SET status='indexed' WHERE path=? AND status='pending'",
                            [(p,) for p in paths])

    def chunk_counts(self) -> dict[str, int]:
        return dict(self.db.execute("SELECT status, count(*) FROM chunks GROUP BY status"))

    def lexical(self, query: str, limit: int, prefix: str | None = None,
                statuses: tuple[str, ...] | None = None) -> list[tuple[ChunkRow, float]]:
        """BM25 (FTS5, k1=1.2, b=0.75) over the chunks; higher score is better."""
        terms = list(dict.fromkeys(lexical_tokens(query)))
        if not terms:
            return []
        match = " OR ".join(f'"{t}"' for t in terms)
        sql = ('SELECT c.path, c.start, c."end", c.ckey, c.status, bm25(chunk_fts) FROM chunk_fts '
               "JOIN chunks c ON c.id = chunk_fts.rowid WHERE chunk_fts MATCH ?")
        args: list = [match]
        if prefix:
            sql += " AND (c.path=? OR substr(c.path,1,?)=?)"
            args += [prefix, len(prefix) + 1, prefix + "/"]
        if statuses:
            sql += f" AND c.status IN ({','.join('?' * len(statuses))})"
            args += list(statuses)
        sql += " ORDER BY bm25(chunk_fts) LIMIT ?"
        rows = self.db.execute(sql, [*args, limit]).fetchall()
        return [(ChunkRow(p, s, e, k, st), -score) for p, s, e, k, st, score in rows]

    def close(self) -> None:
        self.db.close()
