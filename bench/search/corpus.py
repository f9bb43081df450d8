"""Snapshots of a git repository as the indexer would chunk them, read straight from a bare mirror
(`fetch github:owner/name` puts one under /work/.mirror): no checkout, nothing executed.

A commit's tree is listed with `git ls-tree`; each blob is read once through `git cat-file
--batch` and chunked with the production chunker, cached by blob id, so indexing thirty parents
of one repository costs little more than indexing one. Embeddings of chunk texts (the exact text
the server embeds, `Chunk.embed_text`) are cached on disk by sha256, so re-runs and overlapping
snapshots never embed a text twice.
"""

from __future__ import annotations

import ast
import hashlib
import re
import sqlite3
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pathspec

from codeplane.indexing.chunker import Chunk, chunk_text
from codeplane.indexing.scan import DEFAULT_IGNORES, DEFAULT_MAX_BYTES, looks_binary

MIRRORS = Path("/work/.mirror")
CACHE = Path("/tmp/codeplane-search-bench")
SKIP_DIRS = ("docs/", "doc/", "examples/", "docs_src/", ".github/", "artwork/")
# As bench/index.py does for Django: tests and docs stay out of the index (a `.codeplaneignore`
# a user might write too) to keep the embedding bill of ~100 snapshots within an hour of 2 cores.
SKIP_PARTS = {"tests", "test", "testing", "testsuite", "typing_tests"}
IGNORED = pathspec.GitIgnoreSpec.from_lines(DEFAULT_IGNORES)


def mirror(repo: str) -> Path:
    """owner/name -> its git dir under /work/.mirror (bare, or `repo/.git` for some snapshots)."""
    path = MIRRORS / repo.replace("/", "+") / "repo"
    return path / ".git" if (path / ".git").is_dir() else path


def git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", str(mirror(repo)), *args], check=True,
                          capture_output=True, text=True).stdout


def blank_docstrings(path: str, text: str) -> str:
    """Docstrings replaced by `...` (line numbers kept): the query is a docstring sentence, so
    leaving it in the code would make retrieval a string match."""
    if not path.endswith(".py"):
        return text
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return text
    lines = text.splitlines(keepends=True)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not (isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef
                           | ast.AsyncFunctionDef) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            continue
        first, last = body[0].lineno - 1, body[0].end_lineno - 1
        indent = re.match(r"\s*", lines[first]).group(0)
        lines[first] = f"{indent}...\n"
        for i in range(first + 1, last + 1):
            lines[i] = "\n"
    return "".join(lines)


@dataclass(frozen=True)
class IndexedChunk:
    path: str
    chunk: Chunk

    @property
    def embed_text(self) -> str:
        return self.chunk.embed_text(self.path)


class Snapshots:
    """Chunked trees of one repository, with a per-blob cache."""

    def __init__(self, repo: str, whole_tree: bool = False) -> None:
        self.repo = repo
        self.whole_tree = whole_tree  # tests and docs too, as `codeplane index` sees the repo
        self.blob_chunks: dict[str, list[Chunk]] = {}
        self.cat = subprocess.Popen(["git", "--git-dir", str(mirror(repo)), "cat-file", "--batch"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def blob(self, sha: str) -> bytes:
        assert self.cat.stdin and self.cat.stdout
        self.cat.stdin.write(f"{sha}\n".encode())
        self.cat.stdin.flush()
        size = int(self.cat.stdout.readline().split()[2])
        data = self.cat.stdout.read(size)
        self.cat.stdout.read(1)
        return data

    def files(self, commit: str) -> dict[str, str]:
        """path -> blob id of the files the indexer would see (its default ignores, the size
        cap), without documentation and test trees unless `whole_tree`."""
        out = {}
        for line in git(self.repo, "ls-tree", "-r", "-l", commit).splitlines():
            meta, path = line.split("\t", 1)
            _, kind, sha, size = meta.split()
            if kind != "blob" or size == "-" or int(size) > DEFAULT_MAX_BYTES:
                continue
            if IGNORED.match_file(path) or path.endswith((".po", ".svg")):
                continue
            if not self.whole_tree and (path.startswith(SKIP_DIRS)
                                        or SKIP_PARTS & set(path.split("/")[:-1])):
                continue
            out[path] = sha
        return out

    def chunks(self, commit: str, transform=None) -> list[IndexedChunk]:
        """Every chunk of the commit's tree; `transform(path, text)` may rewrite a file first
        (the docstring set blanks docstrings)."""
        out = []
        for path, sha in sorted(self.files(commit).items()):
            key = sha if transform is None else f"{sha}:t"
            if key not in self.blob_chunks:
                data = self.blob(sha)
                if looks_binary(data):
                    self.blob_chunks[key] = []
                else:
                    text = data.decode("utf-8", errors="replace")
                    if transform is not None:
                        text = transform(path, text)
                    self.blob_chunks[key] = chunk_text(path, text)
            out += [IndexedChunk(path, c) for c in self.blob_chunks[key]]
        return out

    def text(self, commit: str, path: str) -> str:
        return self.blob(self.files(commit)[path]).decode("utf-8", errors="replace")


class EmbeddingCache:
    """(model, sha256(text)) -> vector, in SQLite, one table per `embedder.name` (an adapted
    ONNX is named by its digest); computes the missing ones in batches."""

    def __init__(self, embedder) -> None:
        CACHE.mkdir(parents=True, exist_ok=True)
        # several probes may run at once: wait for another writer rather than fail
        self.db = sqlite3.connect(CACHE / "embeddings.sqlite", isolation_level=None, timeout=300)
        self.table = f'"v:{embedder.name}"'
        self.db.execute(f"CREATE TABLE IF NOT EXISTS {self.table} (k TEXT PRIMARY KEY, vec BLOB)")
        if self.table == '"v:bge-small"' and self.db.execute(
                "SELECT 1 FROM sqlite_master WHERE name = 'v'").fetchone() and \
                not self.db.execute(f"SELECT 1 FROM {self.table} LIMIT 1").fetchone():
            # table `v` of caches written before vectors were keyed by model is bge-small's
            self.db.execute(f"INSERT INTO {self.table} SELECT * FROM v")
        self.embedder = embedder
        self.embedded, self.seconds = 0, 0.0  # texts embedded by this run, and how long it took

    def vectors(self, texts: list[str]) -> np.ndarray:
        keys = [hashlib.sha256(t.encode()).hexdigest() for t in texts]
        found = {}
        for i in range(0, len(keys), 500):
            part = keys[i:i + 500]
            found.update(self.db.execute(
                f"SELECT k, vec FROM {self.table} WHERE k IN ({','.join('?' * len(part))})", part))
        todo = list(dict.fromkeys(k for k in keys if k not in found))
        if todo:
            index = {k: t for k, t in zip(keys, texts)}
            for i in range(0, len(todo), 256):
                part = todo[i:i + 256]
                started = time.perf_counter()
                vecs = self.embedder.embed([index[k] for k in part])
                self.seconds += time.perf_counter() - started
                self.embedded += len(part)
                rows = [(k, v.astype(np.float32).tobytes()) for k, v in zip(part, vecs)]
                self.db.executemany(f"INSERT OR REPLACE INTO {self.table} VALUES (?,?)", rows)
                found.update(rows)
        return np.stack([np.frombuffer(found[k], dtype=np.float32) for k in keys])
