"""Prompt evaluation and decoding speed: plain llama.cpp against the product's Tab path.

Where does a cold Tab prompt's time go? The same FIM prompt (the one the Tab service builds
at a held-out position, bench/tab.py's `heldout3`) is evaluated

* by a plain `Llama(...)` with the engine's settings, varying n_batch/n_ubatch, flash
  attention, threads and llama.cpp's extra buffer types (weight repacking), timed around
  `Llama.eval`;
* by the product: `LocalModel.generate` (one token) with the threads `fit_threads` picks,
  and the whole `tab.suggest` job on an engine worker (cold: a file the worker has not
  seen; its short window off, so the whole window is evaluated).

Then 32 tokens are decoded greedily one at a time (what a suggestion costs after the prompt).

    flock /tmp/codeplane-cpu.lock python bench/prompt_speed.py --repeats 3
    flock /tmp/codeplane-cpu.lock python bench/prompt_speed.py --variants product
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import tab_first

from codeplane.config import load_settings
from codeplane.models.engine import Decoding, Engine, LocalModel, _model_params
from codeplane.models.jobs import JobContext
from codeplane.models.registry import ModelRegistry
from codeplane.tab.service import Anchors, TabRequest, TabSettings, _prompt, local_tab

FULL = TabSettings(cold_prompt_tokens=0)  # the whole window, whatever the cache holds
# name: (n_batch, n_ubatch, flash_attn, threads, extra buffer types)
RAW = {"engine": (512, 512, False, 2, False),
       "ubatch128": (512, 128, False, 2, False),
       "batch2048": (2048, 2048, False, 2, False),
       "flash": (512, 512, True, 2, False),
       "threads1": (512, 512, False, 1, False),
       "repack": (512, 512, False, 2, True),
       "flash+repack": (512, 512, True, 2, True)}


def requests(count: int, seed: int) -> list[TabRequest]:
    """Tab requests at held-out positions, each in a file of its own (bench/tab_first.py)."""
    return [TabRequest(**{k: v for k, v in tab_first.window(case, f"s{i}").items()
                          if k in TabRequest.model_fields})
            for i, case in enumerate(tab_first.cases("heldout3", count, seed))]


def prompt_tokens(model: LocalModel, req: TabRequest) -> list[int]:
    """The healed prompt the Tab service evaluates for `req`."""
    ctx = JobContext(model, None, lambda _: None)  # type: ignore[arg-type]
    heal, _ = _prompt(local_tab(ctx, TabSettings(), "bench"), TabSettings(), req,
                      Anchors(4), ("bench", req.cursor_id))
    return heal.tokens


def raw(path: Path, n_ctx: int, variant: tuple, prompts: list[list[int]], repeats: int
        ) -> dict:
    """Plain llama-cpp-python: prompt tokens/s and decode ms/token."""
    from llama_cpp import Llama

    n_batch, n_ubatch, flash, threads, extra = variant
    with _model_params(use_extra_bufts=extra):
        llama = Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch,
                      n_threads=threads, n_threads_batch=threads, flash_attn=flash,
                      verbose=False)
    try:
        rates, decode = [], []
        for _ in range(repeats):
            for tokens in prompts:
                llama.reset()
                start = time.perf_counter()
                llama.eval(tokens)
                rates.append(len(tokens) / (time.perf_counter() - start))
                decode.append(_decode(llama, 32))
        return {"prompt_tok_s": statistics.median(rates),
                "decode_ms_per_token": statistics.median(decode)}
    finally:
        llama.close()


def _decode(llama, count: int) -> float:
    """Greedy decode, one token per pass; ms per token."""
    import llama_cpp

    start = time.perf_counter()
    for _ in range(count):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llama._ctx.ctx, -1),
                                       shape=(llama.n_vocab(),))
        llama.eval([int(logits.argmax())])
    return (time.perf_counter() - start) * 1000 / count


def product(settings, reqs: list[TabRequest], prompts: list[list[int]], repeats: int
            ) -> dict:
    """`LocalModel.generate` of one token, cold; and the `tab.suggest` job on a worker."""
    model = LocalModel(ModelRegistry(settings).get("code-small"), settings)
    rates, threads = [], []
    for _ in range(repeats):
        for tokens in prompts:
            model.kv.truncate(0)
            threads.append(model.fit_threads())  # as the worker does before each job
            gen = model.generate(tokens, Decoding(max_tokens=1))
            rates.append(gen.prompt_tokens / gen.prompt_seconds)
    model.llama.close()
    engine = Engine(settings)
    engine.info("code-small")
    jobs = []
    try:
        engine.run_sync("code-small", "tab.warm", FULL)
        for r in range(repeats):
            for req in reqs:
                fresh = req.model_copy(update={"path": f"r{r}/{req.path}"})
                start = time.perf_counter()
                got = engine.run_sync("code-small", "tab.suggest", FULL, fresh, "bench")
                jobs.append({"ms": (time.perf_counter() - start) * 1000,
                             "prompt": got.prompt_tokens, "cached": got.cached_tokens,
                             "completion": got.completion_tokens})
    finally:
        engine.close()
    return {"generate_prompt_tok_s": statistics.median(rates), "fitted_threads": threads,
            "tab_suggest_ms": statistics.median(j["ms"] for j in jobs),
            "tab_suggest_rows": jobs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=2, help="held-out prompts")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=34)
    ap.add_argument("--variants", nargs="+", default=[*RAW, "product"],
                    choices=[*RAW, "product"])
    args = ap.parse_args()
    settings = load_settings()
    spec = ModelRegistry(settings).get("code-small")
    model = LocalModel(spec, settings)
    reqs = requests(args.cases, args.seed)
    prompts = [prompt_tokens(model, r) for r in reqs]
    path = Path(model.llama.model_path)
    model.llama.close()
    print(f"prompts: {[len(p) for p in prompts]} tokens; load {os.getloadavg()}")
    for name in args.variants:
        got = product(settings, reqs, prompts, args.repeats) if name == "product" else \
            raw(path, settings.engine.n_ctx, RAW[name], prompts, args.repeats)
        shown = {k: (round(v, 1) if isinstance(v, float) else v) for k, v in got.items()}
        print(f"{name}: {shown}; load {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
