"""Dense-only vs word count vs BM25 vs RRF vs fitted hybrid on the three sets of build.py,
tuning and held-out repositories side by side.

    flock /tmp/codeplane-cpu.lock python bench/search/evaluate.py          # tables
    flock /tmp/codeplane-cpu.lock python bench/search/evaluate.py --fit    # + fit weights

Every ranking runs the production code: chunks from `indexing.chunker`, BM25 from the client's
SQLite FTS5 index (`WorkspaceState.lexical`, filled through `replace_chunks`), query analysis
from `indexing.lexical`, fusion and file ranking from `indexing.rank`. Dense scores are the
server's: bge-small cosine of `Chunk.embed_text` against the raw query (the server's rotation
preserves cosines, and at these sizes LanceDB searches exhaustively), top 100 as the client asks.
Only the HTTP hop is skipped here; bench/search/latency.py times the real client and server.
"""

from __future__ import annotations

import argparse
import itertools
import re
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "tests"))

from build import PER_REPO, load, localisation
from conftest import make_settings
from corpus import EmbeddingCache, IndexedChunk, Snapshots, blank_docstrings, mirror
from layouts import LAYOUTS, spaced

from codeplane.core.languages import code_language
from codeplane.indexing import chunker, rank
from codeplane.indexing.lexical import Query, Shape, analyse
from codeplane.indexing.state import WorkspaceState
from codeplane.models.embed import DEFAULT_LOCAL, LOCAL_MODELS, OnnxEmbedder

DENSE_K = 100  # dense hits the client asks the server for
LEXICAL_K = 100
Key = tuple[str, int, int]


@dataclass
class Candidates:
    """Everything a ranking needs for one query, computed once."""

    query: Query
    dense: list[tuple[Key, float]]
    lexical: list[tuple[Key, float]]
    text: dict[Key, str]
    words: dict[str, int]  # word-count baseline score per file
    word_chunks: list[tuple[Key, float]]
    gold: set  # files (localisation) or chunk keys
    seconds_lexical: float


class Index:
    """One snapshot: its chunks in a real client FTS5 index and their dense vectors."""

    def __init__(self, snaps: Snapshots, commit: str, blank: bool, embeddings: EmbeddingCache,
                 home: Path, layout: str = "today", centre: float = 0.0) -> None:
        self.chunks: list[IndexedChunk] = snaps.chunks(commit, blank_docstrings if blank
                                                       else None)
        root = home / f"{snaps.repo.replace('/', '+')}-{commit[:10]}-{int(blank)}"
        root.mkdir(parents=True, exist_ok=True)
        self.state = WorkspaceState(root, make_settings(home / "client"))
        by_file: dict[str, list[tuple]] = defaultdict(list)
        for c in self.chunks:
            by_file[c.path].append((c.chunk.start_line, c.chunk.end_line, "k", "indexed",
                                    c.chunk.text))
        for path, rows in by_file.items():
            self.state.replace_chunks(path, rows)
        self.keys: list[Key] = [(c.path, c.chunk.start_line, c.chunk.end_line)
                                for c in self.chunks]
        self.text = {k: c.chunk.text for k, c in zip(self.keys, self.chunks)}
        self.file_text: dict[str, str] = defaultdict(str)
        for c in self.chunks:
            self.file_text[c.path] += c.chunk.text.lower() + "\n"
        self.matrix = embeddings.vectors([LAYOUTS[layout](c.path, c.chunk) for c in self.chunks])
        # hubness correction probe: a chunk's cosine to the snapshot's mean vector, subtracted
        # (times `centre`) from its score in the dense top 100 (docs/search.md, session 13)
        self.centre = centre
        self.centrality = self.matrix @ self.matrix.mean(axis=0) if centre else None

    def candidates(self, query: str, qvec: np.ndarray, gold: set) -> Candidates:
        sims = self.matrix @ qvec
        top = np.argsort(-sims)[:DENSE_K]
        if self.centrality is not None:
            sims = sims - self.centre * self.centrality
        dense = sorted(((self.keys[i], float(sims[i])) for i in top), key=lambda kv: -kv[1])
        q = analyse(query)
        started = time.perf_counter()
        lexical = [((r.path, r.start, r.end), s) for r, s in
                   self.state.lexical(q.lexical_text, LEXICAL_K)] if q.terms else []
        seconds = time.perf_counter() - started
        words = [w for w in re.findall(r"[a-z]+", query.lower()) if len(w) >= 4]
        counts = {p: sum(t.count(w) for w in words) for p, t in self.file_text.items()}
        word_chunks = sorted(((k, float(sum(t.lower().count(w) for w in words)))
                              for k, t in self.text.items()), key=lambda kv: -kv[1])[:DENSE_K]
        return Candidates(q, dense, lexical, self.text, counts, word_chunks, gold, seconds)


def chunk_gold(index: Index, gold: list[list]) -> set[Key]:
    return {k for k in index.keys for path, line in gold if k[0] == path and k[1] <= line <= k[2]}


def rrf(lists: list[list[tuple[Key, float]]], k: int = 60) -> list[tuple[Key, float]]:
    scores: dict[Key, float] = defaultdict(float)
    for ranking in lists:
        for r, (key, _) in enumerate(ranking):
            scores[key] += 1 / (k + r + 1)
    return sorted(scores.items(), key=lambda kv: -kv[1])


def files_of(chunks: list[tuple[Key, float]]) -> list[str]:
    return list(dict.fromkeys(k[0] for k, _ in chunks))


def rankings(c: Candidates, level: str, weights: dict | None = None) -> dict[str, list]:
    """Method name -> ranked files (level "files") or chunk keys (level "chunks")."""
    chunk_w = (weights or {}).get("chunks", rank.CHUNK_WEIGHTS)[c.query.shape]
    file_w = (weights or {}).get("files", rank.FILE_WEIGHTS)[c.query.shape]
    text_of = c.text.get
    out: dict[str, list] = {}
    if level == "files":
        out["dense (best chunk per file)"] = files_of(c.dense)
        out["word count (>=4 letters)"] = [p for p, n in sorted(c.words.items(),
                                                                key=lambda kv: -kv[1]) if n]
        out["BM25 (best chunk per file)"] = files_of(c.lexical)
        out["RRF dense+BM25"] = files_of(rrf([c.dense, c.lexical]))
        fused = rank.fuse_chunks(c.query, c.dense, c.lexical, text_of, file_w)
        out["hybrid (fitted)"] = [p for p, _, _ in rank.rank_files(c.query, fused, file_w)]
        # `codeplane search --files --code`: source files only (the answers here are all .py,
        # so the baselines get the same filter to compare like with like)
        for method in ("dense (best chunk per file)", "word count (>=4 letters)",
                       "hybrid (fitted)"):
            out[f"{method}, --code"] = [p for p in out[method] if code_language(p)]
    else:
        out["dense"] = [k for k, _ in c.dense]
        out["word count (>=4 letters)"] = [k for k, s in c.word_chunks if s]
        out["BM25"] = [k for k, _ in c.lexical]
        out["RRF dense+BM25"] = [k for k, _ in rrf([c.dense, c.lexical])]
        out["hybrid (fitted)"] = [k for k, _ in rank.fuse_chunks(c.query, c.dense, c.lexical,
                                                                 text_of, chunk_w)]
    return out


def metrics(ranked: list, gold: set) -> dict[str, float]:
    first = next((i for i, x in enumerate(ranked[:10]) if x in gold), None)
    row = {f"R@{k}": len(gold & set(ranked[:k])) / len(gold) for k in (1, 5, 10)}
    row["MRR@10"] = 0.0 if first is None else 1 / (first + 1)
    return row


def table(title: str, rows: dict[str, list[dict]]) -> None:
    print(f"\n{title}")
    print("| method | n | R@1 | R@5 | R@10 | MRR@10 |\n|---|---|---|---|---|---|")
    for method, ms in rows.items():
        mean = {k: sum(m[k] for m in ms) / len(ms) for k in ms[0]}
        print(f"| {method} | {len(ms)} | {mean['R@1']:.2f} | {mean['R@5']:.2f} | "
              f"{mean['R@10']:.2f} | {mean['MRR@10']:.3f} |")


def collect(sets: list[str], embeddings: EmbeddingCache, home: Path, query_prefix: str = "",
            layout: str = "today", query_words: bool = False,
            query_embeddings: EmbeddingCache | None = None, whole_tree: bool = False,
            centre: float = 0.0, requests: list[dict] | None = None
            ) -> dict[str, list[tuple[dict, Candidates]]]:
    """Candidates for every query of every set, one index per (repo, commit, blanked);
    `query_prefix` is prepended to the embedded query only (an embedder's instruction),
    `layout` names the chunk text the embedder sees (`layouts.py`), `query_words` splits the
    embedded query's identifiers into words too; `query_embeddings` embeds the queries when
    they have their own model (an adapted query side, finetune.py); `whole_tree` indexes
    tests and docs too, as a user's `codeplane index` would; `centre` is the hubness probe's
    weight (`Index`); `requests` replace the pinned localisation set (`--repos`)."""
    snaps: dict[str, Snapshots] = {}
    out: dict[str, list] = {}
    for name in sets:
        rows = requests if name == "localisation" and requests else load(name)
        qvecs = (query_embeddings or embeddings).vectors(
            [query_prefix + (spaced(r["query"]) if query_words else r["query"]) for r in rows])
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, r in enumerate(rows):
            groups[(r["repo"], r.get("parent", r["commit"]))].append(i)
        out[name] = []
        for (repo, commit), members in groups.items():
            snaps.setdefault(repo, Snapshots(repo, whole_tree))
            index = Index(snaps[repo], commit, name == "docstring", embeddings, home, layout,
                          centre)
            for i in members:
                r = rows[i]
                gold = set(r["gold"]) if name == "localisation" else chunk_gold(index, r["gold"])
                if gold:
                    out[name].append((r, index.candidates(r["query"], qvecs[i], gold)))
            index.state.close()
            print(f"  {name}: {repo}@{commit[:8]} {len(index.chunks)} chunks", file=sys.stderr)
    return out


GRID_DENSE = [i / 10 for i in range(11)]
GRID_DEFINE = [0.0, 0.2, 0.5, 1.0]
GRID_SECOND = [0.0, 0.1, 0.2, 0.4]
GRID_PATH = [0.0, 0.05, 0.1, 0.2, 0.4]
GRID_DOCS = [1.0, 0.7, 0.5, 0.3, 0.0]
GRID_TESTS = [1.0, 0.5, 0.3, 0.0]  # fit it with --whole-tree: no tests are indexed otherwise


def fit(data: dict[str, list[tuple[dict, Candidates]]]) -> dict:
    """Per shape, the grid point with the best mean (MRR@10 + R@5) on tuning queries: chunk
    weights from the docstring and identifier sets, file weights from localisation."""
    fitted: dict[str, dict] = {"chunks": dict(rank.CHUNK_WEIGHTS), "files": dict(rank.FILE_WEIGHTS)}
    for level, sets in (("chunks", ["docstring", "identifier"]), ("files", ["localisation"])):
        for shape in Shape:
            items = [c for s in sets for r, c in data.get(s, []) if r["split"] == "tuning"
                     and c.query.shape == shape]
            if not items:
                continue
            grid = itertools.product(GRID_DENSE, GRID_DEFINE,
                                     GRID_SECOND if level == "files" else [0.0],
                                     GRID_PATH if level == "files" else [0.0],
                                     GRID_DOCS, GRID_TESTS)
            best, best_score = None, -1.0
            for d, df, sec, pth, docs, tests in grid:
                w = rank.Weights(dense=d, lexical=round(1 - d, 2), define=df, second=sec,
                                 path=pth, docs=docs, tests=tests)
                total = 0.0
                for c in items:
                    fused = rank.fuse_chunks(c.query, c.dense, c.lexical, c.text.get, w)
                    ranked = ([p for p, _, _ in rank.rank_files(c.query, fused, w)]
                              if level == "files" else [k for k, _ in fused])
                    m = metrics(ranked, c.gold)
                    total += m["MRR@10"] + m["R@5"]
                if total > best_score:
                    best, best_score = w, total
            fitted[level][shape] = best
            print(f"fit {level}/{shape} ({len(items)} queries): {best}", file=sys.stderr)
    return fitted


def other_requests(repos: str | None) -> list[dict] | None:
    """Localisation requests from repositories outside the pinned set, built now."""
    if not repos:
        return None
    return [dict(r, split="other") for repo in repos.split(",")
            for r in localisation(repo, PER_REPO["localisation"])]


def onnx_embedder(spec: str) -> OnnxEmbedder:
    """A LOCAL_MODELS name, or the path of an int8 ONNX build."""
    return OnnxEmbedder(name=spec) if spec in LOCAL_MODELS else OnnxEmbedder(model=Path(spec))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fit", action="store_true", help="fit weights on the tuning split")
    parser.add_argument("--sets", default="localisation,docstring,identifier")
    parser.add_argument("--query-prefix", default="", help="e.g. bge's retrieval instruction "
                        "'Represent this sentence for searching relevant passages: '")
    parser.add_argument("--layout", default="today", choices=sorted(LAYOUTS),
                        help="the chunk text the embedder sees (bench/search/layouts.py)")
    parser.add_argument("--query-words", action="store_true",
                        help="split the embedded query's identifiers into words too")
    parser.add_argument("--embedder", default=DEFAULT_LOCAL,
                        help="a local model name (bge-small: the wheel's, bge-small-code: the "
                        "default) or the path of another int8 ONNX of bge-small (finetune.py "
                        "build) for chunks and queries")
    parser.add_argument("--query-embedder",
                        help="the same, for the queries only")
    parser.add_argument("--max-chars", type=int, default=chunker.MAX_CHARS,
                        help="chunk size budget (the chunker's MAX_CHARS)")
    parser.add_argument("--whole-tree", action="store_true",
                        help="index test and documentation trees too (by default they stay out,"
                        " as a .codeplaneignore would keep them)")
    parser.add_argument("--centre", type=float, default=0.0,
                        help="hubness probe: subtract this times each chunk's cosine to the "
                        "snapshot's mean vector from its dense score")
    parser.add_argument("--repos", help="OWNER/NAME,...: localisation requests built now from "
                        "these mirrors (12 each, as build.py does), reported as 'other' "
                        "repositories instead of the pinned set")
    args = parser.parse_args()
    missing = [r for r in (args.repos or "").split(",") if r and not mirror(r).is_dir()]
    if missing:
        parser.error(f"no mirror of {', '.join(missing)}: run `fetch github:OWNER/NAME` first")
    chunker.MAX_CHARS = args.max_chars  # a probe of the budget, not a setting
    embeddings = EmbeddingCache(onnx_embedder(args.embedder))
    queries = args.query_embedder and EmbeddingCache(onnx_embedder(args.query_embedder))
    with tempfile.TemporaryDirectory() as tmp:
        data = collect(args.sets.split(","), embeddings, Path(tmp), args.query_prefix,
                       args.layout, args.query_words, queries, args.whole_tree, args.centre,
                       other_requests(args.repos))
    weights = fit(data) if args.fit else None
    if weights:
        for level, by_shape in weights.items():
            for shape, w in by_shape.items():
                print(f"{level} {shape.value}: {w}")
    for name, items in data.items():
        level = "files" if name == "localisation" else "chunks"
        for split in ("tuning", "held-out", "other"):
            rows: dict[str, list[dict]] = defaultdict(list)
            for r, c in items:
                if r["split"] != split:
                    continue
                for method, ranked in rankings(c, level, weights).items():
                    rows[method].append(metrics(ranked, c.gold))
            if rows:
                table(f"{name} ({level}), {split} repositories", rows)
    if embeddings.embedded:
        print(f"embedded {embeddings.embedded} new texts in {embeddings.seconds:.0f} s "
              f"({embeddings.embedded / embeddings.seconds:.1f} chunks/s, not under the lock)")
    lex = sorted(c.seconds_lexical for items in data.values() for _, c in items)
    print(f"\nclient BM25 query: p50 {1000 * lex[len(lex) // 2]:.1f} ms, "
          f"p95 {1000 * lex[int(len(lex) * 0.95)]:.1f} ms")


if __name__ == "__main__":
    main()
