"""Per-file KV-cache slots: jumping back to a file does not recompute its prompt.

llama.cpp keeps one KV sequence per model here, so a jump to another file throws away the
prefix of the first one, seconds of prefill to rebuild on CPU (docs/tab.md, "How it stays
fast"). Before a request whose
prompt the live cache does not cover, the live cache is saved (if it is still Tab's) and the
saved slot sharing the longest token prefix with the new prompt is restored.

Saved and restored through the model's KV cache (`models/kv.py`: llama.cpp's per-sequence
state, only this sequence's KV: small, and milliseconds to save and restore next to the
prefill it saves). Slots live in the model's worker process only (`tab.service.suggest`)
and are bounded (count and total bytes). Each belongs to a tenant: a request is only ever
given back a slot its own tenant saved, and a live cache another tenant's request left
is emptied before a request uses it (it goes to that tenant's slots first).

A prefill (`POST /v1/tab/prefill`) fills the live cache the same way a completion does, so
the document it prefilled is kept here like one the user typed in.
"""

from __future__ import annotations

from collections import OrderedDict

from codeplane.models.engine import LocalModel
from codeplane.models.kv import SavedSequence

MIN_GAIN = 32  # restoring pays off once it saves this many prompt tokens


class KVSlots:
    """The saved sequences of one model (it lives in that model's worker)."""

    def __init__(self, count: int, max_bytes: int = 256 << 20) -> None:
        self.count, self.max_bytes = count, max_bytes
        self._slots: OrderedDict[tuple[str, str], SavedSequence] = OrderedDict()
        self._owner: tuple[str, str] | None = None  # (tenant, slot key) of the live cache
        self._live: list[int] = []  # tokens the live cache held after Tab's last request

    def prepare(self, model: LocalModel, tokens: list[int], tenant: str) -> bool:
        """Make the live KV cache cover as much of `tokens` as any slot `tenant` saved
        can; True when a slot was restored. A live cache another tenant's request left is
        saved (as theirs) and emptied first: a tenant never reuses another's cache."""
        ours = self._owner is not None and model.kv.tokens == self._live
        foreign = self._foreign(model, tenant)
        cached = 0 if foreign else model.cached_prefix(tokens)
        if ours and (foreign or cached + MIN_GAIN < len(self._live)):
            self._save_live(model)  # this request would overwrite it: keep a copy
        if foreign:
            model.kv.truncate(0)
            self._owner, self._live = None, []
        best = self._best(model, tokens, tenant)
        if best is None or best[1] - cached < MIN_GAIN:
            return False
        model.kv.restore(self._slots[best[0]])
        self._slots.move_to_end(best[0])
        return True

    def covered(self, model: LocalModel, tokens: list[int], tenant: str) -> int:
        """How many leading tokens of `tokens` `prepare` would find in the KV cache, live or
        in a slot `tenant` saved; changes nothing (Tab asks it to tell a cold document)."""
        live = 0 if self._foreign(model, tenant) else model.cached_prefix(tokens)
        best = self._best(model, tokens, tenant)
        return max(live, best[1] if best else 0)

    def _foreign(self, model: LocalModel, tenant: str) -> bool:
        """The live cache is what another tenant's Tab request left."""
        return (self._owner is not None and self._owner[0] != tenant
                and model.kv.tokens == self._live)

    def _best(self, model: LocalModel, tokens: list[int], tenant: str
              ) -> tuple[tuple[str, str], int] | None:
        """The slot of `tenant` sharing the longest token prefix with `tokens`, and its
        length."""
        best = None
        for (owner, slot_key), slot in self._slots.items():
            if owner == tenant:
                shared = model.kv.common_prefix(slot.tokens, tokens)
                if best is None or shared > best[1]:
                    best = (owner, slot_key), shared
        return best

    def finished(self, model: LocalModel, tenant: str, key: str) -> None:
        """Remember who owns the live cache after `tenant`'s Tab request (a completion or a
        prefill) on `key` (a file)."""
        self._owner = (tenant, key)
        self._live = model.kv.tokens

    def _save_live(self, model: LocalModel) -> None:
        live = model.kv.tokens
        if self.count == 0 or self._owner is None or live != self._live:
            return  # no slots, or another compartment used the model since: not ours
        saved = model.kv.save()
        if saved is None:
            return
        self._slots[self._owner] = saved
        self._slots.move_to_end(self._owner)
        while len(self._slots) > self.count or self._bytes() > self.max_bytes:
            self._slots.popitem(last=False)

    def _bytes(self) -> int:
        return sum(s.size for s in self._slots.values())

