"""Break a tie between two readings of a sketch by how likely the local model finds each.

When the deterministic merge finds a segment fitting two places equally well (the same
context lines twice in the file), costs cannot choose, but the code around each place can:
a new `assert` belongs after the test it extends, not after a look-alike. Scoring is one
batched forward pass per difference, with no decoding, so it costs about a prefill of the
changed regions and their context. The pick is taken only with a clear margin; otherwise the
apply still declines (a wrong merge is worse than none).
"""

from __future__ import annotations

import difflib
import time
from dataclasses import dataclass

import numpy as np

from codeplane.apply.speculative import commit
from codeplane.models.engine import ContextOverflow, LocalModel

CONTEXT = 24  # lines shared before (and scored after) each difference
MIN_MARGIN = 3.0  # nats: the pick must be e^3 (about 20) times likelier than the other


@dataclass
class Ranking:
    scores: tuple[float, float]  # log-likelihood of each reading's differing regions
    tokens: int  # tokens scored, both readings
    seconds: float

    @property
    def best(self) -> int:
        return 0 if self.scores[0] >= self.scores[1] else 1

    @property
    def margin(self) -> float:
        return abs(self.scores[0] - self.scores[1])


def rank(model: LocalModel, first: list[str], second: list[str]) -> Ranking:
    """Score both readings over the places where they differ, each with the same context."""
    start = time.perf_counter()
    scores, tokens = [0.0, 0.0], 0
    for context, texts in _differences(first, second):
        prefix = model.tokenize(context)
        for which, text in enumerate(texts):
            scored = model.tokenize(text)
            scores[which] += _log_likelihood(model, prefix, scored)
            tokens += len(scored)
    return Ranking((scores[0], scores[1]), tokens, time.perf_counter() - start)


def _differences(first: list[str], second: list[str]):
    """(context, (first's text, second's text)) per group of nearby differences: up to
    CONTEXT equal lines before it as the shared context, the differing lines and up to
    CONTEXT equal lines after it as the scored text (how well what follows fits counts)."""
    matcher = difflib.SequenceMatcher(None, first, second, autojunk=False)
    for group in matcher.get_grouped_opcodes(CONTEXT):
        tag, i1, i2, _, _ = group[0]
        lead = first[i1:i2] if tag == "equal" else []
        body = group[1:] if tag == "equal" else group
        a = [line for _, a1, a2, _, _ in body for line in first[a1:a2]]
        b = [line for _, _, _, b1, b2 in body for line in second[b1:b2]]
        yield "\n".join(lead) + "\n", ("\n".join(a) + "\n", "\n".join(b) + "\n")


def _log_likelihood(model: LocalModel, prefix: list[int], tokens: list[int]) -> float:
    """Sum of log p(token | everything before it) over `tokens`, after `prefix`. Runs on
    llama.cpp's batch API with logits on every row, as `speculative.py` verifies drafts
    (the engine's models keep only the last row's logits); reuses the KV cache's prefix and
    records what it evaluated, so the engine's prefix reuse stays valid."""
    import llama_cpp

    llama = model.llama
    sequence = prefix + tokens
    if len(sequence) >= model.n_ctx:
        raise ContextOverflow(len(sequence), model.n_ctx)
    keep = min(model.cached_prefix(sequence), len(prefix) - 1) if prefix else 0
    llama._ctx.kv_cache_seq_rm(-1, keep, -1)
    llama.n_tokens = keep
    n_vocab = llama.n_vocab()
    total = 0.0
    while llama.n_tokens < len(sequence):
        at = llama.n_tokens
        chunk = sequence[at:at + llama.n_batch]
        # Row r predicts sequence[at + r + 1]; only the rows predicting `tokens` need logits
        # (the vocabulary projection is a large share of a row's cost).
        wanted = range(max(0, len(prefix) - 1 - at), min(len(chunk), len(sequence) - 1 - at))
        llama._batch.set_batch(batch=chunk, n_past=at, logits_all=False)
        for r in range(len(chunk)):
            llama._batch.batch.logits[r] = r in wanted
        llama._ctx.decode(llama._batch)
        for r in wanted:
            row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llama._ctx.ctx, r),
                                        shape=(n_vocab,)).astype(np.float64)
            peak = row.max()
            total += float(row[sequence[at + r + 1]] - peak - np.log(np.exp(row - peak).sum()))
        commit(llama, chunk)
    return total
