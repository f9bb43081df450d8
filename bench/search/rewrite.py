"""Query understanding, measured: does letting the local model rewrite a request pay?

    python bench/search/rewrite.py [--model code-small] [--per-repo 5]

Two rewrites, each generated greedily by the local model through the engine:
- localisation (files): the request rewritten into the identifiers and file names it probably
  touches; they are appended to the request for both the lexical and the dense side.
- docstring -> function (chunks), HyDE: a hypothetical Python function for the docstring; its
  embedding is averaged with the request's for the dense side, the BM25 side gets both texts.
The query keeps its shape (and fitted weights) from the original request. Every other step is
the production ranking (`evaluate.Index`, `indexing.rank`). Prints quality side by side with the
original request and the generation latency (the cost a query would pay before searching).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
from corpus import EmbeddingCache, Snapshots
from evaluate import Index, chunk_gold, load, make_settings, metrics, rankings

from codeplane.models.embed import OnnxEmbedder
from codeplane.models.engine import Decoding, Engine

PROMPTS = {
    "localisation": ("A developer will make this change to a Python project:\n{query}\n"
                     "List the Python identifiers (functions, classes, options) and module file "
                     "names the change most likely touches, comma-separated, nothing else."),
    "docstring": ("Write a short Python function (signature and body, no docstring) that does "
                  "this:\n{query}\nReply with the code only."),
}
MAX_TOKENS = 48


def rewrite(engine: Engine, model: str, prompt: str) -> tuple[str, float]:
    """(generated text, seconds) for one request."""
    started = time.perf_counter()
    _, gen = engine.run_sync(model, "chat_generate", [{"role": "user", "content": prompt}],
                             None, Decoding(max_tokens=MAX_TOKENS))
    text = gen.text
    return text.replace("```python", "").replace("```", "").strip(), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="code-small")
    parser.add_argument("--per-repo", type=int, default=5)
    args = parser.parse_args()
    embeddings = EmbeddingCache(OnnxEmbedder())
    snaps: dict[str, Snapshots] = {}
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(make_settings(Path(tmp) / "home"))
        for name in ("localisation", "docstring"):
            level = "files" if name == "localisation" else "chunks"
            taken: dict[str, int] = defaultdict(int)
            rows = []
            for r in load(name):
                if taken[r["repo"]] < args.per_repo:
                    taken[r["repo"]] += 1
                    rows.append(r)
            results: dict[tuple[str, str], list[dict]] = defaultdict(list)
            seconds = []
            for r in rows:
                text, took = rewrite(engine, args.model, PROMPTS[name].format(query=r["query"]))
                seconds.append(took)
                print(f"  {name} {len(seconds)}/{len(rows)}: {took:.1f} s: {text[:80]!r}",
                      file=sys.stderr)
                snaps.setdefault(r["repo"], Snapshots(r["repo"]))
                commit = r.get("parent", r["commit"])
                index = Index(snaps[r["repo"]], commit, name == "docstring", embeddings,
                              Path(tmp))
                qvec, rvec = embeddings.vectors([r["query"], text or r["query"]])
                gold = set(r["gold"]) if name == "localisation" else chunk_gold(index, r["gold"])
                if name == "localisation":
                    variant_vec = embeddings.vectors([f"{r['query']}\n{text}"])[0]
                else:
                    mean = qvec + rvec
                    variant_vec = mean / np.linalg.norm(mean)
                plain = index.candidates(r["query"], qvec, gold)
                variant = index.candidates(f"{r['query']} {text}", variant_vec, gold)
                variant.query = dataclasses.replace(variant.query, shape=plain.query.shape)
                index.state.close()
                best = "hybrid (fitted)"
                for label, c in (("original", plain), ("rewritten", variant)):
                    for method, ranked in rankings(c, level).items():
                        if method == best or method.startswith("dense"):
                            results[(r["split"], f"{label}: {method}")].append(
                                metrics(ranked, gold))
            print(f"\n{name} ({level}), {len(rows)} requests, {args.model}")
            print("| split | ranking | R@5 | MRR@10 |\n|---|---|---|---|")
            for (split, label), ms in sorted(results.items()):
                print(f"| {split} | {label} | {sum(m['R@5'] for m in ms) / len(ms):.2f} | "
                      f"{sum(m['MRR@10'] for m in ms) / len(ms):.2f} |")
            seconds.sort()
            print(f"rewrite latency: p50 {seconds[len(seconds) // 2]:.2f} s, "
                  f"p95 {seconds[int(len(seconds) * 0.95)]:.2f} s")
        engine.close()


if __name__ == "__main__":
    sys.exit(main())
