"""How far a run that starts from a checkpoint's AdamW state (`init_optimizer`) moves on its
first update before any RL gradient: the carried first moment alone, in units of lr.

A fresh AdamW's first update moves every weight by exactly lr (lr x the gradient's sign);
with the init run's moments, the carried momentum pushes on in the init run's direction and
the new gradient enters with weight (1 - beta1) / (1 - beta1^t) over the carried sqrt(v).
Reads the saved state only (no model, no load dependence); prints one JSON object.

Usage:
  python bench/rl/carried_moments.py ~/.codeplane/rl/runs/product-warm/checkpoint
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def momentum_push(optimizer: dict) -> dict[str, float]:
    """|update| / lr of each weight at the next step with a zero gradient, summarised."""
    group = optimizer["param_groups"][0]
    (beta1, beta2), eps = group["betas"], group["eps"]
    states = list(optimizer["state"].values())
    t = float(states[0]["step"]) + 1
    m = torch.cat([s["exp_avg"].flatten() for s in states]).double()
    v = torch.cat([s["exp_avg_sq"].flatten() for s in states]).double()
    push = ((beta1 * m / (1 - beta1 ** t)) / ((beta2 * v / (1 - beta2 ** t)).sqrt() + eps)).abs()
    return {"steps_before": t - 1, "weights": push.numel(), "median": float(push.median()),
            "mean": float(push.mean()), "p90": float(push.quantile(0.9)),
            "max": float(push.max()), "share_ge_half": float((push >= 0.5).double().mean()),
            "new_gradient_weight": (1 - beta1) / (1 - beta1 ** t)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a run's checkpoint/ directory")
    args = parser.parse_args()
    state = torch.load(args.checkpoint.expanduser() / "trainer.pt", weights_only=True)
    print(json.dumps({k: round(v, 4) for k, v in momentum_push(state["optimizer"]).items()}))


if __name__ == "__main__":
    main()
