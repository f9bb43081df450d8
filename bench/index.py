"""Private indexing benchmark on a real codebase: full index, no-change sync, one-file change to
searchable, search latency, retrieval quality (docstring -> function, MRR@10) vs BM25.

    pip download --no-deps --no-binary :all: django==5.2.19 -d /tmp/dl
    tar xzf /tmp/dl/django-5.2.19.tar.gz -C /tmp
    flock /tmp/codeplane-cpu.lock python bench/index.py /tmp/django-5.2.19 [--queries 500]

The sdist is data only (never executed). It is copied to a scratch directory; `tests/`, `docs/`
and translation catalogues (`*.po`) are excluded with a `.codeplaneignore` to keep the embedding
bill near 12k chunks (~4 min on 2 cores). Docstrings in `.py` files are blanked in the copy
(line numbers kept) before indexing: each query is the first sentence of a function's
docstring, and leaving it in the chunk would make retrieval a string match. A real client and a
real server (FastAPI + LanceDB + bge-small ONNX) talk over loopback HTTP, as in production.
The no-change sync is also timed on a >=10k-file tree for its client side (scan, stat reuse,
Merkle tree); its server side is two round trips whatever the size.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from conftest import LiveServer, free_port, make_settings

from codeplane.indexing import query
from codeplane.indexing.remote import Remote
from codeplane.indexing.scan import scan
from codeplane.indexing.state import WorkspaceState
from codeplane.indexing.sync import build_tree, hash_files, sync
from codeplane.server.app import create_app

IGNORE = "tests/\ndocs/\njs_tests/\n*.po\n"


def blank_docstrings(root: Path) -> dict[tuple[str, int], str]:
    """Blank every docstring in place (same line count); return {(file, def line): docstring}."""
    docs: dict[tuple[str, int], str] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        try:
            source = path.read_text()
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
                              | ast.Module):
                continue
            body = node.body
            if not (body and isinstance(body[0], ast.Expr)
                    and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                continue
            doc = body[0]
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and len(body) > 1:
                docs[(rel, node.lineno)] = body[0].value.value
            first, last = doc.lineno - 1, doc.end_lineno - 1
            indent = re.match(r"\s*", lines[first]).group(0)
            lines[first] = f"{indent}...\n"
            for i in range(first + 1, last + 1):
                lines[i] = "\n"
        path.write_text("".join(lines))
    return docs


def make_queries(docs: dict[tuple[str, int], str], count: int, seed: int = 7) -> list[dict]:
    """First docstring sentence (extended to >= 6 words) of functions with >= 8-word docstrings
    and a real body; texts shared by two functions are dropped (as in the research benchmark)."""
    candidates: dict[str, list[tuple[str, int]]] = {}
    for (rel, line), doc in docs.items():
        words = doc.split()
        if len(words) < 8:
            continue
        sentences = re.split(r"(?<=[.!?])\s+", " ".join(words))
        query = ""
        for sentence in sentences:
            query = f"{query} {sentence}".strip()
            if len(query.split()) >= 6:
                break
        candidates.setdefault(query, []).append((rel, line))
    unique = [{"query": q, "path": t[0][0], "line": t[0][1]}
              for q, t in sorted(candidates.items()) if len(t) == 1]
    random.Random(seed).shuffle(unique)
    return unique[:count]


def mrr(ranked: list[list[tuple[str, int, int]]], queries: list[dict], k: int = 10) -> dict:
    total, hit1, hit10 = 0.0, 0, 0
    for results, q in zip(ranked, queries, strict=True):
        for rank, (path, start, end) in enumerate(results[:k], 1):
            if path == q["path"] and start <= q["line"] <= end:
                total += 1 / rank
                hit1 += rank == 1
                hit10 += 1
                break
    n = len(queries)
    return {"mrr@10": round(total / n, 3), "r@1": round(hit1 / n, 3), "r@10": round(hit10 / n, 3)}


def rrf(a: list[tuple], b: list[tuple], k: int = 60) -> list[tuple]:
    scores: dict[tuple, float] = {}
    for ranking in (a, b):
        for rank, item in enumerate(ranking):
            scores[item] = scores.get(item, 0.0) + 1 / (k + rank + 1)
    return sorted(scores, key=lambda item: -scores[item])


def pct(values: list[float], q: float) -> float:
    return round(sorted(values)[min(len(values) - 1, int(q * len(values)))] * 1000, 1)


def quality(state: WorkspaceState, remote: Remote, queries: list[dict]) -> dict:
    dense, lexical, fused, latency = [], [], [], []
    for q in queries:
        start = time.perf_counter()
        hits = remote.search(q["query"], 50, None)["results"]
        latency.append(time.perf_counter() - start)
        d = [(state.cipher.decrypt(h["path"]), h["start_line"], h["end_line"]) for h in hits]
        lx = [(r.path, r.start, r.end) for r, _ in state.lexical(q["query"], 50)]
        dense.append(d)
        lexical.append(lx)
        fused.append(rrf(d, lx))
    return {"dense (bge-small)": mrr(dense, queries), "bm25 (client FTS5)": mrr(lexical, queries),
            "rrf(dense, bm25)": mrr(fused, queries),
            "server search ms p50/p95": [pct(latency, 0.5), pct(latency, 0.95)]}


def client_side_sync_seconds(tree_root: Path, settings) -> tuple[int, float]:
    """Scan + (mtime, size) reuse + Merkle tree, i.e. a no-change sync minus its 2 round trips."""
    state = WorkspaceState(tree_root, settings)
    hash_files(state, tree_root, scan(tree_root).files)  # first pass reads everything
    times = []
    for _ in range(3):
        start = time.perf_counter()
        files = scan(tree_root).files
        build_tree(hash_files(state, tree_root, files)[0], state)
        times.append(time.perf_counter() - start)
    state.close()
    return len(files), round(statistics.median(times), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("source", type=Path, help="extracted sdist (e.g. /tmp/django-5.2.19)")
    parser.add_argument("--queries", type=int, default=500)
    parser.add_argument("--work", type=Path, default=None, help="scratch dir (default: temp)")
    parser.add_argument("--big-files", type=int, default=10_000,
                        help="file count of the tree for the client-side no-change sync")
    args = parser.parse_args()
    if not args.source.is_dir():
        sys.exit(f"{args.source} is not a directory; see this script's docstring")
    work = args.work or Path(tempfile.mkdtemp(prefix="cp-index-bench-"))
    ws = work / "ws"
    shutil.copytree(args.source, ws)
    (ws / ".codeplaneignore").write_text(IGNORE)
    docs = blank_docstrings(ws / "django")
    docs = {(f"django/{rel}", line): d for (rel, line), d in docs.items()}
    queries = make_queries(docs, args.queries)

    server_cfg = make_settings(work / "server-home")
    live = LiveServer(create_app(server_cfg), free_port()).start()
    cfg = make_settings(work / "client-home", server=live.url)
    out: dict = {"workspace": str(args.source), "queries": len(queries)}

    marks: dict[str, float] = {}
    start = time.perf_counter()

    def progress(done: int, total: int) -> None:
        now = time.perf_counter() - start
        marks.setdefault("lexical_ready_s", now)
        if done:
            marks.setdefault("first_dense_results_s", now)

    report = sync(ws, cfg, progress=progress)
    out["full_index"] = {
        **{k: getattr(report, k) for k in ("files_scanned", "files_changed", "files_ignored",
                                           "files_skipped", "chunks_embedded",
                                           "chunks_withheld_secrets", "seconds")},
        "files_per_s": round(report.files_changed / report.seconds, 1),
        "chunks_per_s": round(report.chunks_embedded / report.seconds, 1),
        **{k: round(v, 2) for k, v in marks.items()}}
    print(json.dumps(out, indent=2), flush=True)

    nochange = [sync(ws, cfg) for _ in range(5)]
    out["no_change_sync"] = {"files": nochange[0].files_scanned,
                             "seconds_median": statistics.median(r.seconds for r in nochange),
                             "round_trips": nochange[0].round_trips,
                             "bytes_sent": nochange[0].bytes_sent}
    big = work / "big"
    shutil.copytree(args.source, big)
    copies = 0
    while len(scan(big).files) < args.big_files:
        copies += 1
        shutil.copytree(args.source / "django", big / f"django_copy{copies}")
    files, secs = client_side_sync_seconds(big, make_settings(work / "client-big"))
    out["no_change_sync_client_side"] = {"files": files, "seconds_median": secs}

    target = ws / "django" / "utils" / "text.py"
    original = target.read_text()
    searchable = []
    for i in range(3):
        marker = f"zebra_quartz_{i}"
        target.write_text(original + f"\n\ndef {marker}(value):\n    return value[::-1] + '{i}'\n")
        t0 = time.perf_counter()
        changed = sync(ws, cfg)
        hits = query.search_workspace(ws, f"def {marker}(value)", 3, cfg)
        assert any(marker in h["snippet"] for h in hits), hits
        searchable.append(time.perf_counter() - t0)
        assert changed.files_changed == 1, changed
    target.write_text(original)
    sync(ws, cfg)
    out["one_file_change_to_searchable_s"] = {"median": round(statistics.median(searchable), 3),
                                              "embedded": changed.chunks_embedded,
                                              "reused": changed.chunks_reused}

    state = WorkspaceState(ws, cfg, create=False)
    remote = Remote(live.url, state.workspace_id, state.keys.server_key)
    end_to_end = []
    for q in queries[:100]:
        t0 = time.perf_counter()
        query.search_workspace(ws, q["query"], 10, cfg)
        end_to_end.append(time.perf_counter() - t0)
    out["search_ms_end_to_end_p50_p95"] = [pct(end_to_end, 0.5), pct(end_to_end, 0.95)]
    out["quality_exact"] = quality(state, remote, queries)
    print(json.dumps(out, indent=2), flush=True)

    service = live.app.state.search_service
    service.ann_min_rows = 1
    service._maybe_build_ann(state.workspace_id)
    t0 = time.perf_counter()
    service._indexer.submit(lambda: None).result()  # wait for the background build
    out["ann_build_s"] = round(time.perf_counter() - t0, 1)
    out["ann_index_present"] = remote.status()["ann_index"]
    out["quality_ann"] = quality(state, remote, queries)
    print(json.dumps(out, indent=2))
    state.close()
    live.stop()


if __name__ == "__main__":
    main()
