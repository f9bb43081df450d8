"""Grammar-constrained sampling that asks the grammar about likely tokens first.

llama-cpp-python chains llama.cpp's grammar sampler in front of the token choice, so every
decoded token tests the whole vocabulary (Qwen's is large) against the grammar, which made each
token of a forced tool call slow (docs/models-and-server.md, "Numbers behind the code's
comments"). llama.cpp's own server samples first and consults the grammar for the full
vocabulary only when the chosen token is rejected. `GrammarGate` does the same as a logits
processor: it tests the `top_k` most likely tokens (1 when decoding greedily, so greedy output
is exactly what the full grammar gives), keeps those the grammar allows, and falls back to the
whole vocabulary only when none is allowed. With sampling, the choice is among the allowed
tokens of the model's own top-k, which is what the sampler would draw from anyway unless fewer
than k of them are allowed.

Hand-written on llama.cpp's C sampler API because llama-cpp-python exposes no lazy mode.
"""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np

_TOKEN_DATA = np.dtype([("id", np.intc), ("logit", np.single), ("p", np.single)], align=True)


class GrammarGate:
    """Logits processor: masks every token the GBNF grammar does not allow next."""

    def __init__(self, llama: llama_cpp.Llama, gbnf: str, prompt_tokens: int,
                 top_k: int) -> None:
        self._sampler = llama_cpp.llama_sampler_init_grammar(
            llama._model.vocab, gbnf.encode(), b"root")
        if not self._sampler:
            raise ValueError("llama.cpp rejected the grammar")
        self._accepted = prompt_tokens  # tokens before this index are the prompt
        self._top_k = max(1, top_k)

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        for token in input_ids[self._accepted:]:  # tokens sampled since the last call
            llama_cpp.llama_sampler_accept(self._sampler, int(token))
        self._accepted = len(input_ids)
        top = np.argpartition(scores, -self._top_k)[-self._top_k:]
        allowed = self._allowed(top, scores[top])
        out = np.full_like(scores, -np.inf)
        if allowed.size:
            out[allowed] = scores[allowed]
            return out
        everything = self._allowed(np.arange(scores.size), scores)
        out[everything] = scores[everything]
        return out

    def _allowed(self, ids: np.ndarray, logits: np.ndarray) -> np.ndarray:
        """The subset of `ids` the grammar accepts in its current state."""
        data = np.empty(ids.size, dtype=_TOKEN_DATA)
        data["id"], data["logit"], data["p"] = ids, logits, 0.0
        array = llama_cpp.llama_token_data_array(
            data=data.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)),
            size=ids.size, selected=-1, sorted=False)
        llama_cpp.llama_sampler_apply(self._sampler, ctypes.byref(array))
        return data["id"][np.isfinite(data["logit"])]

    def __del__(self) -> None:  # the generation loop holds the only reference
        if getattr(self, "_sampler", None):
            llama_cpp.llama_sampler_free(self._sampler)
