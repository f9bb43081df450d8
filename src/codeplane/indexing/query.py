"""Search a workspace from the client: the server answers with encrypted locations and scores;
only this side can turn them into files, lines and snippets.

`search_workspace` is the contract the agent's `codebase_search` tool calls.

Ranking is hybrid (`indexing.rank`): the server's dense hits (bge-small) fused with BM25 over the
client's local chunk index, with weights fitted per query shape on tuning repositories, so
requests that name identifiers, options or files are found as well as descriptions of
behaviour. Chunks not yet on the server (indexing in progress, secrets withheld) are found
lexically. `files=True` ranks files instead of chunks ("where would this change go"). Measured
in `bench/search/` (docs/indexing.md). `indexing.fusion = "dense"` turns the lexical side off.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidTag

from codeplane.config import Settings
from codeplane.core.files import Refused, decode, read_bytes
from codeplane.core.languages import code_language
from codeplane.indexing.lexical import analyse
from codeplane.indexing.rank import (
    CHUNK_WEIGHTS,
    DENSE_ONLY,
    FILE_WEIGHTS,
    Key,
    fuse_chunks,
    rank_files,
)
from codeplane.indexing.remote import Remote, RemoteError
from codeplane.indexing.state import WorkspaceState
from codeplane.indexing.vectors import client_vectors
from codeplane.indexing.workspace_keys import KeyFileError
from codeplane.models.embedders import Embedders

DENSE_K = 100  # dense hits asked of the server: the fusion needs more than the page shown
LEXICAL_K = 100
Reader = Callable[[str], bytes]  # a workspace-relative path -> the file's bytes (confined)
SNIPPET_FILE_BYTES = 8 << 20  # larger files get no snippet (they are not indexed either)


class IndexUnavailable(Exception):
    """The workspace is not indexed, or the search server cannot be reached."""


@dataclass
class SearchOutcome:
    results: list[dict]
    indexed_chunks: int = 0
    pending_chunks: int = 0  # chunked locally, not yet embedded on the server
    indexing: bool = False  # a sync is running right now
    notes: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.pending_chunks == 0 and not self.indexing


def search_workspace(root: Path, query: str, limit: int, settings: Settings,
                     files: bool = False, embedders: Embedders | None = None,
                     read: Reader | None = None) -> list[dict]:
    """[{path, start_line, end_line, score, snippet}] best first; paths are workspace-relative,
    lines 1-based. With `files`, one row per file (its best chunk as the snippet). Raises
    IndexUnavailable with a message a user can act on. `read`: how a hit's file is read
    (the agent's: through its workspace; default: the host's confined resolver)."""
    return search(root, query, limit, settings, files=files, embedders=embedders,
                  read=read).results


def search(root: Path, query: str, limit: int, settings: Settings, path: str | None = None,
           http=None, files: bool = False, code: bool = False,
           embedders: Embedders | None = None, read: Reader | None = None) -> SearchOutcome:
    """`code` keeps only source files (those with a tree-sitter grammar): "where in the code
    would this change go" without the changelog, README or config that mention the same words
    (docs/indexing.md, "Search benchmark", has what it changes).
    `embedders`: the program's, for client-side embedding (`client_vectors`)."""
    root = Path(root).resolve()
    try:
        state = WorkspaceState(root, settings, create=False)
    except FileNotFoundError:
        raise IndexUnavailable(f"{root} is not indexed; run `codeplane index {root}`") from None
    except KeyFileError as exc:
        raise IndexUnavailable(str(exc)) from None
    read = read or (lambda rel: read_bytes(root, Path(rel), SNIPPET_FILE_BYTES))
    try:
        return _search(state, query, limit, settings, _relative(root, path), http, files, code,
                       embedders, read)
    finally:
        state.close()


def _relative(root: Path, path: str | None) -> str | None:
    if not path:
        return None
    target = Path(path)
    target = (target if target.is_absolute() else Path.cwd() / target).resolve()
    try:
        rel = target.relative_to(root).as_posix()
    except ValueError:
        rel = Path(path).as_posix().strip("/")  # already workspace-relative
    return None if rel in ("", ".") else rel


def _search(state: WorkspaceState, query: str, limit: int, settings: Settings,
            rel_prefix: str | None, http, files: bool, code: bool,
            embedders: Embedders | None, read: Reader) -> SearchOutcome:
    remote = Remote(settings.server, state.workspace_id, state.keys.server_key, http, timeout=60,
                    vectors=client_vectors(settings.indexing, state.keys.rotation_key,
                                           embedders))
    prefix = state.cipher.encrypt(rel_prefix) if rel_prefix else None
    try:
        answer = remote.search(query, max(DENSE_K, limit * 2), prefix)
    except RemoteError as exc:
        if exc.status == 404:
            raise IndexUnavailable(f"{state.root} is not indexed on {settings.server}; run "
                                   f"`codeplane index {state.root}`") from None
        raise IndexUnavailable(str(exc)) from None
    finally:
        remote.close()
    counts = state.chunk_counts()
    outcome = SearchOutcome([], counts.get("indexed", 0), counts.get("pending", 0),
                            _sync_running(state))
    dense = []
    for hit in answer["results"]:
        try:
            key = (state.cipher.decrypt(hit["path"]), hit["start_line"], hit["end_line"])
        except (InvalidTag, ValueError):
            continue  # not ours: never shown
        dense.append((key, hit["score"]))
    hybrid = settings.indexing.fusion == "hybrid"
    ranked = _rank(state, query, dense, max(LEXICAL_K, limit * 2), rel_prefix, files, hybrid,
                   read)
    if code:
        ranked = [row for row in ranked if code_language(row[0])]
    if not outcome.complete:
        done = outcome.indexed_chunks
        total = done + outcome.pending_chunks
        state_word = "in progress" if outcome.indexing else "incomplete (re-run `codeplane index`)"
        outcome.notes.append(f"indexing {state_word}: {done}/{total} chunks embedded "
                             f"({100 * done // max(total, 1)}%); the rest are ranked lexically")
    outcome.results = _with_snippets(read, ranked, limit)
    return outcome


def _rank(state: WorkspaceState, query: str, dense: list[tuple[Key, float]], lexical_k: int,
          rel_prefix: str | None, files: bool, hybrid: bool, read: Reader) -> list[tuple]:
    """Fused (path, start, end, score) best first: chunks, or files by their best chunk."""
    parsed = analyse(query)
    lexical, unembedded = [], set()
    weights = DENSE_ONLY
    if hybrid:
        weights = (FILE_WEIGHTS if files else CHUNK_WEIGHTS)[parsed.shape]
        rows = state.lexical(parsed.lexical_text, lexical_k, rel_prefix) if parsed.terms else []
        lexical = [((row.path, row.start, row.end), score) for row, score in rows]
        unembedded = {(row.path, row.start, row.end) for row, _ in rows
                      if row.status != "indexed"}
    text_of = _chunk_texts(read, dense + lexical) if weights.define and parsed.names \
        else (lambda key: None)
    chunks = fuse_chunks(parsed, dense, lexical, text_of, weights, frozenset(unembedded))
    if files:
        return [(*key, round(score, 6)) for _, score, key in rank_files(parsed, chunks, weights)]
    return [(*key, round(score, 6)) for key, score in chunks]


def _chunk_texts(read: Reader, hits: list[tuple[Key, float]]) -> Callable[[Key], str | None]:
    """Source of candidate chunks (read through the snippet reader) for definition matching."""
    keys = list(dict.fromkeys(key for key, _ in hits))
    rows = _with_snippets(read, [(*key, 0.0) for key in keys], len(keys))
    texts = {(r["path"], r["start_line"], r["end_line"]): r["snippet"] for r in rows}
    return texts.get


def _with_snippets(read: Reader, ranked: list[tuple], limit: int) -> list[dict]:
    out, lines_of = [], {}
    for path, start, end, score in ranked:
        if path not in lines_of:
            lines_of[path] = _snippet_lines(read, path)
        lines = lines_of[path]
        if lines is None:
            continue  # deleted, replaced or unreadable since the last sync
        out.append({"path": path, "start_line": start, "end_line": end, "score": score,
                    "snippet": "\n".join(lines[start - 1:end])})
        if len(out) == limit:
            break
    return out


def _snippet_lines(read: Reader, rel: str) -> list[str] | None:
    """A hit's file through `read` (a resolver that confines it): a symlink out of the
    workspace, a FIFO or device put in its place, or a file grown huge since the sync gives
    no snippet."""
    try:
        return decode(read(rel), rel).shown.splitlines()
    except (Refused, OSError):
        return None


def _sync_running(state: WorkspaceState) -> bool:
    progress = state.get("progress") or {}
    pid = progress.get("pid")
    if not progress.get("running") or not pid:
        return False
    try:
        os.kill(int(pid), 0)
    except (OSError, ValueError):
        return False
    return True
