"""Search a workspace from the client: the server answers with encrypted locations and scores;
only this side can turn them into files, lines and snippets.

`search_workspace` is the contract the agent's `codebase_search` tool calls.

Ranking: dense (server, bge-small) alone once the index is complete - on docstring->function
retrieval RRF fusion with BM25 lowered MRR@10 from 0.62 to 0.53. While indexing is incomplete,
chunks not yet on the server are ranked lexically (BM25 over the local chunk index) and fused
with the dense list by reciprocal rank, so new and secret-withheld code is still found.
`indexing.fusion = "rrf"` fuses always, `"dense"` never.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidTag

from codeplane.config import Settings
from codeplane.indexing.keys import KeyFileError
from codeplane.indexing.remote import Remote, RemoteError
from codeplane.indexing.state import WorkspaceState
from codeplane.indexing.vectors import client_vectors
from codeplane.sandbox.files import Refused, decode, read_bytes

RRF_K = 60
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


def search_workspace(root: Path, query: str, limit: int, settings: Settings) -> list[dict]:
    """[{path, start_line, end_line, score, snippet}] best first; paths are workspace-relative,
    lines 1-based. Raises IndexUnavailable with a message a user can act on."""
    return search(root, query, limit, settings).results


def search(root: Path, query: str, limit: int, settings: Settings, path: str | None = None,
           http=None) -> SearchOutcome:
    root = Path(root).resolve()
    try:
        state = WorkspaceState(root, settings, create=False)
    except FileNotFoundError:
        raise IndexUnavailable(f"{root} is not indexed; run `codeplane index {root}`") from None
    except KeyFileError as exc:
        raise IndexUnavailable(str(exc)) from None
    try:
        return _search(state, query, limit, settings, _relative(root, path), http)
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
            rel_prefix: str | None, http) -> SearchOutcome:
    remote = Remote(settings.server, state.workspace_id, state.keys.server_key, http, timeout=60,
                    vectors=client_vectors(settings.indexing, state.keys.rotation_key))
    prefix = state.cipher.encrypt(rel_prefix) if rel_prefix else None
    try:
        answer = remote.search(query, limit * 2, prefix)
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
            dense.append((state.cipher.decrypt(hit["path"]), hit["start_line"], hit["end_line"],
                          hit["score"]))
        except (InvalidTag, ValueError):
            continue  # not ours: never shown
    fusion = settings.indexing.get("fusion", "auto")
    partial = not outcome.complete
    if fusion == "rrf" or (fusion == "auto" and partial):
        statuses = None if fusion == "rrf" else ("pending", "secret")
        lexical = [(row.path, row.start, row.end, score) for row, score in
                   state.lexical(query, limit * 2, rel_prefix, statuses)]
        ranked = _rrf([dense, lexical])
        if partial:
            done = outcome.indexed_chunks
            total = done + outcome.pending_chunks
            state_word = ("in progress" if outcome.indexing
                          else "incomplete (re-run `codeplane index`)")
            outcome.notes.append(f"indexing {state_word}: {done}/{total} chunks embedded "
                                 f"({100 * done // max(total, 1)}%); the rest are ranked "
                                 "lexically")
    else:
        ranked = dense
    outcome.results = _with_snippets(state.root, ranked, limit)
    return outcome


def _rrf(lists: list[list[tuple]]) -> list[tuple]:
    scores: dict[tuple, float] = {}
    for ranking in lists:
        for rank, (path, start, end, _) in enumerate(ranking):
            key = (path, start, end)
            scores[key] = scores.get(key, 0.0) + 1.0 / (RRF_K + rank + 1)
    return [(*key, round(s, 6)) for key, s in sorted(scores.items(), key=lambda kv: -kv[1])]


def _with_snippets(root: Path, ranked: list[tuple], limit: int) -> list[dict]:
    out, lines_of = [], {}
    for path, start, end, score in ranked:
        if path not in lines_of:
            lines_of[path] = _snippet_lines(root, path)
        lines = lines_of[path]
        if lines is None:
            continue  # deleted, replaced or unreadable since the last sync
        out.append({"path": path, "start_line": start, "end_line": end, "score": score,
                    "snippet": "\n".join(lines[start - 1:end])})
        if len(out) == limit:
            break
    return out


def _snippet_lines(root: Path, rel: str) -> list[str] | None:
    """A hit's file through the sandbox's resolver: a symlink out of the workspace, a FIFO or
    device put in its place, or a file grown huge since the sync gives no snippet."""
    try:
        return decode(read_bytes(root, Path(rel), SNIPPET_FILE_BYTES), rel).shown.splitlines()
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
