"""LoRA adapters (GGUF) applied to a loaded llama.cpp model without reloading it.

Two users share one mechanism. RL ships new weights to its own sampler every step
(`set_lora`: the adapter is *pinned*, every job of that worker runs with it); the server
serves registered adapter models (`codeplane model add NAME --adapter FILE --base BASE`),
each job naming the adapter it needs, or none for the base model, so one worker holds the
base weights once for the base and all its adapters. Reloading a model costs seconds and its
KV cache, while an adapter of a few MB loads in milliseconds. llama-cpp-python only takes an
adapter at construction (`Llama(lora_path=...)`), so the swap goes through its low-level
binding (`llama_adapter_lora_init` / `llama_set_adapters_lora`), here and nowhere else. Runs
on the model's worker thread like every other `LocalModel` call.
"""

from __future__ import annotations

import ctypes
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from llama_cpp import Llama

    from codeplane.models.kv import KVCache

VERSION_CHARS = 12  # an adapter's version: this many hex digits of its sha256


class AdapterError(RuntimeError):
    """llama.cpp refused the adapter (wrong architecture, shapes or file), or the file is
    not the one registered."""


@dataclass(frozen=True)
class Adapter:
    """An adapter file and the scale it is applied at. `sha256` is the content a registered
    adapter must still have (None: RL's own files, written a moment before they are set)."""

    path: Path
    sha256: str | None = None
    scale: float = 1.0

    @property
    def version(self) -> str | None:
        return self.sha256[:VERSION_CHARS] if self.sha256 else None


def file_sha256(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def check_adapter(llama: Llama, path: Path) -> None:
    """Raise AdapterError unless llama.cpp loads `path` as an adapter of this model (loaded
    and freed again; whatever is applied stays applied)."""
    import llama_cpp

    llama_cpp.llama_adapter_lora_free(_load(llama, path))


def _load(llama: Llama, path: Path):
    import llama_cpp

    adapter = llama_cpp.llama_adapter_lora_init(llama.model, str(path).encode())
    if not adapter:
        raise AdapterError(f"llama.cpp could not load the LoRA adapter {path}")
    return adapter


class LoraSlot:
    """The one adapter applied to a model's context, or none."""

    def __init__(self, llama: Llama, kv: KVCache) -> None:
        self._llama = llama
        self._kv = kv
        self._handle = None
        self.applied: Adapter | None = None
        self.pinned: Adapter | None = None  # what jobs that name no adapter run with

    def pin(self, path: Path | None, scale: float = 1.0) -> None:
        """RL's swap: from now on jobs that name no adapter run with `path` (None: the base
        model)."""
        pinned = Adapter(path, None, scale) if path is not None else None
        self._apply(pinned)
        self.pinned = pinned

    def serve(self, adapter: Adapter | None) -> None:
        """Before a job: apply the job's adapter (None: the pinned one, normally none) unless
        it is already applied."""
        wanted = adapter or self.pinned
        if wanted != self.applied:
            self._apply(wanted)

    def _apply(self, adapter: Adapter | None) -> None:
        """The KV cache is emptied: its keys and values were computed with the old weights,
        so reusing a cached prefix would mix two models in one sequence."""
        import llama_cpp

        handle = None
        if adapter is not None:
            if adapter.sha256 is not None and file_sha256(adapter.path) != adapter.sha256:
                raise AdapterError(f"{adapter.path} changed since it was registered; register "
                                   "it again with `codeplane model add`")
            handle = _load(self._llama, adapter.path)
        if handle is None:
            status = llama_cpp.llama_set_adapters_lora(self._llama.ctx, None, 0, None)
        else:
            handles = (llama_cpp.llama_adapter_lora_p_ctypes * 1)(handle)
            status = llama_cpp.llama_set_adapters_lora(self._llama.ctx, handles, 1,
                                                       (ctypes.c_float * 1)(adapter.scale))
        if status != 0:
            if handle is not None:
                llama_cpp.llama_adapter_lora_free(handle)
            raise AdapterError(f"llama.cpp could not apply the LoRA adapter "
                               f"{adapter.path if adapter else None}")
        if self._handle is not None:  # detached above, so freeing it is safe
            llama_cpp.llama_adapter_lora_free(self._handle)
        self._handle, self.applied = handle, adapter
        self._kv.truncate(0)


# transformers module name -> llama.cpp tensor name, for the attention projections.
GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
_PEFT_KEY = re.compile(r"layers\.(\d+)\.self_attn\.(\w+)\.lora_([AB])\.weight$")


def write_gguf_adapter(state: dict[str, torch.Tensor], path: Path, arch: str,
                       alpha: float) -> Path:
    """Write a PEFT LoRA state dict (torch tensors: the RL trainer's) as a llama.cpp LoRA
    adapter at `path`."""
    import gguf
    import torch

    writer = gguf.GGUFWriter(path, arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
    for key in sorted(state):
        match = _PEFT_KEY.search(key)
        if match is None or match.group(2) not in GGUF_NAMES:
            raise ValueError(f"LoRA tensor {key!r} has no llama.cpp counterpart")
        layer, module, side = match.groups()
        name = f"blk.{layer}.{GGUF_NAMES[module]}.weight.lora_{side.lower()}"
        writer.add_tensor(name, state[key].detach().to(torch.float32).contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
