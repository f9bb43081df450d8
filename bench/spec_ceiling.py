"""Speculative decoding on this CPU: the measured ceiling, and batch-vs-single logits.

Ceiling: speculative decoding verifies a draft of n-1 tokens in one forward pass of n rows
with logits on every row (as `models/speculative.py` does). If every draft were accepted, n
tokens would cost t(n) instead of n one-token passes, so the best possible speedup over
plain greedy decoding is n * t(1) / t(n). This times t(n) for n = 1..64 on a real apply
prompt (a benchmark case's chat prompt, the window's own tokens as the rows), keeping the
fastest of several repeats, under llama.cpp settings (`--knobs`) passed to a `Llama` built
here (the engine is not touched).

Mismatch (`--mismatch`): the same greedy token sequence evaluated one token per pass and in
batches of B rows; reports how far the logits differ and whether argmax flips happen only
where the top two logits are closer than that difference.

Usage (wrap in `flock /tmp/codeplane-cpu.lock` on shared machines):
  python bench/spec_ceiling.py --model code-small [--knobs all]
  python bench/spec_ceiling.py --model code-small --mismatch
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import sys
import time
from pathlib import Path

import numpy as np

SIZES = (1, 2, 4, 8, 16, 32, 64)
# Llama() settings worth trying on 2 cores; "engine" is what models/engine.py uses.
KNOBS: dict[str, dict] = {
    "engine": {},
    "flash_attn": {"flash_attn": True},
    "flash_q8kv": {"flash_attn": True, "type_k": 8, "type_v": 8},  # GGML_TYPE_Q8_0
    "ubatch16": {"n_ubatch": 16},
    "batch_threads1": {"n_threads_batch": 1},
    "threads1": {"n_threads": 1},
}


def bench_module():
    """bench/apply.py (its data set and case selection), imported by path."""
    spec = importlib.util.spec_from_file_location("bench_apply", Path(__file__).with_name(
        "apply.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def real_jobs(name: str, count: int, max_window: int):
    """The model path's decoding jobs (prompt, drafts) of `count` benchmark cases, built
    with the engine's tokenizer, plus the weights' path."""
    from codeplane.apply.formats import parse_edit, split_lines
    from codeplane.apply.rewrite import jobs
    from codeplane.config import load_settings
    from codeplane.models.engine import LocalModel
    from codeplane.models.pull import ensure_weights
    from codeplane.models.registry import ModelRegistry

    bench = bench_module()
    settings = load_settings()
    spec = ModelRegistry(settings).get(name)
    model = LocalModel(spec, settings)
    out = []
    for case, _ in bench.model_cases(bench.load(), count, max_window):
        lines = split_lines(case["original"])[0]
        planned = jobs(model, lines, parse_edit(bench.edit_for(case, "markers"), lines),
                       case["path"])
        out.append((case["path"], planned[0]))
    model.llama.close()
    return ensure_weights(spec, settings), settings, out


def make_llama(path: Path, settings, knobs: dict):
    from llama_cpp import Llama

    threads = settings.engine.n_threads or 2
    args = {"n_ctx": settings.engine.n_ctx, "n_batch": settings.engine.n_batch,
            "n_threads": threads, "n_threads_batch": threads, "verbose": False}
    return Llama(model_path=str(path), **{**args, **knobs})


def timed_pass(llama, n_past: int, rows: list[int], logits_all: bool, repeats: int) -> float:
    """Fastest of `repeats` forward passes of `rows` after `n_past` cached tokens."""
    best = float("inf")
    for _ in range(repeats):
        llama._ctx.kv_cache_seq_rm(-1, n_past, -1)
        llama._batch.set_batch(batch=rows, n_past=n_past, logits_all=logits_all)
        start = time.perf_counter()
        llama._ctx.decode(llama._batch)
        best = min(best, time.perf_counter() - start)
    llama._ctx.kv_cache_seq_rm(-1, n_past, -1)
    return best


def ceiling(path: Path, settings, job, knobs: str, repeats: int,
            sizes: tuple[int, ...] = SIZES) -> None:
    llama = make_llama(path, settings, KNOBS[knobs])
    prompt, rows = job.prompt, job.sources[0]
    llama.reset()
    llama.eval(prompt)
    n_past = len(prompt)
    timed_pass(llama, n_past, rows[:8], True, 2)  # warm up
    times = dict.fromkeys(sizes, float("inf"))
    last_only = dict(times)
    for _ in range(repeats):  # sizes interleaved: a burst of other load hits them all alike
        for n in sizes:
            times[n] = min(times[n], timed_pass(llama, n_past, rows[:n], True, 1))
            last_only[n] = min(last_only[n], timed_pass(llama, n_past, rows[:n], False, 1))
    t1 = times[1]
    print(f"\n[{knobs}] {KNOBS[knobs] or 'engine settings'}; prompt {n_past} tokens, "
          f"min of {repeats}")
    print("   n   ms/pass   ms/row   ceiling n*t(1)/t(n)   (logits on last row only: ms/pass)")
    for n in sizes:
        print(f"  {n:2d}  {1e3 * times[n]:8.1f}  {1e3 * times[n] / n:7.2f}   "
              f"{n * t1 / times[n]:6.2f}x              {1e3 * last_only[n]:8.1f}")
    big, half = max(sizes), max(n for n in sizes if n <= max(sizes) // 2)
    slope = (times[big] - times[half]) / (big - half)
    print(f"  marginal row cost {1e3 * slope:.2f} ms -> asymptotic ceiling "
          f"{t1 / slope:.2f}x; plain decoding {1 / t1:.1f} tok/s")
    llama.close()
    del llama
    gc.collect()


def mismatch(path: Path, settings, jobs: list, knobs: str, length: int,
             batches: tuple[int, ...]) -> None:
    """Greedy-decode `length` tokens one per pass (keeping each row's logits), then
    evaluate the very same tokens in batches of B rows with logits on every row."""
    import llama_cpp

    llama = make_llama(path, settings, KNOBS[knobs])
    n_vocab = llama.n_vocab()
    print(f"\n[{knobs}] {len(jobs)} prompts x {length} greedy tokens; single = one token "
          f"per pass, batch B = B rows per pass with logits on every row")
    stats = {b: {"rows": 0, "flips": 0, "maxdiff": 0.0, "diffs": [], "flip_margins": [],
                 "near": 0, "far_flips": 0} for b in batches}
    repeat_same = 0
    for _, job in jobs:
        prompt = job.prompt
        llama.reset()
        llama.eval(prompt[:-1])
        n_past = len(prompt) - 1
        seq, single = [prompt[-1]], []
        for _ in range(length):
            llama._batch.set_batch(batch=[seq[-1]], n_past=n_past + len(seq) - 1,
                                   logits_all=True)
            llama._ctx.decode(llama._batch)
            row = np.ctypeslib.as_array(llama_cpp.llama_get_logits(llama._ctx.ctx),
                                        shape=(n_vocab,)).copy()
            single.append(row)
            seq.append(int(row.argmax()))
        single_rows = np.stack(single)
        # The same single-token run again: is one path deterministic by itself?
        again = _batched(llama, n_past, seq[:-1], 1, n_vocab)
        repeat_same += bool(np.array_equal(again, single_rows))
        ordered = np.sort(single_rows, axis=1)
        margin = ordered[:, -1] - ordered[:, -2]
        for b in batches:
            rows = _batched(llama, n_past, seq[:-1], b, n_vocab)
            diff = np.abs(rows - single_rows).max(axis=1)
            flips = rows.argmax(axis=1) != single_rows.argmax(axis=1)
            s = stats[b]
            s["rows"] += len(rows)
            s["flips"] += int(flips.sum())
            s["maxdiff"] = max(s["maxdiff"], float(diff.max()))
            s["diffs"].append(diff)
            s["flip_margins"] += [float(m) for m in margin[flips]]
            s["near"] += int((margin < 2 * diff).sum())
            s["far_flips"] += int((flips & (margin >= 2 * diff)).sum())
    print(f"  single-token run repeated: bit-identical logits in {repeat_same}/{len(jobs)} "
          f"prompts")
    for b, s in stats.items():
        diffs = np.concatenate(s["diffs"])
        print(f"  B={b:2d}: max |logit diff| {s['maxdiff']:.4f} (median per row "
              f"{np.median(diffs):.4f}, rows with any diff {100 * (diffs > 0).mean():.0f}%); "
              f"argmax differs in {s['flips']}/{s['rows']} rows; top-2 margin < 2x that row's "
              f"diff in {s['near']} rows; margins where it flipped: "
              f"{[round(m, 4) for m in s['flip_margins']]}; flips where the margin was "
              f">= 2x the diff (not a near-tie): {s['far_flips']}")
    llama.close()


def _batched(llama, n_past: int, tokens: list[int], size: int, n_vocab: int) -> np.ndarray:
    """Logits of every row of `tokens` evaluated after `n_past`, `size` rows per pass."""
    import llama_cpp

    llama._ctx.kv_cache_seq_rm(-1, n_past, -1)
    out = []
    for at in range(0, len(tokens), size):
        chunk = tokens[at:at + size]
        llama._batch.set_batch(batch=chunk, n_past=n_past + at, logits_all=True)
        llama._ctx.decode(llama._batch)
        out.append(np.ctypeslib.as_array(llama_cpp.llama_get_logits(llama._ctx.ctx),
                                         shape=(len(chunk), n_vocab)).copy())
    return np.concatenate(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="code-small")
    parser.add_argument("--knobs", default="engine",
                        help=f"comma-separated of {', '.join(KNOBS)}, or all")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)),
                        help="rows per pass to time (comma-separated, must include 1)")
    parser.add_argument("--mismatch", action="store_true")
    parser.add_argument("--cases", type=int, default=6, help="--mismatch: prompts")
    parser.add_argument("--length", type=int, default=96, help="--mismatch: tokens each")
    args = parser.parse_args()
    names = list(KNOBS) if args.knobs == "all" else args.knobs.split(",")
    if args.mismatch:
        path, settings, jobs = real_jobs(args.model, args.cases, 120)
        for knobs in names:
            mismatch(path, settings, jobs, knobs, args.length, (2, 8, 64))
        return
    path, settings, jobs = real_jobs(args.model, 12, 120)
    # A case whose window has at least 64 tokens and a long prompt, as the model path sees.
    _, job = max(jobs, key=lambda pj: len(pj[1].prompt) if len(pj[1].sources[0]) > 64 else 0)
    for knobs in names:
        ceiling(path, settings, job, knobs, args.repeats,
                tuple(int(n) for n in args.sizes.split(",")))


if __name__ == "__main__":
    main()
