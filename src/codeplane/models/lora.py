"""Swapping a LoRA adapter (GGUF) into a loaded llama.cpp model without reloading it.

RL ships new weights to the sampler every step; reloading a model costs seconds and its KV
cache, while an adapter of a few MB loads in milliseconds. llama-cpp-python only takes an
adapter at construction (`Llama(lora_path=...)`), so the swap goes through its low-level
binding (`llama_adapter_lora_init` / `llama_set_adapters_lora`), here and nowhere else. Runs
on the model's worker thread like every other `LocalModel` call.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llama_cpp import Llama

    from codeplane.models.kv import KVCache


class AdapterError(RuntimeError):
    """llama.cpp refused the adapter (wrong architecture, shapes or file)."""


class LoraSlot:
    """The one adapter applied to a model's context, or none."""

    def __init__(self, llama: Llama, kv: KVCache) -> None:
        self._llama = llama
        self._kv = kv
        self._adapter = None
        self.path: Path | None = None

    def set(self, path: Path | None, scale: float = 1.0) -> None:
        """Apply the adapter at `path` (None: the base model). The KV cache is emptied: its
        keys and values were computed with the old weights, so reusing a cached prefix would
        mix two policies in one sequence."""
        import llama_cpp

        adapter = None
        if path is not None:
            adapter = llama_cpp.llama_adapter_lora_init(self._llama.model, str(path).encode())
            if not adapter:
                raise AdapterError(f"llama.cpp could not load the LoRA adapter {path}")
        if adapter is None:
            status = llama_cpp.llama_set_adapters_lora(self._llama.ctx, None, 0, None)
        else:
            adapters = (llama_cpp.llama_adapter_lora_p_ctypes * 1)(adapter)
            status = llama_cpp.llama_set_adapters_lora(self._llama.ctx, adapters, 1,
                                                       (ctypes.c_float * 1)(scale))
        if status != 0:
            if adapter is not None:
                llama_cpp.llama_adapter_lora_free(adapter)
            raise AdapterError(f"llama.cpp could not apply the LoRA adapter {path}")
        if self._adapter is not None:  # detached above, so freeing it is safe
            llama_cpp.llama_adapter_lora_free(self._adapter)
        self._adapter, self.path = adapter, path
        self._kv.truncate(0)
