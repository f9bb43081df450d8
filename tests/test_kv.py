"""The model's KV cache API (`models/kv.py`) on the real small model: whatever used the
cache last (a speculative verify, a scoring pass, a restored Tab slot), the engine's own
greedy generation gives the same tokens as from an empty cache; scores do not depend on
what was cached; a saved sequence comes back whole."""

from __future__ import annotations

import numpy as np
import pytest

from codeplane.models.engine import Decoding

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
OTHER = "class Stack:\n    \"\"\"A last-in first-out list.\"\"\"\n\n    def push(self, x):\n"


def _fresh_generate(model, tokens: list[int]) -> str:
    model.kv.truncate(0)
    return model.generate(tokens, Decoding(max_tokens=12)).text


def _greedy_by_verify(model, prompt: list[int], count: int) -> list[int]:
    """Greedy tokens one verify pass at a time (the speculative loop without drafts)."""
    model.kv.prefill(prompt)
    out = [int(np.argmax(model.kv.last_logits()))]
    while len(out) < count:
        out.append(int(model.kv.verify([out[-1]])[0]))
        model.kv.commit([out[-2]])
    return out


def test_generate_after_verify_and_commit_matches_an_empty_cache(local_model) -> None:
    def run(model):
        prompt = model.tokenize(PROMPT)
        text = _fresh_generate(model, prompt)
        model.kv.truncate(0)
        want = _greedy_by_verify(model, prompt, 12)
        assert model.detokenize(want) == text  # batch rows agree with the engine's loop
        model.kv.truncate(0)
        assert model.kv.prefill(prompt) == 0
        draft = [want[0], *want[1:4], want[4] + 1]  # the last draft token disagrees
        preds = model.kv.verify(draft)
        assert list(preds[:4]) == want[1:5]
        model.kv.commit(draft[:4])  # the agreed part only
        assert model.kv.n_past == len(prompt) + 4
        assert model.kv.tokens == prompt + want[:4]
        # The engine's generate reuses the committed prefix and continues correctly.
        again = model.generate(prompt, Decoding(max_tokens=12))
        assert again.text == text and again.cached_tokens >= len(prompt) - 1
        return True

    assert run(local_model)


def test_score_does_not_depend_on_what_is_cached(local_model) -> None:
    def run(model):
        prefix, tokens = model.tokenize(PROMPT), model.tokenize("    if n < 2:\n")
        model.kv.truncate(0)
        cold = model.kv.score(prefix, tokens)
        warm = model.kv.score(prefix, tokens)  # prefix now cached
        model.kv.prefill(model.tokenize(OTHER))
        other = model.kv.score(prefix, tokens)
        assert cold < 0
        assert warm == pytest.approx(cold, abs=1e-2)
        assert other == pytest.approx(cold, abs=1e-2)
        assert model.kv.tokens == prefix + tokens
        # and generation after a scoring pass is still right
        after = model.generate(prefix, Decoding(max_tokens=12)).text
        assert after == _fresh_generate(model, prefix)
        return True

    assert run(local_model)


def test_saved_sequence_comes_back(local_model) -> None:
    def run(model):
        first, second = model.tokenize(PROMPT), model.tokenize(OTHER)
        want = _fresh_generate(model, first)
        model.kv.truncate(0)
        model.kv.prefill(first)
        saved = model.kv.save()
        assert saved is not None and saved.tokens == first and saved.size > 0
        model.kv.prefill(second)
        assert model.kv.shared_prefix(first) < len(first)
        assert model.kv.restore(saved)
        assert model.kv.shared_prefix(first) == len(first)
        # The prompt is exactly the restored tokens: the logits buffer is still the other
        # sequence's, so generate must evaluate again rather than sample from it.
        again = model.generate(first, Decoding(max_tokens=12))
        assert again.text == want
        return True

    assert run(local_model)
