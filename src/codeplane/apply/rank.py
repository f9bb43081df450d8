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

from codeplane.models.engine import ContextOverflow, LocalModel
from codeplane.models.jobs import JobContext

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


def rank(ctx: JobContext, first: list[str], second: list[str]) -> Ranking:
    """Score both readings over the places where they differ, each with the same context
    (the engine job `apply.rank`, in the model's worker)."""
    model = ctx.model
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
    """Sum of log p(token | everything before it) over `tokens`, after `prefix`, scored on
    the model's KV cache (`models/kv.py`: batch logits, cached prefix reused)."""
    sequence = prefix + tokens
    if len(sequence) >= model.n_ctx:
        raise ContextOverflow(len(sequence), model.n_ctx)
    return model.kv.score(prefix, tokens)
