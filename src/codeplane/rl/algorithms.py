"""Policy-gradient maths for groups of rollouts: advantages, the clipped surrogate, truncated
importance sampling and the KL to the reference. Pure torch on plain tensors, so every formula
is unit-tested with hand-computed numbers and the trainer only gathers tensors.

Conventions (one row per completion token of the batch):
- `logp` is the trainer's log-prob of the sampled token with gradients, `logp_old` the same
  policy's before this step's update (no gradient), `logp_sampler` what the sampler reported.
- PPO ratio = exp(logp - logp_old), clipped to [1 - eps_low, 1 + eps_high] (DAPO's
  clip-higher when eps_high > eps_low).
- Truncated importance sampling (TIS): the sampler is another engine (llama.cpp, quantized) or
  an older version, so its tokens come from a slightly different distribution; each token's
  loss is weighted by min(exp(logp_old - logp_sampler), cap) (Yao et al., "off-policy RL").
- KL to the reference uses the k3 estimator exp(ref - logp) - (ref - logp) - 1 (>= 0,
  unbiased), as GRPO does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

Advantage = Literal["grpo", "dr_grpo", "rloo"]
LossAgg = Literal["token", "sequence", "constant"]

# Each estimator's own way of averaging token losses (what its paper prescribes): GRPO averages
# per response then over responses; Dr. GRPO divides by a constant token budget (no 1/|o|
# length bias); RLOO (as DeepSWE and DAPO use it) averages over all tokens of the batch.
DEFAULT_AGG: dict[str, LossAgg] = {"grpo": "sequence", "dr_grpo": "constant", "rloo": "token"}


def group_advantages(rewards: torch.Tensor, method: Advantage,
                     eps: float = 1e-6) -> torch.Tensor:
    """One advantage per rollout of a group that started from the same task.

    grpo: (r - mean) / (std + eps), std with Bessel's correction (as TRL computes it).
    dr_grpo: r - mean (Dr. GRPO: dividing by std over-weights near-solved or near-hopeless
    groups). rloo: r_i - mean of the *other* rollouts, i.e. G/(G-1) * (r - mean)."""
    rewards = rewards.to(torch.float64)
    centred = rewards - rewards.mean()
    if method == "grpo":
        std = rewards.std() if rewards.numel() > 1 else rewards.new_zeros(())
        return centred / (std + eps)
    if method == "dr_grpo":
        return centred
    if method == "rloo":
        n = rewards.numel()
        return centred * (n / (n - 1)) if n > 1 else torch.zeros_like(rewards)
    raise ValueError(f"unknown advantage estimator {method!r}")


def informative(rewards: Sequence[float]) -> bool:
    """False for a group whose rewards are all equal: every advantage is zero, so it adds no
    gradient, only noise in the normalisation (DAPO's dynamic sampling drops it)."""
    return len(rewards) > 1 and max(rewards) != min(rewards)


def token_weights(lengths: Sequence[int], agg: LossAgg, budget: int) -> torch.Tensor:
    """Per-token weights w so that loss = sum(w * token_loss) over the batch.

    `lengths` are the completion-token counts of each rollout (all its turns); `budget` is
    Dr. GRPO's constant (the generation budget per rollout)."""
    n_seq = len(lengths)
    if agg == "token":
        total = sum(lengths)
        per = [1.0 / total] * n_seq if total else [0.0] * n_seq
    elif agg == "sequence":
        per = [1.0 / (n_seq * n) if n else 0.0 for n in lengths]
    elif agg == "constant":
        per = [1.0 / (n_seq * budget)] * n_seq
    else:
        raise ValueError(f"unknown loss aggregation {agg!r}")
    return torch.tensor([w for w, n in zip(per, lengths, strict=True) for _ in range(n)],
                        dtype=torch.float64)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[target] per row: the log-prob of each sampled token."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@dataclass
class LossParts:
    """The loss (with gradient) and the statistics the trainer reports, weighted like it."""

    loss: torch.Tensor
    kl: float
    clip_fraction: float
    tis_truncated: float  # share of tokens whose importance weight hit the cap


def policy_loss(logp: torch.Tensor, logp_old: torch.Tensor, logp_sampler: torch.Tensor,
                advantages: torch.Tensor, weights: torch.Tensor, *, eps_low: float,
                eps_high: float, tis_cap: float | None, kl_beta: float = 0.0,
                logp_ref: torch.Tensor | None = None) -> LossParts:
    """Clipped surrogate with TIS weights and an optional KL penalty, summed with `weights`.

    All arguments are flat per-token tensors of the same length (a micro-batch's slice of the
    batch; `weights` carry the whole batch's normalisation, so micro-batch losses add up to
    the full-batch loss)."""
    weights = weights.to(logp.dtype)
    advantages = advantages.to(logp.dtype)
    ratio = torch.exp(logp - logp_old)
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    surrogate = torch.minimum(ratio * advantages, clipped * advantages)
    truncated = torch.zeros_like(logp, dtype=torch.bool)
    if tis_cap is not None:
        is_weight = torch.exp(logp_old - logp_sampler.to(logp.dtype))
        truncated = is_weight > tis_cap
        surrogate = surrogate * is_weight.clamp(max=tis_cap)
    per_token = -surrogate
    kl = torch.zeros_like(logp)
    if logp_ref is not None:
        delta = logp_ref.to(logp.dtype) - logp
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + kl_beta * kl
    loss = (per_token * weights).sum()
    was_clipped = (ratio - clipped).abs() > 0
    share = weights / weights.sum() if float(weights.sum()) > 0 else weights
    return LossParts(
        loss=loss,
        kl=float((kl.detach() * share).sum()),
        clip_fraction=float((was_clipped.to(share.dtype) * share).sum()),
        tis_truncated=float((truncated.to(share.dtype) * share).sum()),
    )


def mismatch_stats(logp_trainer: torch.Tensor, logp_sampler: torch.Tensor) -> dict[str, float]:
    """How far the sampler's numbers are from the trainer's on the same tokens: per-token
    |delta logprob| mean/p50/p95, the importance ratio's spread and the k1 estimate of
    KL(sampler || trainer)."""
    if logp_trainer.numel() == 0:
        return {}
    delta = (logp_trainer.detach().double() - logp_sampler.double())
    ratio = torch.exp(delta)
    gap = delta.abs()
    return {
        "mismatch_abs_mean": float(gap.mean()),
        "mismatch_abs_p50": float(gap.quantile(0.5)),
        "mismatch_abs_p95": float(gap.quantile(0.95)),
        "mismatch_kl": float((-delta).mean()),
        "is_ratio_min": float(ratio.min()),
        "is_ratio_p05": float(ratio.quantile(0.05)),
        "is_ratio_p95": float(ratio.quantile(0.95)),
        "is_ratio_max": float(ratio.max()),
    }
