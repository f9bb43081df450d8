"""Local model benchmark: load time, prompt and decode speed, FIM latency cold vs cached.

    python bench/models.py [--models code-small code-medium] [--sizes 256 1024 4096]
                           [--extra-buffer-types off|on|both] [--round-trips N]
    python bench/models.py --embedder-round-trips N

The model is loaded in this process (`LocalModel`, what each engine worker runs), so the
numbers are llama.cpp's; the worker boundary costs one round trip per request: with
`--round-trips N` an engine worker answers N small jobs (the chat tokens of a short message)
and the same call in this process is timed alike. `--extra-buffer-types` loads with llama.cpp's extra buffer
types (weight repacking: CPU_REPACK, AMX) off (the engine's default), on, or both in turn.
`--embedder-round-trips N` times the local embedder in this process against the engine's
embedder worker instead.

FIM prompts are cut from a real source file (httpx's client module, installed with codeplane),
so token statistics are those of real code. "cold" clears the KV cache first; "cached" repeats
the same request (full prefix hit); "typed" appends one character at the cursor, the common
case while typing (with prefix-suffix-middle layout the suffix after the cursor is re-evaluated).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from codeplane.config import Settings, load_settings
from codeplane.models.embedders import Embedders
from codeplane.models.engine import Decoding, Engine, LocalModel
from codeplane.models.registry import ModelRegistry

SOURCE = Path(httpx.__file__).parent / "_client.py"


def fim_case(model: LocalModel, size: int) -> tuple[str, str]:
    """Prefix/suffix around a line start in SOURCE, about `size` tokens in total (3:1 split)."""
    text = SOURCE.read_text()
    tokens = model.tokenize(text)
    cut = len(tokens) // 2
    before = model.detokenize(tokens[max(0, cut - size * 3 // 4):cut])
    after = model.detokenize(tokens[cut:cut + size // 4])
    head, _, line = before.rpartition("\n")
    return head + "\n" + line, after


def timed(model: LocalModel, tokens: list[int], max_tokens: int) -> tuple[float, object]:
    start = time.perf_counter()
    gen = model.generate(tokens, Decoding(max_tokens=max_tokens))
    return time.perf_counter() - start, gen


def bench_model(settings: Settings, name: str, sizes: list[int], repeats: int,
                round_trips: int) -> None:
    start = time.perf_counter()
    m = LocalModel(ModelRegistry(settings).get(name), settings)
    extra = "on" if m.info().extra_buffer_types else "off"
    print(f"\n## {name}, extra buffer types {extra}\nload: {time.perf_counter() - start:.2f} s")
    try:
        measure(m, sizes, repeats)
        if round_trips:
            boundary(settings, m, round_trips)
    finally:
        m.llama.close()


def boundary(settings: Settings, m: LocalModel, count: int) -> None:
    """Milliseconds per call of a small job through an engine worker vs in this process."""
    ask = [{"role": "user", "content": "Write a function that adds two numbers."}]
    engine = Engine(settings)
    try:
        engine.info(m.name)
        interleaved({"in this process": lambda: m.chat_tokens(ask),
                     "engine worker": lambda: engine.run_sync(m.name, "chat_tokens", ask)},
                    count, "chat_tokens")
    finally:
        engine.close()


def embedder_boundary(settings: Settings, count: int) -> None:
    """The local embedder in this process vs in the engine's worker (what the server runs):
    a search query, and a batch of 64 chunks as indexing sends them."""
    chunks = [SOURCE.read_text()[i * 600:(i + 1) * 600] for i in range(64)]
    engine = Engine(settings)
    try:
        here, worker = Embedders().index(), Embedders(engine=engine).index()
        worker.embed(["load"]), here.embed(["load"])
        print("\n## local embedder (bge-small-code)")
        for what, texts, calls in (("a query", ["parse the retry header"], count),
                                   ("64 chunks of 600 chars", chunks, max(3, count // 20))):
            interleaved({"in this process": lambda t=texts: here.embed(t),
                         "engine worker": lambda t=texts: worker.embed(t)}, calls, what)
    finally:
        engine.close()


def interleaved(ways: dict[str, Callable[[], object]], count: int, what: str) -> None:
    """Each way called `count` times, in turn (contention hits all alike); p50/p95 in ms."""
    times: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(count):
        for way, call in ways.items():
            start = time.perf_counter()
            call()
            times[way].append((time.perf_counter() - start) * 1000)
    for way, ms in times.items():
        ms.sort()
        print(f"{way}: p50 {statistics.median(ms):.2f} ms, p95 {ms[int(len(ms) * 0.95)]:.2f} "
              f"ms ({count} calls, {what})")


def measure(m: LocalModel, sizes: list[int], repeats: int) -> None:
    prefix, suffix = fim_case(m, 1024)
    rates = []
    for _ in range(repeats):
        m.llama.reset()
        gen = m.generate(m.fim_tokens(prefix, suffix), Decoding(max_tokens=1))
        rates.append(gen.prompt_tokens / gen.prompt_seconds)
    print(f"prompt eval (1,024-token FIM prompt, cold): {statistics.median(rates):.0f} tok/s "
          f"(median of {repeats})")
    chat = m.chat_tokens([{"role": "user", "content": "Write a long Python module that "
                           "implements a priority queue with tests."}])
    rates = []
    for _ in range(repeats):
        gen = m.generate(chat, Decoding(max_tokens=128))
        rates.append((gen.completion_tokens - 1) / max(gen.decode_seconds, 1e-9))
    print(f"decode: {statistics.median(rates):.1f} tok/s (median of {repeats}, 128 tokens)")
    print("| prompt tokens | cold ms | cached ms | typed one char ms |")
    print("|---|---|---|---|")
    for size in sizes:
        prefix, suffix = fim_case(m, size)
        tokens = m.fim_tokens(prefix, suffix)
        colds, cacheds, typeds = [], [], []
        for _ in range(repeats):
            m.llama.reset()
            colds.append(timed(m, tokens, 16)[0])
            cacheds.append(timed(m, tokens, 16)[0])
            typeds.append(timed(m, m.fim_tokens(prefix + "s", suffix), 16)[0])
        print(f"| {len(tokens)} | {statistics.median(colds) * 1000:.0f} | "
              f"{statistics.median(cacheds) * 1000:.0f} | "
              f"{statistics.median(typeds) * 1000:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["code-small", "code-medium"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--extra-buffer-types", choices=["off", "on", "both"], default="off")
    parser.add_argument("--round-trips", type=int, default=0,
                        help="also time this many small jobs through an engine worker")
    parser.add_argument("--embedder-round-trips", type=int, default=0,
                        help="time this many embeddings through an engine worker, then stop")
    args = parser.parse_args()
    settings = load_settings()
    if args.embedder_round_trips:
        return embedder_boundary(settings, args.embedder_round_trips)
    print(f"source: {SOURCE}; n_ctx {settings.engine.n_ctx}; FIM latency = 16 new tokens")
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.extra_buffer_types]
    for name in args.models:
        for extra in modes:
            engine = settings.engine.model_copy(update={"extra_buffer_types": extra})
            bench_model(settings.model_copy(update={"engine": engine}), name, args.sizes,
                        args.repeats, args.round_trips)


if __name__ == "__main__":
    main()
