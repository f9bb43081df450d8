"""What an RL run directory holds for serving: its latest policy as a llama.cpp adapter.

A run with the llama.cpp sampler keeps its current policy as `adapters/policy-vN.gguf` (only
the newest; `rl/adapter.py`); every run keeps the trainer's checkpoint in `checkpoint/`
(`trainer.pt`: the torch LoRA state; `trainer.json`: base model, rank, alpha). The newest GGUF
adapter is taken as it is; a run without one has its torch LoRA state converted, which needs
torch (the `[rl]` extra). `codeplane model add NAME --from-run DIR` registers the result,
with the agent setup the run trained it in: the `agent` object of the run's `config.json`,
which the run writes at its start (`codeplane rl record-setup CONFIG` writes it for a run that
started before runs did).
"""

from __future__ import annotations

import json
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

_POLICY = re.compile(r"policy-v(\d+)\.gguf$")


class RunError(ValueError):
    """The directory holds no servable checkpoint (or not one this machine can convert)."""


def run_base(run_dir: Path) -> str | None:
    """The base model the run trained (None: the run wrote no trainer settings)."""
    saved = run_dir / "checkpoint" / "trainer.json"
    if not saved.is_file():
        return None
    return json.loads(saved.read_text()).get("model")


def run_setup(run_dir: Path) -> dict[str, Any]:
    """The agent setup the run's episodes ran in, as the run recorded it (an opaque JSON
    object here; `agent/setup.py` reads it)."""
    saved = run_dir / "config.json"
    if not saved.is_file():
        raise RunError(f"{run_dir} does not record the agent setup its policy was trained in "
                       "(config.json, which runs write at their start since 2026-11-29): "
                       "write it with `codeplane rl record-setup CONFIG` (the run's TOML), "
                       "then add again")
    try:
        setup = json.loads(saved.read_text())["agent"]
    except (OSError, ValueError, KeyError) as exc:
        raise RunError(f"cannot read the agent setup in {saved}: {exc}") from None
    if not isinstance(setup, dict):
        raise RunError(f"{saved}: `agent` is not an object")
    return setup


def run_adapter(run_dir: Path, staging: Path, arch_of: Callable[[], str]) -> Path:
    """The run's newest GGUF adapter, or its trainer checkpoint converted to one at
    `staging` (`arch_of()`: the base model's architecture, read only when converting)."""
    versions = {int(m.group(1)): p for p in (run_dir / "adapters").glob("policy-v*.gguf")
                if (m := _POLICY.search(p.name))}
    if versions:
        return versions[max(versions)]
    checkpoint = run_dir / "checkpoint" / "trainer.pt"
    if not checkpoint.is_file():
        raise RunError(f"{run_dir} holds neither adapters/policy-vN.gguf nor "
                       "checkpoint/trainer.pt: not an RL run directory (`codeplane rl run`'s "
                       "`out`)")
    try:
        import torch

        from codeplane.models.lora import write_gguf_adapter
    except ImportError as exc:
        raise RunError(f"{run_dir} keeps only the torch LoRA state; converting it needs the "
                       f"[rl] extra (pip install 'codeplane[rl]'): {exc}") from None
    try:
        alpha = json.loads((run_dir / "checkpoint" / "trainer.json").read_text())["lora_alpha"]
        # weights_only: a checkpoint is data; unpickling arbitrary objects would run code.
        state = torch.load(checkpoint, weights_only=True)["lora"]
    except (OSError, ValueError, KeyError, RuntimeError, pickle.UnpicklingError) as exc:
        raise RunError(f"cannot read the trainer checkpoint in {run_dir}: {exc}") from None
    return write_gguf_adapter(state, staging, arch_of(), alpha)
