"""The cost of serving an adapter model on its base's worker: what a request pays when the
worker's LoRA slot holds another adapter (swap) and its KV cache was emptied (refill).

A random LoRA on every layer's q and v projections (rank 8, as RL writes its policies) is
registered on the base in a scratch CODEPLANE_HOME, then per round on one prompt:

  swap       a job that does no model work (`render_chat`) for the adapter model, then for
             the base: the adapter loaded and applied, or removed (plus the job's round trip)
  base cold  the base answering (1 token) right after those swaps emptied the cache: the
             prefill of the whole prompt with no adapter, the baseline for the two below
  base warm  the base answering (1 token) with its prompt's prefix in the KV cache
  adapter    the adapter model answering the same prompt right after the base: swap +
             prefill of the whole prompt (the cache was emptied)
  base back  the base again: swap back + prefill again

Usage (needs the [rl] extra for torch; on shared machines under the CPU lock):
  flock /tmp/codeplane-cpu.lock python bench/serve_adapter.py --model code-small --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from gguf import GGUFReader

from codeplane.config import load_settings
from codeplane.models.engine import Decoding, Engine
from codeplane.models.lora import write_gguf_adapter
from codeplane.models.registry import BUILTIN, ModelRegistry

RANK = 8
PROMPT = [{"role": "user", "content": "Explain what this function does:\n\n" + "\n".join(
    f"def step_{i}(state):\n    state['count_{i}'] = state.get('count_{i}', 0) + {i}\n"
    for i in range(12))}]


def random_adapter(weights: Path, out: Path) -> Path:
    reader = GGUFReader(str(weights))
    arch = str(reader.fields["general.architecture"].contents())
    shapes = {t.name: [int(n) for n in t.shape] for t in reader.tensors}
    state = {}
    for layer in range(int(reader.fields[f"{arch}.block_count"].contents())):
        for module, tensor in (("q_proj", "attn_q"), ("v_proj", "attn_v")):
            width, height = shapes[f"blk.{layer}.{tensor}.weight"]
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            state[f"{key}.lora_A.weight"] = torch.randn(RANK, width) / width ** 0.5
            state[f"{key}.lora_B.weight"] = torch.randn(height, RANK) * 0.05
    return write_gguf_adapter(state, out, arch, 16.0)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="code-small")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    shared = load_settings().models_dir
    with tempfile.TemporaryDirectory() as scratch:
        home = Path(scratch)
        (home / "models").mkdir()
        for weights in shared.glob("*.gguf*"):
            (home / "models" / weights.name).symlink_to(weights)
        settings = load_settings(home=home)
        registry = ModelRegistry(settings)
        spec = next(s for s in BUILTIN if s.name == args.model)
        adapter = random_adapter(spec.file_path(settings), home / "adapter.gguf")
        engine = Engine(settings, registry)
        try:
            registry.add_adapter("bench-adapter", adapter, args.model, 1.0,
                                 lambda base, file: engine.run_sync(base, "check_lora", file))
            run(engine, args.model, "bench-adapter", args.rounds)
        finally:
            engine.close()


def run(engine: Engine, base: str, adapted: str, rounds: int) -> None:
    one = Decoding(max_tokens=1)
    prompt_tokens = len(engine.run_sync(base, "chat_tokens", PROMPT, None))
    samples: dict[str, list[float]] = {"swap in": [], "swap out": [], "base cold": [],
                                       "base warm": [], "adapter": [], "base back": []}
    for _ in range(rounds):
        samples["swap in"].append(timed(lambda: engine.run_sync(adapted, "render_chat",
                                                                PROMPT, None)))
        samples["swap out"].append(timed(lambda: engine.run_sync(base, "render_chat",
                                                                 PROMPT, None)))
        samples["base cold"].append(timed(lambda: engine.run_sync(
            base, "chat_generate", PROMPT, None, one)))
        samples["base warm"].append(timed(lambda: engine.run_sync(
            base, "chat_generate", PROMPT, None, one)))
        samples["adapter"].append(timed(lambda: engine.run_sync(
            adapted, "chat_generate", PROMPT, None, one)))
        samples["base back"].append(timed(lambda: engine.run_sync(
            base, "chat_generate", PROMPT, None, one)))
    print(f"model {base}, prompt {prompt_tokens} tokens, {rounds} rounds (median, max; s)")
    for name, values in samples.items():
        print(f"  {name:10s} {statistics.median(values):7.3f} {max(values):7.3f}")


if __name__ == "__main__":
    main()
