"""The PyTorch trainer: groups of episodes in, one optimiser step on the LoRA, metrics out.

Implements `rl.types.Trainer`. One `step(groups)`:
1. drops faulted episodes (compact filtering: a killed sandbox says nothing about the policy)
   and, by default, groups whose rewards are all equal (DAPO: zero advantage, no signal);
2. scores each group's episodes with the configured estimator (GRPO, Dr. GRPO, RLOO), every
   completion token of an episode carrying its episode's advantage; prompt and tool-output
   tokens are never scored (they are `Sample.prompt_ids`);
3. recomputes the sampled tokens' log-probs in torch (micro-batches, gradients accumulated so
   the sum equals the full-batch loss), weights them by the truncated importance ratio against
   the sampler's own log-probs, adds the optional KL to the reference (the base model, or the
   policy the run started from: `start_from`), and takes one AdamW step with gradient
   clipping.

Checkpoints hold the adapter, the optimiser, the version and the RNG states: a killed trainer
that loads one computes the same next loss as the one that wrote it.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from codeplane.config import Settings
from codeplane.rl.algorithms import (
    DEFAULT_AGG,
    LossAgg,
    group_advantages,
    informative,
    mismatch_stats,
    policy_loss,
    token_weights,
)
from codeplane.rl.policy import LoraShape, Policy, Row, model_weights, resolve_dtype
from codeplane.rl.types import DtypeName, Episode, Sample

CHECKPOINT = "trainer.pt"


class TrainerConfig(BaseModel):
    """What a run's TOML `[trainer]` table holds."""

    model_config = ConfigDict(extra="forbid")

    model: str = "code-small"
    lr: float = Field(5e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    lora_rank: int = Field(16, ge=1)
    lora_alpha: float = Field(32.0, gt=0)
    advantage: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    loss_agg: LossAgg | None = None  # None: the estimator's own (algorithms.DEFAULT_AGG)
    token_budget: int = Field(1024, ge=1)  # Dr. GRPO's constant normaliser, tokens/episode
    eps_low: float = Field(0.2, ge=0)
    eps_high: float = Field(0.28, ge=0)  # > eps_low: DAPO's clip-higher
    kl_beta: float = Field(0.0, ge=0)  # 0: no reference forward at all
    tis_cap: float | None = Field(2.0, gt=0)  # None: no importance correction
    temperature: float = Field(1.0, gt=0)  # must equal the samplers' temperature
    # rows (`rows_of`: an episode's turns, or one turn) per forward/backward: activations grow
    # with a row's length, and a product agent's turn is long (docs/rl.md, "The trainer": 4
    # ran out of memory)
    micro_batch: int = Field(1, ge=1)
    epochs: int = Field(1, ge=1)  # optimiser steps per batch; clipping acts from the 2nd
    max_grad_norm: float = Field(1.0, gt=0)
    drop_zero_variance: bool = True
    seed: int = 0
    # the frozen base weights' precision (`policy.lower_precision`); "auto": bfloat16 where
    # the CPU has it natively (docs/rl.md, "The trainer in bfloat16")
    dtype: DtypeName = "float32"


class _Item:
    """One sample of the batch with its episode's advantage and its tokens' loss weights."""

    def __init__(self, sample: Sample, advantage: float, weights: torch.Tensor) -> None:
        if len(sample.logprobs) != len(sample.completion_ids):
            raise ValueError(f"sample has {len(sample.completion_ids)} completion tokens but "
                             f"{len(sample.logprobs)} logprobs")
        self.sample = sample
        self.advantages = torch.full((len(sample.completion_ids),), advantage,
                                     dtype=torch.float64)
        self.weights = weights
        self.sampler_logp = torch.tensor(sample.logprobs, dtype=torch.float64)


def rows_of(samples: list[Sample]) -> list[Row]:
    """Samples as forward-pass rows. A turn whose prompt begins with the row before it (the
    next turn of one episode, when the chat template re-renders the history token for token)
    extends that row: attention is causal, so each completion is scored given only what
    precedes it, and one pass over an episode's last turn scores all its turns, at the cost of
    the longest turn instead of the sum of them."""
    rows: list[Row] = []
    for s in samples:
        ids, span = [*s.prompt_ids, *s.completion_ids], (len(s.prompt_ids), len(s.completion_ids))
        last = rows[-1] if rows else None
        if last is not None and s.prompt_ids[:len(last.ids)] == last.ids:
            rows[-1] = Row(ids, [*last.spans, span])
        else:
            rows.append(Row(ids, [span]))
    return rows


def micro_batches(samples: list[Sample], size: int) -> list[list[int]]:
    """Sample indices, `size` rows (`rows_of`) per micro-batch, a row never split."""
    chunks, at = [], 0
    rows = rows_of(samples)
    for start in range(0, len(rows), size):
        count = sum(len(r.spans) for r in rows[start:start + size])
        chunks.append(list(range(at, at + count)))
        at += count
    return chunks


class PolicyTrainer:
    """`rl.types.Trainer` over a torch `Policy` with a LoRA adapter."""

    def __init__(self, config: TrainerConfig, settings: Settings) -> None:
        self.config = config
        gguf = model_weights(config.model, settings)
        self.policy = Policy(gguf, LoraShape(config.lora_rank, config.lora_alpha), config.seed,
                             resolve_dtype(config.dtype))
        params = [p for p in self.policy.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=config.lr,
                                           weight_decay=config.weight_decay)
        self.version = 0
        random.seed(config.seed)

    # -- the step ------------------------------------------------------------------------

    def step(self, groups: list[list[Episode]]) -> dict[str, float]:
        started = time.perf_counter()
        items, info = self._batch(groups)
        if not items:
            return self._skipped(info)
        old = self._old_logprobs(items)
        metrics, scored = self._update(items, old)
        for _ in range(self.config.epochs - 1):
            self._update(items, old)
        self.version += 1
        trainer_logp = torch.cat(scored)  # before the update: what the sampler should match
        sampler_logp = torch.cat([it.sampler_logp for it in items])
        staleness = [self.version - 1 - it.sample.version for it in items]
        return {**info, **metrics, **mismatch_stats(trainer_logp, sampler_logp),
                "staleness_mean": sum(staleness) / len(staleness),
                "tokens": float(sampler_logp.numel()), "samples": float(len(items)),
                "seconds": time.perf_counter() - started, "version": float(self.version)}

    def nothing_to_learn(self, groups: list[list[Episode]]) -> dict[str, float] | None:
        """The metrics of a skipped step when `step` would keep no group (all faulted, or no
        reward variance under `drop_zero_variance`), else None. The run asks before it
        takes `train_lock`: such a step must not wait for another seed's trainer for
        nothing (docs/rl.md, the sixth product-environment run: about 12 minutes)."""
        kept, info = self._kept(groups)
        return None if kept else self._skipped({**info, "episodes": 0.0})

    def _skipped(self, info: dict[str, float]) -> dict[str, float]:
        return {**info, "skipped": 1.0, "version": float(self.version)}

    def _kept(self, groups: list[list[Episode]]
              ) -> tuple[list[list[Episode]], dict[str, float]]:
        """The groups a step trains on, their episodes unfaulted, and what was dropped."""
        kept: list[list[Episode]] = []
        faulted = 0
        for group in groups:
            clean = [e for e in group if e.fault is None]
            faulted += len(group) - len(clean)
            rewards = [e.reward for e in clean]
            if clean and (informative(rewards) or not self.config.drop_zero_variance):
                kept.append(clean)
        all_rewards = [e.reward for g in groups for e in g if e.fault is None]
        return kept, {
            "groups": float(len(groups)), "groups_kept": float(len(kept)),
            "faulted": float(faulted),
            "reward_mean": sum(all_rewards) / len(all_rewards) if all_rewards else 0.0}

    def _batch(self, groups: list[list[Episode]]) -> tuple[list[_Item], dict[str, float]]:
        """Items to train on, with each token's advantage and loss weight."""
        kept, info = self._kept(groups)
        episodes = [e for g in kept for e in g]
        advantages = [a for g in kept for a in group_advantages(
            torch.tensor([e.reward for e in g]), self.config.advantage).tolist()]
        lengths = [sum(len(s.completion_ids) for s in e.samples) for e in episodes]
        agg = self.config.loss_agg or DEFAULT_AGG[self.config.advantage]
        weights = token_weights(lengths, agg, self.config.token_budget)
        items, at = [], 0
        for episode, advantage in zip(episodes, advantages, strict=True):
            for sample in episode.samples:
                n = len(sample.completion_ids)
                if n:
                    items.append(_Item(sample, advantage, weights[at:at + n]))
                at += n
        return items, {**info, "episodes": float(len(episodes))}

    def _chunks(self, items: list[_Item]) -> list[list[_Item]]:
        return [[items[i] for i in chunk]
                for chunk in micro_batches([it.sample for it in items], self.config.micro_batch)]

    def _score(self, items: list[_Item], grad: bool, reference: bool = False
               ) -> list[torch.Tensor]:
        return self._logprobs([it.sample for it in items], self.config.temperature, grad,
                              reference)

    def _logprobs(self, samples: list[Sample], temperature: float, grad: bool,
                  reference: bool = False) -> list[torch.Tensor]:
        """Each sample's completion log-probs, one tensor per sample, in sample order."""
        with torch.set_grad_enabled(grad):
            scored = self.policy.row_logprobs(rows_of(samples), temperature, reference)
        return [lp.double() for spans in scored for lp in spans]

    def _old_logprobs(self, items: list[_Item]) -> list[torch.Tensor] | None:
        """The policy's log-probs before this step's update: needed separately only when
        the batch is used for more than one update (with one, they are the first forward's
        values, detached)."""
        if self.config.epochs == 1:
            return None
        return [lp for chunk in self._chunks(items) for lp in self._score(chunk, grad=False)]

    def _update(self, items: list[_Item], old: list[torch.Tensor] | None
                ) -> tuple[dict[str, float], list[torch.Tensor]]:
        """One optimiser step over the batch; its metrics and the (detached) log-probs the
        policy gave the batch before the step."""
        cfg = self.config
        self.optimizer.zero_grad(set_to_none=True)
        loss = kl = clipped = truncated = 0.0
        at = 0
        scored: list[torch.Tensor] = []
        for chunk in self._chunks(items):
            logp = torch.cat(self._score(chunk, grad=True))
            scored.append(logp.detach())
            before = (torch.cat(old[at:at + len(chunk)]) if old is not None
                      else logp.detach())
            ref = torch.cat(self._score(chunk, grad=False, reference=True)) if cfg.kl_beta \
                else None
            weights = torch.cat([it.weights for it in chunk])
            parts = policy_loss(
                logp, before, torch.cat([it.sampler_logp for it in chunk]),
                torch.cat([it.advantages for it in chunk]), weights, eps_low=cfg.eps_low,
                eps_high=cfg.eps_high, tis_cap=cfg.tis_cap, kl_beta=cfg.kl_beta,
                logp_ref=ref)
            parts.loss.backward()
            share = float(weights.sum())
            loss += float(parts.loss.detach())
            kl += parts.kl * share
            clipped += parts.clip_fraction * share
            truncated += parts.tis_truncated * share
            at += len(chunk)
        total = float(torch.cat([it.weights for it in items]).sum()) or 1.0
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
        self.optimizer.step()
        return {"loss": loss, "kl": kl / total, "clip_fraction": clipped / total,
                "tis_truncated": truncated / total, "grad_norm": grad_norm}, scored

    def imitate(self, samples: list[Sample], lr: float | None = None) -> dict[str, float]:
        """One supervised step: the mean negative log-likelihood of the samples' completion
        tokens (a warm start on demonstrations, rl/warmstart.py). Same optimiser, same
        micro-batches; `lr` overrides the learning rate for this step only. Scored at
        temperature 1, the model's own distribution, whatever RL samples at: scored at RL's
        lower temperature the same steps left held-out success lower (docs/rl.md, run B)."""
        started = time.perf_counter()
        tokens = sum(len(s.completion_ids) for s in samples)
        if not tokens:
            return {"skipped": 1.0, "version": float(self.version)}
        self.optimizer.zero_grad(set_to_none=True)
        nll = 0.0
        for chunk in micro_batches(samples, self.config.micro_batch):
            loss = -torch.cat(self._logprobs([samples[i] for i in chunk], 1.0, grad=True)
                              ).sum() / tokens
            loss.backward()
            nll += float(loss.detach())
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm))
        for group in self.optimizer.param_groups:
            group["lr"] = lr or self.config.lr
        self.optimizer.step()
        for group in self.optimizer.param_groups:
            group["lr"] = self.config.lr
        self.version += 1
        return {"nll": nll, "grad_norm": grad_norm, "tokens": float(tokens),
                "samples": float(len(samples)), "rows": float(len(rows_of(samples))), "seconds": time.perf_counter() - started,
                "version": float(self.version)}

    # -- weights and checkpoints ---------------------------------------------------------

    def weights(self) -> dict[str, torch.Tensor]:
        """The LoRA tensors a sampler loads to catch up to `version`."""
        return self.policy.lora_state()

    def save(self, directory: str) -> None:
        """Write the checkpoint atomically (a kill mid-write leaves the previous one)."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        state = {"lora": self.policy.lora_state(), "optimizer": self.optimizer.state_dict(),
                 "version": self.version, "torch_rng": torch.get_rng_state(),
                 "python_rng": random.getstate()}
        reference = self.policy.reference_state()
        if reference is not None:  # a resumed run keeps the KL term's reference
            state["reference"] = reference
        staging = path / f".{CHECKPOINT}.tmp"
        torch.save(state, staging)
        os.replace(staging, path / CHECKPOINT)
        (path / "trainer.json").write_text(json.dumps(self.config.model_dump(), indent=2))

    def load(self, directory: str) -> None:
        state = self._read(directory)
        self.policy.load_lora_state(state["lora"])
        if "reference" in state:
            self.policy.set_reference(state["reference"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])

    def start_from(self, directory: str, optimizer: bool = False) -> None:
        """Take another run's policy (its LoRA and version); this run's RNGs stay its own,
        so seeds that start from one warm start differ. That policy is also the KL term's
        reference from now on: RL after a warm start should stay near the warm start, not
        be pulled back to the base model (docs/rl.md, the fifth and sixth
        product-environment runs).

        `optimizer`: also that run's AdamW moments (`init_optimizer`), with this run's own
        learning rate and weight decay. A fresh AdamW's first update is lr x sign(gradient)
        in every weight, whatever the gradient's size; with the moments carried over it
        is scaled by the gradients seen so far (the sixth run: 99.99 % of the LoRA weights
        moved by exactly lr)."""
        state = self._read(directory)
        self.policy.load_lora_state(state["lora"])
        self.policy.set_reference(state["lora"])
        self.version = int(state["version"])
        if optimizer:
            self.optimizer.load_state_dict(state["optimizer"])
            for group in self.optimizer.param_groups:  # saved with the init run's rate
                group.update(lr=self.config.lr, weight_decay=self.config.weight_decay)

    def _read(self, directory: str) -> dict[str, Any]:
        """A checkpoint's state, refused when written for another model or LoRA shape."""
        path = Path(directory) / CHECKPOINT
        if not path.is_file():
            raise FileNotFoundError(f"no trainer checkpoint at {path}")
        saved = json.loads((Path(directory) / "trainer.json").read_text())
        shape = ("model", "lora_rank", "lora_alpha")
        if any(saved.get(k) != getattr(self.config, k) for k in shape):
            raise ValueError(f"checkpoint {directory} was written for another policy shape "
                             f"({ {k: saved.get(k) for k in shape} })")
        # weights_only: a checkpoint is data; unpickling arbitrary objects would run code.
        return torch.load(path, weights_only=True)
