"""Local engine benchmark: load time, prompt and decode speed, FIM latency cold vs cached.

    python bench/models.py [--models code-small code-medium] [--sizes 256 1024 4096]

FIM prompts are cut from a real source file (httpx's client module, installed with codeplane),
so token statistics are those of real code. "cold" clears the KV cache first; "cached" repeats
the same request (full prefix hit); "typed" appends one character at the cursor, the common
case while typing (with prefix-suffix-middle layout the suffix after the cursor is re-evaluated).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import httpx

from codeplane.config import load_settings
from codeplane.models.engine import Engine, LocalModel, Sampling

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
    gen = model.generate(tokens, Sampling(max_tokens=max_tokens))
    return time.perf_counter() - start, gen


def bench_model(engine: Engine, name: str, sizes: list[int], repeats: int) -> None:
    start = time.perf_counter()
    model = engine.run_sync(name, lambda m: m)
    print(f"\n## {name}\nload: {time.perf_counter() - start:.2f} s")

    def measure(m: LocalModel) -> None:
        prefix, suffix = fim_case(m, 1024)
        m.llama.reset()
        gen = m.generate(m.fim_tokens(prefix, suffix), Sampling(max_tokens=1))
        print(f"prompt eval (1,024-token FIM prompt, cold): "
              f"{gen.prompt_tokens / gen.prompt_seconds:.0f} tok/s")
        chat = m.chat_tokens([{"role": "user", "content": "Write a long Python module that "
                               "implements a priority queue with tests."}])
        rates = []
        for _ in range(repeats):
            gen = m.generate(chat, Sampling(max_tokens=128))
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

    engine.run_sync(model.name, measure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["code-small", "code-medium"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    settings = load_settings()
    print(f"source: {SOURCE}; n_ctx {settings.engine.n_ctx}; FIM latency = 16 new tokens")
    for name in args.models:
        engine = Engine(settings)
        try:
            bench_model(engine, name, args.sizes, args.repeats)
        finally:
            engine.close()


if __name__ == "__main__":
    main()
