"""The seams of the RL loop: what a rollout produces and what a trainer and a sampler accept.

Kept free of torch and ray so the rollout side, the trainer side and tests agree on plain data.
One model turn is one `Sample`: the tokens the policy was prompted with (system prompt, task,
earlier turns and tool outputs) and the tokens it sampled. Only sampled tokens carry loss, so
tool-output tokens are masked by construction. An `Episode` is one task attempt; a group is the
episodes that started from the same task (the baseline for GRPO/RLOO advantages).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from codeplane.core.chat import ChatModel

# the trainer policy's base-weight precision (`TrainerConfig.dtype`; "auto": bfloat16 where
# the CPU has it natively); named here, without torch, for the CLI's option
DtypeName = Literal["float32", "bfloat16", "auto"]


@dataclass
class Sample:
    """One model turn as the sampler saw it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # the sampler's log-prob of each completion token
    version: int  # policy version that sampled it (staleness = trainer version - version)


@dataclass
class Episode:
    """One attempt at one task: its turns, the verifier's reward, and what went wrong."""

    task_id: str
    group_id: str
    samples: list[Sample]
    reward: float
    fault: str | None = None  # "sandbox_killed", "tool_timeout", "verifier_crash", ...
    steps: int = 0
    seconds: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)


class Trainer(Protocol):
    """Updates the policy from groups of episodes; owns the weights and their version."""

    version: int

    def step(self, groups: list[list[Episode]]) -> dict[str, float]:
        """One optimiser step over these groups; returns metrics (loss, kl, mismatch, ...)."""

    def nothing_to_learn(self, groups: list[list[Episode]]) -> dict[str, float] | None:
        """A skipped step's metrics when `step` would not update on these groups, else
        None; cheap, so the run asks before it waits for `train_lock`."""

    def weights(self) -> Any:
        """What a sampler needs to catch up to `version` (e.g. a LoRA state dict)."""

    def save(self, directory: str) -> None:
        """Write a checkpoint a killed trainer resumes from."""

    def load(self, directory: str) -> None:
        """Resume from `save`'s checkpoint."""

    def start_from(self, directory: str, optimizer: bool = False) -> None:
        """Take the policy of another run's checkpoint (`init`), and its optimiser state
        when `optimizer` (`init_optimizer`)."""


class Sampler(ChatModel, Protocol):
    """A chat model that returns token ids, logprobs and its policy version on every Turn, and
    takes new weights without a restart."""

    version: int

    def load_weights(self, weights: Any, version: int) -> None:
        """Swap in the trainer's weights; later turns are stamped with `version`."""
