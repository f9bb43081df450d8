"""The agent setup a model was trained in, served back with it (issue 31: "what is trained is
served back to the product").

A policy learns the agent it was trained in: the toolset and its schemas, how much of a tool's
output it sees, whether its last turn is an answer turn, the hooks, the turn and token limits.
Served in another setup it does worse (docs/rl.md, "Served with its own setup"). So an RL run
records its setup (`record`, written to the run's `config.json` at start), `codeplane model add
--from-run` keeps it with the model in the registry (`ModelSpec.agent`), and every agent built
for that model - `codeplane agent`, `/v1/agent/runs`, background agents - starts from it
instead of the product's defaults (`resolve`). What the caller sets explicitly still wins, and
`setup = "product"` ignores the recorded setup. The run's `run_start` event says what ran
(`config`, `hooks`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from codeplane.agent.hooks import PRODUCT_HOOKS
from codeplane.agent.loop import AgentConfig
from codeplane.models.registry import ModelRegistry, UnknownModel

# The `AgentConfig` fields a training run sets for its episodes (rl `[rollout]`), and so the
# ones a model's recorded setup may carry; the rest are the product's own everywhere. The
# temperature is not among them: a served model answers greedily, as held-out evaluation ran.
FIELDS = ("max_steps", "max_tokens", "toolset", "max_result_chars", "answer_turn",
          "required_steps")
Choice = Literal["model", "product"]  # the model's recorded setup, or the product's defaults


@dataclass(frozen=True)
class AgentSetup:
    """What an `Agent` is built with: its config and the hooks that run."""

    config: AgentConfig
    hooks: tuple[str, ...] = PRODUCT_HOOKS


def record(config: AgentConfig, hooks: Iterable[str]) -> dict[str, Any]:
    """The setup as JSON, as a model's registry entry keeps it."""
    return {**{name: getattr(config, name) for name in FIELDS}, "hooks": list(hooks)}


def resolve(recorded: Mapping[str, Any] | None, choice: Choice = "model",
            **chosen: Any) -> AgentSetup:
    """The product's defaults, replaced by the model's `recorded` setup (unless `choice` is
    "product"), replaced by what the caller chose explicitly (`chosen`: `AgentConfig` fields
    and `hooks`; None means not chosen)."""
    base = dict(recorded or {}) if choice == "model" else {}
    hooks = base.pop("hooks", PRODUCT_HOOKS)
    fields = {k: v for k, v in base.items() if k in FIELDS}
    fields |= {k: v for k, v in chosen.items() if v is not None}
    hooks = fields.pop("hooks", hooks)
    return AgentSetup(AgentConfig(**fields), tuple(hooks))


def recorded_setup(registry: ModelRegistry, model: str) -> Mapping[str, Any] | None:
    """The setup the registry keeps with a local model; None for a model trained nowhere
    (a built-in, a plain file) or one the gateway serves from elsewhere."""
    try:
        return registry.get(model).agent
    except UnknownModel:
        return None
