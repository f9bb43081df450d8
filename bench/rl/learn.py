"""Learning sanity check for the trainer + llama.cpp sampler loop, without environments.

Task: "Name a fruit. One word." Reward 1 when the answer contains the target fruit (default
"banana": code-small says it about a quarter of the time at temperature 1). Each step samples
`--groups` groups of `--group-size` answers with the current LoRA swapped into llama.cpp,
trains one GRPO step on them in torch and ships the new adapter back. If the trainer, the
advantages, the GGUF export and the swap all work, the reward rises within a few steps.

Usage (wrap in the CPU lock on shared machines):
  flock /tmp/codeplane-cpu.lock python bench/rl/learn.py [--steps 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from codeplane.config import load_settings
from codeplane.core.chat import Sampling
from codeplane.models.engine import Engine
from codeplane.rl.adapter import LlamaSampler
from codeplane.rl.trainer import PolicyTrainer, TrainerConfig
from codeplane.rl.types import Episode, Sample

PROMPT = [{"role": "user", "content": "Name a fruit. One word."}]


def rollouts(sampler: LlamaSampler, target: str, groups: int, size: int, max_tokens: int
             ) -> list[list[Episode]]:
    out = []
    for g in range(groups):
        group = []
        for _ in range(size):
            turn = sampler.complete(PROMPT, [], Sampling(max_tokens=max_tokens,
                                                         temperature=1.0))
            text = (turn.message.get("content") or "").lower()
            sample = Sample(turn.prompt_ids or [], turn.token_ids or [], turn.logprobs or [],
                            turn.policy_version or 0)
            group.append(Episode("fruit", f"g{g}", [sample], float(target in text), steps=1))
        out.append(group)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--target", default="banana")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--json", action="store_true", help="one JSON object at the end")
    args = parser.parse_args()
    settings = load_settings()
    config = TrainerConfig(lr=args.lr, lora_rank=8, lora_alpha=16.0, advantage="grpo",
                           micro_batch=8, seed=0)
    trainer = PolicyTrainer(config, settings)
    engine = Engine(settings)
    history = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as adapters:
        sampler = LlamaSampler(engine, config.model, Path(adapters), config.lora_alpha, seed=7)
        sampler.load_weights(trainer.weights(), trainer.version)
        for step in range(args.steps + 1):
            t0 = time.perf_counter()
            groups = rollouts(sampler, args.target, args.groups, args.group_size,
                              args.max_tokens)
            rewards = [e.reward for g in groups for e in g]
            row = {"step": step, "reward_mean": sum(rewards) / len(rewards),
                   "sample_seconds": round(time.perf_counter() - t0, 1)}
            if step < args.steps:  # the last round only measures the final policy
                t1 = time.perf_counter()
                metrics = trainer.step(groups)
                sampler.load_weights(trainer.weights(), trainer.version)
                row |= {"train_seconds": round(time.perf_counter() - t1, 1),
                        **{k: round(metrics[k], 4) for k in
                           ("loss", "grad_norm", "groups_kept", "mismatch_abs_mean",
                            "tis_truncated") if k in metrics}}
            history.append(row)
            if not args.json:
                print(json.dumps(row), flush=True)
    engine.close()
    summary = {"steps": args.steps, "reward_first": history[0]["reward_mean"],
               "reward_last": history[-1]["reward_mean"],
               "seconds": round(time.perf_counter() - started, 1), "history": history}
    print(json.dumps(summary if args.json else {k: v for k, v in summary.items()
                                                 if k != "history"}))


if __name__ == "__main__":
    main()
