"""Per-file KV-cache slots: jumping back to a file does not recompute its prompt.

llama.cpp keeps one KV sequence per model here, so a jump to another file throws away the
~750-token prefix of the first one (4-9 s to rebuild on 2 cores). Before a request whose
prompt the live cache does not cover, the live cache is saved (if it is still Tab's) and the
saved slot sharing the longest token prefix with the new prompt is restored.

Done by hand with llama.cpp's per-sequence state API because llama-cpp-python's
`save_state` also copies its whole logits buffer: the sequence API moves only this
sequence's KV (~12 KB per token for the 0.5B model), ~10 ms to save and ~2 ms to restore.
Slots live in memory only and are bounded (count and total bytes).
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict
from dataclasses import dataclass

import llama_cpp

from codeplane.models.engine import LocalModel

MIN_GAIN = 32  # restoring pays off once it saves this many prompt tokens


@dataclass
class _Slot:
    tokens: list[int]
    state: ctypes.Array


class KVSlots:
    def __init__(self, count: int, max_bytes: int = 256 << 20) -> None:
        self.count, self.max_bytes = count, max_bytes
        self._slots: OrderedDict[tuple[str, str], _Slot] = OrderedDict()
        self._owner: tuple[str, str] | None = None  # (model, slot key) of the live cache
        self._live: list[int] = []  # tokens the live cache held after Tab's last request
        self.restored = 0

    def prepare(self, model: LocalModel, tokens: list[int]) -> None:
        """Make the live KV cache cover as much of `tokens` as any saved slot can."""
        if self.count == 0:
            return
        cached = model.cached_prefix(tokens)
        if cached + MIN_GAIN < len(self._live):
            self._save_live(model)  # this request would overwrite it: keep a copy
        best, gain = None, MIN_GAIN
        for (name, slot_key), slot in self._slots.items():
            if name == model.name:
                shared = model.llama.longest_token_prefix(slot.tokens, tokens)
                if shared - cached >= gain:
                    best, gain = (name, slot_key), shared - cached
        if best is None:
            return
        self._restore(model, self._slots[best])
        self._slots.move_to_end(best)
        self.restored += 1

    def finished(self, model: LocalModel, key: str) -> None:
        """Remember who owns the live cache after a Tab request on `key` (a file)."""
        if self.count:
            self._owner = (model.name, key)
            self._live = model.llama._input_ids.tolist()

    def _save_live(self, model: LocalModel) -> None:
        live = model.llama._input_ids.tolist()
        if self._owner is None or self._owner[0] != model.name or live != self._live:
            return  # another compartment used the model since: not ours to keep
        ctx = model.llama._ctx.ctx
        size = llama_cpp.llama_state_seq_get_size(ctx, 0)
        state = (ctypes.c_uint8 * size)()
        if llama_cpp.llama_state_seq_get_data(ctx, state, size, 0) != size:
            return
        self._slots[self._owner] = _Slot(live, state)
        self._slots.move_to_end(self._owner)
        while len(self._slots) > self.count or self._bytes() > self.max_bytes:
            self._slots.popitem(last=False)

    def _restore(self, model: LocalModel, slot: _Slot) -> None:
        llama = model.llama
        ctx = llama._ctx.ctx
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), 0, -1, -1)
        if llama_cpp.llama_state_seq_set_data(ctx, slot.state, len(slot.state), 0) == 0:
            llama.reset()  # restore failed: start from an empty cache, never a stale one
            return
        llama.input_ids[: len(slot.tokens)] = slot.tokens
        llama.n_tokens = len(slot.tokens)

    def _bytes(self) -> int:
        return sum(len(s.state) for s in self._slots.values())
