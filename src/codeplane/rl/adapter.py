"""The llama.cpp sampler: the trainer's LoRA written as a GGUF adapter and swapped into the
running engine, so rollouts sample at llama.cpp speed with the current policy.

The file layout is llama.cpp's own (`convert_lora_to_gguf.py`): `general.type = adapter`,
`adapter.type = lora`, `adapter.lora.alpha`, and per adapted weight two tensors named after
the base tensor, `<name>.lora_a` (rank x in) and `<name>.lora_b` (out x rank); llama.cpp
scales the product by alpha / rank, as PEFT does. Written with the `gguf` package.
"""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import torch

from codeplane.core.chat import Cancelled, Sampling, Turn
from codeplane.models.engine import Decoding, Engine, JobDropped, LogitScale
from codeplane.models.local_openai import tool_call_grammar
from codeplane.models.lora import write_gguf_adapter
from codeplane.rl.policy import InProcessSampler


class LlamaSampler(InProcessSampler):
    """`rl.types.Sampler` over the llama.cpp engine with the current LoRA swapped in.

    Sampling is over the full vocabulary at the requested temperature (applied by a logits
    processor so the captured log-probs are those of the distribution actually sampled; the
    engine's product default of top-40 would make them wrong for importance ratios)."""

    kind = "llama.cpp+lora"

    def __init__(self, engine: Engine, model: str, adapters: Path, lora_alpha: float,
                 seed: int = 0) -> None:
        self.engine = engine
        self.name = model
        self.adapters = adapters
        self.lora_alpha = lora_alpha
        self.version = 0
        self._seeds = itertools.count(seed)
        self._seed_lock = threading.Lock()

    def load_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """Write the adapter, then swap it in in the model's worker (between two
        generations, never during one); older adapter files are removed."""
        self.adapters.mkdir(parents=True, exist_ok=True)
        arch = self.engine.info(self.name).metadata["general.architecture"]
        path = write_gguf_adapter(weights, self.adapters / f"policy-v{version}.gguf", arch,
                                  self.lora_alpha)
        self.engine.run_sync(self.name, "set_lora", path)
        self.version = version
        for old in self.adapters.glob("policy-v*.gguf"):
            if old != path:
                old.unlink(missing_ok=True)

    def complete(self, messages: list[dict], tools: list[dict], sampling: Sampling,
                 cancel: threading.Event | None = None) -> Turn:
        shown = sampling.shown(tools)
        with self._seed_lock:
            seed = next(self._seeds)
        engine_sampling = _engine_sampling(sampling, seed)
        # tool_choice "required": the product's grammar (a `<tool_call>` of one of the tools);
        # the logprobs are captured before it masks, so the trainer scores the same numbers
        engine_sampling.grammar = tool_call_grammar(shown, sampling.tool_choice)
        try:
            prompt, gen = self.engine.run_sync(self.name, "chat_generate", messages,
                                               shown, engine_sampling, cancel=cancel)
        except JobDropped:
            raise Cancelled() from None
        if gen.finish_reason == "cancelled":
            raise Cancelled()
        ids = list(gen.token_ids)
        logprobs = list(gen.token_logprobs or [])
        if gen.stop_token is not None and gen.stop_logprob is not None:
            ids.append(gen.stop_token)
            logprobs.append(gen.stop_logprob)
        return self._turn(gen.text, shown, gen.finish_reason, prompt, ids, logprobs,
                          self.version)


def _engine_sampling(sampling: Sampling, seed: int) -> Decoding:
    if sampling.temperature <= 0:
        return Decoding(max_tokens=sampling.max_tokens, temperature=0.0, logprobs=True,
                              seed=seed)
    return Decoding(max_tokens=sampling.max_tokens, temperature=1.0, top_k=0,
                          logprobs=True, seed=seed,
                          processors=[LogitScale(1.0 / sampling.temperature)])
