"""Sampler/trainer numerics: how far llama.cpp's log-probs are from the torch trainer's on the
same tokens, what truncated importance sampling (TIS) does about it, and both samplers' speed.

1. One LoRA (random B matrices, so the adapter really changes the model) is loaded into the
   torch policy and, as a GGUF adapter, into the llama.cpp engine.
2. Both samplers answer the same prompts at temperature 1 (tokens/s of each).
3. The llama.cpp sampler's tokens are scored by the torch policy: per-token |delta logprob|
   mean/p50/p95 and the importance ratio pi_torch / pi_llama; the torch sampler's own tokens
   are the control (its gap is only batching noise).
4. One trainer step on the llama.cpp rollouts (pairs rewarded 1/0) with TIS off and with the
   cap C: loss, grad norm and the share of tokens whose ratio hit the cap.

With `--also-dtype bfloat16` the llama.cpp tokens (and the float32 torch sampler's) are also
scored by the trainer with its base weights in bfloat16 (`TrainerConfig.dtype`).

Usage (wrap in the CPU lock on shared machines):
  flock /tmp/codeplane-cpu.lock python bench/rl/mismatch.py [--prompts 8] [--max-tokens 48] \
      [--also-dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from codeplane.config import load_settings
from codeplane.core.chat import Sampling, Turn
from codeplane.models.engine import Engine
from codeplane.rl.adapter import LlamaSampler
from codeplane.rl.algorithms import mismatch_stats
from codeplane.rl.policy import TorchSampler
from codeplane.rl.trainer import PolicyTrainer, TrainerConfig
from codeplane.rl.types import Episode, Sample

PROMPTS = [
    "Write a Python function that reverses a string.",
    "What does `git rebase` do? One sentence.",
    "Explain a Python list comprehension briefly.",
    "Write a bash one-liner counting lines in all .py files.",
    "How do I read a JSON file in Python?",
    "What is the difference between a tuple and a list?",
    "Write a regex matching an IPv4 address.",
    "Name three HTTP methods and what they do.",
    "Write a SQL query selecting the ten newest rows of a table `events`.",
    "What is a Python decorator?",
    "Write a function computing the n-th Fibonacci number iteratively.",
    "How do you create a virtual environment in Python?",
]


def sample_all(sampler, n: int, max_tokens: int) -> tuple[list[Turn], float]:
    turns, tokens, start = [], 0, time.perf_counter()
    for prompt in PROMPTS[:n]:
        turn = sampler.complete([{"role": "user", "content": prompt}], [],
                                Sampling(max_tokens=max_tokens, temperature=1.0))
        turns.append(turn)
        tokens += len(turn.token_ids or [])
    return turns, tokens / (time.perf_counter() - start)


def score(trainer: PolicyTrainer, turns: list[Turn]) -> dict[str, float]:
    with torch.no_grad():
        trainer_lp = torch.cat([trainer.policy.completion_logprobs(
            [(t.prompt_ids, t.token_ids)])[0].double() for t in turns])
    sampler_lp = torch.cat([torch.tensor(t.logprobs, dtype=torch.float64) for t in turns])
    return {k: round(v, 4) for k, v in mismatch_stats(trainer_lp, sampler_lp).items()}


def groups_of(turns: list[Turn]) -> list[list[Episode]]:
    """Consecutive pairs as groups, rewarded 1 and 0 (any informative labelling serves: the
    question is how TIS changes the same update)."""
    episodes = [Episode(f"t{i // 2}", f"g{i // 2}",
                        [Sample(t.prompt_ids or [], t.token_ids or [], t.logprobs or [], 0)],
                        float(i % 2 == 0)) for i, t in enumerate(turns)]
    return [episodes[i:i + 2] for i in range(0, len(episodes) - 1, 2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--tis-cap", type=float, default=2.0)
    parser.add_argument("--lora-scale", type=float, default=0.02,
                        help="std of the random LoRA B matrices")
    parser.add_argument("--also-dtype", choices=["bfloat16"], default=None,
                        help="also score the llama.cpp tokens with the trainer in this dtype")
    args = parser.parse_args()
    settings = load_settings()
    config = TrainerConfig(lora_rank=16, lora_alpha=32.0, tis_cap=None, micro_batch=4)
    trainer = PolicyTrainer(config, settings)
    gen = torch.Generator().manual_seed(0)
    lora = {k: (torch.randn(v.shape, generator=gen) * args.lora_scale if "lora_B" in k else v)
            for k, v in trainer.weights().items()}
    trainer.policy.load_lora_state(lora)
    engine = Engine(settings)
    result: dict[str, object] = {"prompts": args.prompts, "max_tokens": args.max_tokens}
    with tempfile.TemporaryDirectory() as adapters:
        llama = LlamaSampler(engine, config.model, Path(adapters), config.lora_alpha, seed=1)
        engine.info(config.model)  # load it: time only the swap
        start = time.perf_counter()
        llama.load_weights(lora, version=1)
        result["adapter_swap_seconds"] = round(time.perf_counter() - start, 3)
        llama_turns, result["llama_tokens_per_s"] = sample_all(llama, args.prompts,
                                                               args.max_tokens)
    engine.close()
    torch_turns, result["torch_tokens_per_s"] = sample_all(
        TorchSampler(trainer.policy, seed=1), args.prompts, args.max_tokens)
    result["llama_vs_torch"] = score(trainer, llama_turns)
    result["torch_vs_torch"] = score(trainer, torch_turns)
    if args.also_dtype:  # the same adapter, the same tokens, the base in another precision
        other = PolicyTrainer(config.model_copy(update={"dtype": args.also_dtype}), settings)
        other.policy.load_lora_state(lora)
        result[f"llama_vs_torch_{args.also_dtype}"] = score(other, llama_turns)
        result[f"torch_vs_torch_{args.also_dtype}"] = score(other, torch_turns)
        del other
    groups = groups_of(llama_turns)
    snapshot = trainer.weights()
    for cap in (None, args.tis_cap):
        trainer.config = config.model_copy(update={"tis_cap": cap})
        trainer.policy.load_lora_state(snapshot)
        metrics = trainer.step(groups)
        result[f"step_tis_{cap}"] = {k: round(metrics[k], 5) for k in
                                     ("loss", "grad_norm", "tis_truncated", "tokens")}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
