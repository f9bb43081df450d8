"""One sync of a workspace: scan, hash, Merkle diff against the server, chunk, filter secrets,
upload what changed, commit.

Sync protocol (cost grows with what changed, not with repo size): the client asks for the
server's hash of the root and its children; equal roots end the sync in one round trip. Otherwise
it descends only into directories whose hashes differ, one round trip per tree level; directories
the server lacks need no round trip at all (everything under them is new). Server-side file
leaves are written together with the file's vectors, and directory hashes only after everything
under them is stored, so a client killed mid-sync leaves a server that re-syncs cleanly.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Self

from codeplane.config import IndexingSettings, Settings
from codeplane.indexing.chunker import EMBED_FORMAT, chunk_text
from codeplane.indexing.remote import Remote, RemoteError
from codeplane.indexing.scan import looks_binary, scan
from codeplane.indexing.secretscan import find_secret
from codeplane.indexing.state import WorkspaceState
from codeplane.indexing.vectors import client_vectors
from codeplane.models.embed import MAX_TEXT_CHARS
from codeplane.models.embedders import Embedders

Progress = Callable[[int, int], None]  # (chunks done, chunks to send)
# Per-mode cache keys: a vector rotated by the client's key never answers for one rotated by the
# server's (teammates sharing a key file may use either mode).
CACHE_LABEL = {"server": "cache", "client": "cache/client"}


@dataclass
class SyncReport:
    workspace: str
    root: str
    files_scanned: int = 0
    files_changed: int = 0
    files_deleted: int = 0
    files_ignored: int = 0
    files_skipped: int = 0  # binary or over the size cap
    chunks_total: int = 0
    chunks_embedded: int = 0
    chunks_reused: int = 0
    chunks_withheld_secrets: int = 0
    files_withheld_secrets: int = 0
    secret_types: dict[str, int] = field(default_factory=dict)  # secret type -> files
    root_hash: str = ""
    round_trips: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Tree:
    """The client's Merkle tree: node hash by workspace-relative path ("" is the root)."""

    hashes: dict[str, str]
    children: dict[str, list[str]]  # directory -> child names

    def is_dir(self, rel: str) -> bool:
        return rel in self.children

    def files_under(self, rel: str) -> list[str]:
        out, stack = [], [rel]
        while stack:
            d = stack.pop()
            for name in self.children[d]:
                child = f"{d}/{name}" if d else name
                (stack.append if self.is_dir(child) else out.append)(child)
        return out

    def dirs_under(self, rel: str) -> list[str]:
        out, stack = [], [rel]
        while stack:
            d = stack.pop()
            out.append(d)
            stack += [f"{d}/{n}" if d else n for n in self.children[d]
                      if self.is_dir(f"{d}/{n}" if d else n)]
        return out


def hash_files(state: WorkspaceState, root: Path, files: dict[str, tuple[int, int]]
               ) -> tuple[dict[str, str], int]:
    """sha256 of every text file, rehashing only files whose (mtime, size) changed."""
    known = state.known_files()
    hashes, upserts, binary = {}, [], 0
    for rel, (mtime, size) in files.items():
        old = known.get(rel)
        if old and old[0] == mtime and old[1] == size:
            is_binary, sha = old[3], old[2]
        else:
            try:
                data = (root / rel).read_bytes()
            except OSError:
                continue
            is_binary, sha = looks_binary(data), hashlib.sha256(data).hexdigest()
            upserts.append((rel, mtime, size, sha, int(is_binary)))
        if is_binary:
            binary += 1
        else:
            hashes[rel] = sha
    state.save_files(upserts, [p for p in known if p not in files])
    return hashes, binary


def build_tree(hashes: dict[str, str], state: WorkspaceState) -> Tree:
    """Leaf = HMAC(file sha256); directory = HMAC(sorted child name, kind, hash lines). Keyed
    hashes keep the server from confirming a guessed file content."""
    mac = state.keys.mac
    nodes = {rel: mac("leaf", sha) for rel, sha in hashes.items()}
    children: dict[str, set[str]] = defaultdict(set)
    children[""]
    for rel in hashes:
        parts = rel.split("/")
        for depth in range(len(parts)):
            children["/".join(parts[:depth])].add(parts[depth])
    for d in sorted(children, key=lambda p: -p.count("/") - (p != "")):
        lines = []
        for name in sorted(children[d]):
            child = f"{d}/{name}" if d else name
            lines.append(f"{name}\0{'d' if child in children else 'f'}\0{nodes[child]}")
        nodes[d] = mac("dir", "\n".join(lines))
    return Tree(nodes, {d: sorted(c) for d, c in children.items()})


def diff(tree: Tree, remote: Remote, state: WorkspaceState
         ) -> tuple[list[str], list[str], set[str]]:
    """(changed files, server paths to delete (encrypted), directories to re-commit)."""
    enc = state.cipher.encrypt
    changed: list[str] = []
    deleted: list[str] = []
    dirty: set[str] = set()
    queue = [""]
    while queue:
        answer: dict = {}
        for i in range(0, len(queue), 1000):
            answer.update(remote.tree([enc(d) for d in queue[i:i + 1000]]))
        next_queue = []
        for d in queue:
            node = answer[enc(d)]
            if node["hash"] == tree.hashes[d]:
                continue
            dirty.add(d)
            theirs = node["children"]
            ours = {state.cipher.segment(n): n for n in tree.children[d]}
            prefix = f"{enc(d)}/" if d else ""
            for token, (_, their_dir) in theirs.items():
                name = ours.get(token)
                child = f"{d}/{name}" if d and name else name
                if name is None or bool(their_dir) != tree.is_dir(child):
                    deleted.append(prefix + token)
            for token, name in ours.items():
                child = f"{d}/{name}" if d else name
                mine = theirs.get(token)
                if mine and mine[0] == tree.hashes[child] and bool(mine[1]) == tree.is_dir(child):
                    continue
                if not tree.is_dir(child):
                    changed.append(child)
                elif mine and mine[1]:
                    next_queue.append(child)
                else:  # a directory the server lacks: all of it is new, no round trip needed
                    changed += tree.files_under(child)
                    dirty.update(tree.dirs_under(child))
        queue = next_queue
    return changed, deleted, dirty


def _read_text(root: Path, rel: str) -> str | None:
    """The file as text (undecodable bytes replaced; NUL dropped, as the server refuses it),
    or None if it vanished since the scan."""
    try:
        return (root / rel).read_bytes().decode("utf-8", errors="replace").replace("\0", "")
    except OSError:
        return None


class SyncLock:
    """One sync per workspace at a time (a --watch loop and a manual run may overlap)."""

    def __init__(self, path: Path) -> None:
        self.fh = path.open("w")

    def __enter__(self) -> Self:
        fcntl.flock(self.fh, fcntl.LOCK_EX)
        return self

    def __exit__(self, *_: object) -> None:
        fcntl.flock(self.fh, fcntl.LOCK_UN)
        self.fh.close()


def sync(root: Path, settings: Settings, progress: Progress | None = None,
         http=None, embedders: Embedders | None = None) -> SyncReport:
    """`embedders`: the program's, for client-side embedding (`client_vectors`)."""
    started = time.perf_counter()
    state = WorkspaceState(root, settings)
    cfg = settings.indexing
    remote = Remote(settings.server, state.workspace_id, state.keys.server_key, http,
                    vectors=client_vectors(cfg, state.keys.rotation_key, embedders))
    try:
        with SyncLock(state.dir / "sync.lock"):
            report = _sync(state, remote, cfg, progress)
    finally:
        state.put("progress", {"running": False})
        remote.close()
        state.close()
    report.round_trips, report.bytes_sent = remote.round_trips, remote.bytes_sent
    report.seconds = round(time.perf_counter() - started, 3)
    return report


def forget(root: Path, settings: Settings, http=None) -> bool:
    """Delete a workspace's index: the server's copy (vectors, tree, registration, so it no
    longer counts against the tenant's `max_workspaces_per_tenant`) and this machine's state.
    False when this machine holds no index of `root`; a server copy already gone is fine."""
    try:
        state = WorkspaceState(root, settings, create=False)
    except FileNotFoundError:
        return False
    remote = Remote(settings.server, state.workspace_id, state.keys.server_key, http)
    try:
        with SyncLock(state.dir / "sync.lock"):
            remote.drop()
    except RemoteError as exc:
        if exc.status != 404:
            raise
    finally:
        remote.close()
        state.close()
    shutil.rmtree(state.dir)
    return True


def _sync(state: WorkspaceState, remote: Remote, cfg: IndexingSettings,
          progress: Progress | None) -> SyncReport:
    root = state.root
    report = SyncReport(workspace=state.workspace_id, root=str(root))
    scanned = scan(root, cfg.max_file_bytes)
    hashes, binary = hash_files(state, root, scanned.files)
    report.files_scanned = len(scanned.files)
    report.files_ignored = scanned.ignored
    report.files_skipped = binary + scanned.too_large
    tree = build_tree(hashes, state)
    report.root_hash = tree.hashes[""]
    _open(state, remote, cfg.embed)
    changed, deleted, dirty = diff(tree, remote, state)
    report.files_changed, report.files_deleted = len(changed), len(deleted)
    if deleted:
        remote.delete(deleted)
        state.drop_chunks([state.cipher.decrypt(p) for p in deleted])
    # Files the user touched most recently go first: they are what the next query is about.
    changed.sort(key=lambda rel: -scanned.files[rel][0])
    plan = _plan(state, root, changed, report, cfg.embed)
    state.put("progress", {"running": True, "pid": os.getpid(), "files": len(changed)})
    _upload(state, remote, plan, tree, cfg.batch_chunks, report, progress)
    if dirty:
        enc = state.cipher.encrypt
        remote.commit([{"path": enc(d), "hash": tree.hashes[d]} for d in sorted(dirty)])
    state.mark_indexed(None)  # the server now matches the tree: nothing is pending
    state.save_nodes(tree.hashes)
    state.put("last_sync", {"root_hash": report.root_hash, "at": time.time()})
    counts = state.chunk_counts()
    report.chunks_total = sum(counts.values())
    return report


def _open(state: WorkspaceState, remote: Remote, mode: str) -> None:
    """Open the server workspace for this embedding mode and chunk text layout. The two modes
    rotate vectors with different keys, and vectors of two layouts (`EMBED_FORMAT`) rank on
    different footing, so after either changes the server's vectors are unusable: drop the
    workspace and start over (the next diff then finds every file new). A Merkle leaf hashes
    the file, not the embedded text, so without this an unchanged file would keep its old
    vector forever next to new ones."""
    status = remote.open()
    built = state.get("embed_mode")
    # indexes from before the format was recorded were built with layout 1
    layout = state.get("embed_format") or 1
    if built is not None and (built != mode or layout != EMBED_FORMAT):
        remote.drop()
        status = remote.open()
    if remote.vectors is not None:
        remote.vectors.check(status)
    state.put("embed_mode", mode)
    state.put("embed_format", EMBED_FORMAT)


def _plan(state: WorkspaceState, root: Path, changed: list[str], report: SyncReport, mode: str
          ) -> list[tuple[str, list[dict]]]:
    """Chunk changed files, withhold every chunk of a file that holds a secret anywhere (a key
    split over chunks must not leak its tail), record everything locally (so lexical search
    covers it at once) and return what to upload."""
    plan = []
    secret_types: dict[str, int] = defaultdict(int)
    for rel in changed:
        text = _read_text(root, rel)
        found = find_secret(text) if text is not None else None
        if found:
            secret_types[found] += 1
            report.files_withheld_secrets += 1
        enc_path = state.cipher.encrypt(rel)
        rows, send = [], []
        for chunk in chunk_text(rel, text) if text is not None else []:
            embed_text = chunk.embed_text(rel)[:MAX_TEXT_CHARS]
            key = state.keys.mac(CACHE_LABEL[mode], hashlib.sha256(embed_text.encode()).hexdigest())
            status = "secret" if found else "pending"
            rows.append((chunk.start_line, chunk.end_line, key, status, chunk.text))
            if not found:
                send.append({"id": state.keys.mac("chunk", enc_path, str(chunk.start_line),
                                                  str(chunk.end_line), key),
                             "key": key, "start": chunk.start_line, "end": chunk.end_line,
                             "text": embed_text})
        report.chunks_withheld_secrets += len(rows) if found else 0
        state.replace_chunks(rel, rows)
        plan.append((rel, send))
    report.secret_types = dict(secret_types)
    return plan


def _payloads(batch: list[tuple[str, list[dict]]], missing: set[str], remote: Remote
              ) -> dict[str, dict]:
    """What the server lacks, once per cache key: the chunk text (server-side embedding) or
    its rotated vector embedded here (client-side mode: the text never leaves)."""
    texts = {c["key"]: c["text"] for _, send in batch for c in send if c["key"] in missing}
    if remote.vectors is None:
        return {k: {"text": t} for k, t in texts.items()}
    return {k: {"vector": v} for k, v in zip(texts, remote.vectors.encode(list(texts.values())))}


def _upload(state: WorkspaceState, remote: Remote, plan: list[tuple[str, list[dict]]],
            tree: Tree, batch_chunks: int, report: SyncReport, progress: Progress | None
            ) -> None:
    total = sum(len(send) for _, send in plan)
    done = 0
    batch: list[tuple[str, list[dict]]] = []
    if progress:
        progress(0, total)  # every chunk is in the local lexical index from here on

    def flush() -> None:
        nonlocal done
        keys = [c["key"] for _, send in batch for c in send]
        missing = remote.missing(keys) if keys else set()
        payload = _payloads(batch, missing, remote)
        files = []
        for rel, send in batch:
            chunks = []
            for c in send:
                body = {k: v for k, v in c.items() if k != "text"}
                body.update(payload.pop(c["key"], {}))
                chunks.append(body)
            files.append({"path": state.cipher.encrypt(rel), "leaf": tree.hashes[rel],
                          "chunks": chunks})
        result = remote.upload(files)
        report.chunks_embedded += result["embedded"]
        report.chunks_reused += result["reused"]
        state.mark_indexed([rel for rel, _ in batch])
        done += len(keys)
        if progress:
            progress(done, total)
        batch.clear()

    size = 0
    for rel, send in plan:
        batch.append((rel, send))
        size += len(send)
        if size >= batch_chunks or len(batch) >= 200:
            flush()
            size = 0
    if batch:
        flush()

