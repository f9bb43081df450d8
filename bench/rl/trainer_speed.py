"""Seconds, tokens/s and peak resident memory of one trainer step per `dtype` (issues 31, 34).

Two steps on fixed inputs, each measurement in a fresh process (VmHWM is per process):
- `rl`: one `PolicyTrainer.step` on one group of 4 episodes shaped as the sixth
  product-environment run's first training episodes (each turn's prompt and completion
  length from its transcripts, 3 turns packed per row by `rows_of`), with the trainer of
  examples/rl/product-rl2.toml: LoRA rank 8, `kl_beta` 0.1 to the warm start
  `product-warm` (`start_from` with its optimiser), micro_batch 1. The transcripts keep no
  token ids, so the ids are real source text of this repository and the sampler log-probs
  the transcripts' own: the cost is real, the loss is not.
- `nextedit`: one `PolicyTrainer.imitate` on the first batch of 4 examples that
  `rl/nextedit.py` cuts from a repository's history, with train-next-edit's defaults
  (rank 16, lr 2e-4).

Usage (interleave the dtypes: A B A B; under the CPU lock, with the load written down):
  flock /tmp/codeplane-cpu.lock python bench/rl/trainer_speed.py rl float32 bfloat16 float32 bfloat16
  flock /tmp/codeplane-cpu.lock python bench/rl/trainer_speed.py nextedit float32 bfloat16 \
      --git /work/.mirror/pyinvoke+invoke/repo
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RUNS = Path.home() / ".codeplane" / "rl" / "runs"
TRANSCRIPTS = RUNS / "product-rl2-s0" / "transcripts"
WARM = RUNS / "product-warm" / "checkpoint"
ROOT = Path(__file__).resolve().parents[2]


def peak_gb() -> float:
    """This process's peak resident memory (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1e6
    return float("nan")


def text_ids(tokenizer, count: int) -> list[int]:
    """`count` token ids of real Python source (this repository's), cycled."""
    text = "".join(p.read_text() for p in sorted((ROOT / "src/codeplane/rl").glob("*.py")))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [ids[i % len(ids)] for i in range(count)]


def episodes(tokenizer, count: int = 4):
    """`count` episodes whose turns have the transcripts' prompt and completion lengths; each
    turn's prompt extends the previous turn's prompt and completion (one row per episode)."""
    from codeplane.rl.types import Episode, Sample

    out = []
    for n, path in enumerate(sorted(TRANSCRIPTS.glob("*.jsonl"))[:count]):
        turns = [json.loads(line) for line in path.read_text().splitlines()]
        turns = [t for t in turns if t["type"] == "model_turn"]
        source = text_ids(tokenizer, 8000 + n)[n:]  # another text per episode
        samples, prefix = [], 0
        for turn in turns:
            length = max(turn["usage"]["prompt_tokens"], prefix)
            completion = turn["usage"]["completion_tokens"]
            samples.append(Sample(source[:length], source[length:length + completion],
                                  turn["logprobs"][:completion], 0))
            prefix = length + completion
        out.append(Episode(f"t{n}", "g0", samples, float(n % 2 == 0), steps=len(samples)))
    return [out]


def nextedit_batch(tokenizer, git: Path, cases: int):
    from codeplane.rl.nextedit import Tokens, build_examples
    from codeplane.rl.types import Sample

    examples = build_examples({git.parent.name: git}, Tokens(tokenizer), cases, 1536, 0)[:4]
    return [Sample(e.prompt_ids, e.completion_ids, [0.0] * len(e.completion_ids), 0)
            for e in examples]


def measure(kind: str, dtype: str, git: Path | None, cases: int, count: int) -> dict:
    """One step of `kind` in `dtype` in this process."""
    import torch

    from codeplane.config import load_settings
    from codeplane.rl.trainer import PolicyTrainer, TrainerConfig, rows_of

    settings = load_settings()
    if kind == "rl":
        config = TrainerConfig(lora_rank=8, lora_alpha=16.0, lr=1e-4, kl_beta=0.1,
                               temperature=0.7, micro_batch=1, dtype=dtype)
    else:
        config = TrainerConfig(lora_rank=16, lora_alpha=32.0, lr=2e-4, dtype=dtype)
    loaded = time.perf_counter()
    trainer = PolicyTrainer(config, settings)
    loaded = time.perf_counter() - loaded
    tokenizer = trainer.policy.tokenizer
    if kind == "rl":
        trainer.start_from(str(WARM), optimizer=True)
        groups = episodes(tokenizer, count)
        samples = [s for g in groups for e in g for s in e.samples]
        metrics = trainer.step(groups)
    else:
        samples = nextedit_batch(tokenizer, git, cases)
        metrics = trainer.imitate(samples)
    tokens = sum(len(r.ids) for r in rows_of(samples))
    return {"kind": kind, "dtype": dtype, "seconds": round(metrics["seconds"], 1),
            "row_tokens": tokens, "row_tokens_per_s": round(tokens / metrics["seconds"], 1),
            "scored_tokens": int(metrics["tokens"]), "rows": len(rows_of(samples)),
            "peak_gb": round(peak_gb(), 2), "load_seconds": round(loaded, 1),
            "threads": torch.get_num_threads(), "loadavg": os.getloadavg()[0],
            **{k: round(metrics[k], 5) for k in ("loss", "nll", "grad_norm", "kl",
                                                  "mismatch_abs_mean") if k in metrics}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=["rl", "nextedit"])
    parser.add_argument("dtypes", nargs="+", choices=["float32", "bfloat16", "auto"])
    parser.add_argument("--git", type=Path, help="nextedit: the history to cut examples from")
    parser.add_argument("--cases", type=int, default=20, help="nextedit: cases cut")
    parser.add_argument("--episodes", type=int, default=4, help="rl: episodes in the group")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.kind == "nextedit" and args.git is None:
        parser.error("nextedit needs --git")
    if args.child:
        print(json.dumps(measure(args.kind, args.dtypes[0], args.git, args.cases,
                                 args.episodes)))
        return
    for dtype in args.dtypes:  # a fresh process each: its own peak memory
        extra = ["--git", str(args.git)] if args.git else []
        out = subprocess.run([sys.executable, __file__, args.kind, dtype, "--child",
                              "--cases", str(args.cases), "--episodes", str(args.episodes), *extra],
                             capture_output=True, text=True, check=True).stdout
        print(out.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
