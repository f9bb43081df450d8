"""The KV cache of one loaded model: the only code that moves llama.cpp's sequence by hand.

llama-cpp-python's `Llama` decodes one row of logits per pass and keeps its own record of
what the cache holds (`input_ids`, `n_tokens`), which `Llama.generate` reads to reuse a
prompt's prefix. Apply's speculative decoding (verify a draft: logits on every row, keep the
agreed part), apply's tie ranking (score a continuation) and Tab's per-file slots (save and
restore a sequence) need more than that. They go through this class, so the record always
matches the cache whoever used the model last, and nothing outside `models/` touches
`Llama`'s private attributes. Every method runs on the model's worker thread.

llama-cpp-python has no public API for batch logits or per-sequence state, hence the
private attributes here (`_ctx`, `_batch`, `_input_ids`), in this one place.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from llama_cpp import Llama


@dataclass
class SavedSequence:
    """A copy of the cache's one sequence: its tokens and llama.cpp's state bytes."""

    tokens: list[int]
    state: ctypes.Array

    @property
    def size(self) -> int:
        return len(self.state)


class KVCache:
    def __init__(self, llama: Llama) -> None:
        self._llama = llama

    # -- what the cache holds --------------------------------------------------------------

    @property
    def tokens(self) -> list[int]:
        """The tokens whose keys and values are in the cache, in order."""
        return self._llama._input_ids.tolist()

    @property
    def n_past(self) -> int:
        return self._llama.n_tokens

    @property
    def n_batch(self) -> int:
        return self._llama.n_batch

    def shared_prefix(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` the cache already holds."""
        return self.common_prefix(self.tokens, tokens)

    def common_prefix(self, a: list[int], b: list[int]) -> int:
        """Length of the common prefix of two token lists (a saved sequence's and a
        prompt's, say)."""
        return self._llama.longest_token_prefix(a, b)

    def truncate(self, keep: int) -> None:
        """Forget every row after the first `keep` (a rejected draft, a new prompt). The
        logits buffer then belongs to no cached row: `Llama.generate` must evaluate before
        it samples (`_requires_eval`; without it, a prompt equal to the cached tokens would
        be sampled from a stale row)."""
        self._llama._ctx.kv_cache_seq_rm(-1, keep, -1)
        self._llama.n_tokens = keep
        self._llama._requires_eval = True

    # -- evaluating --------------------------------------------------------------------------

    def prefill(self, prompt: list[int]) -> int:
        """Evaluate `prompt`, reusing the longest cached prefix (at least its last token is
        evaluated again so `last_logits` belong to it). Returns the reused count."""
        keep = min(self.shared_prefix(prompt), len(prompt) - 1)
        self.truncate(keep)
        self._llama.eval(prompt[keep:])
        return keep

    def last_logits(self) -> np.ndarray:
        """Logits of the last row evaluated (a view: read it before the next pass)."""
        import llama_cpp

        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self._llama._ctx.ctx, -1),
                                     shape=(self._llama.n_vocab(),))

    def verify(self, batch: list[int]) -> np.ndarray:
        """One forward pass over `batch` after the cached rows, with logits on every row;
        each row's argmax. Nothing is recorded: `commit` keeps the part that is wanted."""
        import llama_cpp

        llama = self._llama
        llama._batch.set_batch(batch=batch, n_past=llama.n_tokens, logits_all=True)
        llama._ctx.decode(llama._batch)
        rows = np.ctypeslib.as_array(llama_cpp.llama_get_logits(llama._ctx.ctx),
                                     shape=(len(batch), llama.n_vocab()))
        return rows.argmax(axis=1)

    def chosen_logprobs(self, rows: int) -> list[float]:
        """Log-probability of each row's argmax token over the first `rows` rows of the last
        `verify` (the tokens a greedy decode keeps; read before the next pass)."""
        import llama_cpp

        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(self._llama._ctx.ctx),
                                       shape=(rows, self._llama.n_vocab()))
        return _max_logprob(logits)

    def last_logprob(self) -> float:
        """Log-probability of the argmax token of the last row evaluated."""
        return _max_logprob(self.last_logits()[None, :])[0]

    def commit(self, tokens: list[int]) -> None:
        """Record `tokens` (just verified) as cached and drop any rows after them (the
        logits buffer holds the batch's rows: `generate` evaluates before sampling)."""
        llama = self._llama
        n_past = llama.n_tokens
        llama.input_ids[n_past:n_past + len(tokens)] = tokens
        self.truncate(n_past + len(tokens))

    def score(self, prefix: list[int], tokens: list[int]) -> float:
        """Sum of log p(token | everything before it) over `tokens` after `prefix`, reusing
        the cached prefix; only rows predicting `tokens` get logits (the vocabulary
        projection is a large share of a row's cost). Leaves the sequence cached."""
        import llama_cpp

        llama = self._llama
        sequence = prefix + tokens
        self.truncate(min(self.shared_prefix(sequence), len(prefix) - 1) if prefix else 0)
        n_vocab = llama.n_vocab()
        total = 0.0
        while llama.n_tokens < len(sequence):
            at = llama.n_tokens
            chunk = sequence[at:at + llama.n_batch]
            # Row r predicts sequence[at + r + 1].
            wanted = range(max(0, len(prefix) - 1 - at), min(len(chunk), len(sequence) - 1 - at))
            llama._batch.set_batch(batch=chunk, n_past=at, logits_all=False)
            for r in range(len(chunk)):
                llama._batch.batch.logits[r] = r in wanted
            llama._ctx.decode(llama._batch)
            for r in wanted:
                row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llama._ctx.ctx, r),
                                            shape=(n_vocab,)).astype(np.float64)
                peak = row.max()
                total += float(row[sequence[at + r + 1]] - peak
                               - np.log(np.exp(row - peak).sum()))
            self.commit(chunk)
        return total

    # -- saving and restoring -----------------------------------------------------------------

    def save(self) -> SavedSequence | None:
        """A copy of the sequence (llama.cpp's per-sequence state: only this sequence's KV,
        not `Llama.save_state`'s whole logits buffer), or None when llama.cpp fails."""
        import llama_cpp

        ctx = self._llama._ctx.ctx
        size = llama_cpp.llama_state_seq_get_size(ctx, 0)
        state = (ctypes.c_uint8 * size)()
        if llama_cpp.llama_state_seq_get_data(ctx, state, size, 0) != size:
            return None
        return SavedSequence(self.tokens, state)

    def restore(self, saved: SavedSequence) -> bool:
        """Make the cache hold `saved` again. On failure the cache is emptied (never left
        stale) and False returned."""
        import llama_cpp

        llama = self._llama
        ctx = llama._ctx.ctx
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), 0, -1, -1)
        if llama_cpp.llama_state_seq_set_data(ctx, saved.state, len(saved.state), 0) == 0:
            llama.reset()
            return False
        llama.input_ids[: len(saved.tokens)] = saved.tokens
        llama.n_tokens = len(saved.tokens)
        llama._requires_eval = True  # the logits are another sequence's
        return True


def _max_logprob(logits: np.ndarray) -> list[float]:
    """log softmax(row)[argmax] per row: max - logsumexp, computed stably in float64."""
    rows = logits.astype(np.float64)
    peak = rows.max(axis=1)
    return [float(x) for x in -np.log(np.exp(rows - peak[:, None]).sum(axis=1))]
