"""The named jobs a model's worker process runs (`Engine.run(name, job, *args)`).

Closures cannot cross a process boundary, so compartments name what they want done: each
entry maps a job name to a module-level function `fn(ctx: JobContext, *args)` that runs in
the worker with the loaded model, takes picklable arguments and returns a picklable result.
A job keeps its hot loop inside the worker (a whole decode, a whole Tab suggestion, a whole
speculative rewrite), so a request crosses the boundary once, never per token.

The table holds "module:function" strings rather than the functions: it sits in `models/`
but names functions of compartments above it (Tab, apply); the worker imports a module the
first time it runs one of its jobs, and the server never imports them for the table.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from codeplane.models.engine import Decoding, Generation, LocalModel

JOBS: dict[str, str] = {
    "render_chat": "codeplane.models.jobs:render_chat",
    "chat_tokens": "codeplane.models.jobs:chat_tokens",
    "chat_generate": "codeplane.models.jobs:chat_generate",
    "score": "codeplane.models.jobs:score",
    "set_lora": "codeplane.models.jobs:set_lora",
    "check_lora": "codeplane.models.jobs:check_lora",
    "embed": "codeplane.models.embed_worker:embed",
    "openai.chat": "codeplane.models.local_openai:chat",
    "openai.completions": "codeplane.models.local_openai:completions",
    "tab.suggest": "codeplane.tab.service:suggest",
    "tab.prefill": "codeplane.tab.service:prefill",
    "tab.state": "codeplane.tab.service:state",
    "tab.warm": "codeplane.tab.service:warm",
    "tab.next": "codeplane.tab.nextedit:predict",
    "tab.next_prefill": "codeplane.tab.nextedit:prefill",
    "apply.rank": "codeplane.apply.rank:rank",
    "apply.rewrite": "codeplane.apply.rewrite:rewrite",
}


@dataclass
class JobContext:
    """What a job function gets in the worker besides its arguments."""

    model: LocalModel  # what the worker loaded: a LocalModel, or an embedder for `embed`
    cancel: threading.Event  # set when the caller cancels (a message from the server)
    emit: Callable[[Any], None]  # streams an event to the caller's `on_event`
    # Per-model state compartments keep between jobs (Tab's KV slots, its vocabulary index),
    # by key; it lives as long as the worker, like the model's KV cache.
    state: dict[str, Any] = field(default_factory=dict)

    def resident(self, key: str, make: Callable[[], Any]) -> Any:
        """The state kept under `key`, made on first use."""
        if key not in self.state:
            self.state[key] = make()
        return self.state[key]


def resolve(job: str) -> Callable[..., Any]:
    """The function a job name stands for (imports its module on first use)."""
    module, _, name = JOBS[job].partition(":")
    return getattr(importlib.import_module(module), name)


# -- jobs on the model itself ------------------------------------------------------------


def render_chat(ctx: JobContext, messages: list[dict], tools: list[dict] | None = None) -> str:
    return ctx.model.render_chat(messages, tools)


def chat_tokens(ctx: JobContext, messages: list[dict], tools: list[dict] | None = None
                ) -> list[int]:
    return ctx.model.chat_tokens(messages, tools)


def chat_generate(ctx: JobContext, messages: list[dict], tools: list[dict] | None,
                  sampling: Decoding) -> tuple[list[int], Generation]:
    """Render the messages with the model's chat template and decode a reply: (prompt
    tokens, generation). `sampling` crosses the boundary: its processors must be picklable
    (module-level classes such as `engine.LogitScale`)."""
    prompt = ctx.model.chat_tokens(messages, tools)
    return prompt, ctx.model.generate(prompt, sampling, ctx.cancel)


def score(ctx: JobContext, prefix: list[int], tokens: list[int]) -> float:
    """Sum of log p(token | everything before it) over `tokens` after `prefix`."""
    return ctx.model.kv.score(prefix, tokens)


def set_lora(ctx: JobContext, path: Path | None, scale: float = 1.0) -> None:
    """Pin a LoRA adapter (None: the base model) for every later job that names none (RL's
    sampler, on an engine of its own), between two jobs, never during one."""
    ctx.model.lora.pin(path, scale)


def check_lora(ctx: JobContext, path: Path) -> None:
    """Raise AdapterError unless llama.cpp accepts `path` as an adapter of this model
    (`codeplane model add --adapter` asks before it registers one)."""
    from codeplane.models.lora import check_adapter

    check_adapter(ctx.model.llama, path)
