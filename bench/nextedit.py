"""Next-edit Tab on replayed commits: prompt formats on the base model, and the baseline.

Cases come from a public repository's history (issue 34): for a commit that changes a
Python file in several places (hunks), the first k hunks are applied as the user's recent
edits, the cursor sits at the end of the k-th, and the answer is the file after hunk k+1.
The repository is read from a git directory (`--git`, e.g. a clone) and must not be one any
benchmark or RL example uses; nothing of it is committed here.

Metrics per format: exact (the file after the suggestion is the commit's next state), shown
(a suggestion at all), precision (exact / shown), located (the suggestion touches the
target's lines), split by target near the cursor (within 10 lines) or farther; latency
p50/p95 of the engine job. `served` is what `/v1/tab/next` answers: the model's rewrite, or
the baseline's when it proposes nothing and the baseline's lies in the window.

    python bench/nextedit.py --git DIR --cases 20 --formats window diff --model code-small
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from codeplane.config import load_settings
from codeplane.models.engine import Engine
from codeplane.tab.nextedit import NextRequest, Suggestion, near_repeat, repeat_last_edit
from codeplane.tab.replay import Case, cases_of

NEAR = 10


def score(case: Case, suggestion: Suggestion | None) -> dict:
    lo, hi = case["target_lines"]
    near = abs(lo - case["line"]) <= NEAR
    if suggestion is None:
        return {"shown": 0, "exact": 0, "located": 0, "near": near}
    exact = suggestion.apply(case["state"]) == case["target"]
    start, end = suggestion.start_line, max(suggestion.end_line, suggestion.start_line + 1)
    located = start < max(hi, lo + 1) and lo < end  # an insertion counts as its line
    return {"shown": 1, "exact": int(exact), "located": int(located or exact), "near": near}


def request(case: Case, fmt: str, max_tokens: int | None) -> NextRequest:
    line = case["line"]
    return NextRequest(path=case["path"], text=case["state"],
                       cursor={"line": line, "character": 0}, edits=case["edits"],
                       format=fmt, max_tokens=max_tokens)


def summary(rows: list[dict]) -> dict:
    out = {}
    for name, part in (("all", rows), ("near", [r for r in rows if r["near"]]),
                       ("far", [r for r in rows if not r["near"]])):
        shown = sum(r["shown"] for r in part)
        exact = sum(r["exact"] for r in part)
        out[name] = {"cases": len(part), "exact": exact, "shown": shown,
                     "located": sum(r["located"] for r in part),
                     "precision": round(exact / shown, 3) if shown else None}
    return out


def run(args: argparse.Namespace) -> dict:
    cases = cases_of(Path(args.git), args.cases)
    results: dict[str, dict] = {"cases": len(cases)}
    results["baseline"] = summary([score(c, repeat_last_edit(request(c, "window", None)))
                                   for c in cases])
    with tempfile.TemporaryDirectory() as home:
        settings = load_settings(home=Path(args.home) if args.home else Path(home))
        engine = Engine(settings)
        try:
            engine.info(args.model)  # loaded outside the timings
            for fmt in args.formats:
                model_rows, served_rows, times = [], [], []
                for case in cases:
                    req = request(case, fmt, args.max_tokens)
                    began = time.perf_counter()
                    got = engine.run_sync(args.model, "tab.next", req)
                    times.append((time.perf_counter() - began) * 1000)
                    model_rows.append(score(case, got.suggestion))
                    served_rows.append(score(case, got.suggestion or near_repeat(req)))
                    if args.verbose:
                        print(json.dumps({"fmt": fmt, "case": case["path"],
                                          "raw": got.raw[:300], **model_rows[-1]}),
                              file=sys.stderr)
                results[fmt] = {"model": summary(model_rows), "served": summary(served_rows),
                                "p50_ms": round(statistics.median(times)),
                                "p95_ms": round(sorted(times)[int(0.95 * (len(times) - 1))])}
        finally:
            engine.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--git", required=True, help="git directory of the source repository")
    parser.add_argument("--cases", type=int, default=20)
    parser.add_argument("--formats", nargs="+", default=["window", "diff"],
                        choices=["window", "diff"])
    parser.add_argument("--model", default="code-small")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--home", help="CODEPLANE_HOME with the model weights")
    parser.add_argument("--verbose", action="store_true")
    print(json.dumps(run(parser.parse_args()), indent=1))


if __name__ == "__main__":
    main()
