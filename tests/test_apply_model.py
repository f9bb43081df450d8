"""Apply's model path on the real code-small model: a small window, decoded speculatively
(original as the draft) and plainly; greedy verification must give identical output in far
fewer forward passes. Also `POST /v1/apply` falling back to the model, and the drafter's
choice of where to copy from (plain token lists, no model)."""

from __future__ import annotations

import httpx
import pytest

from codeplane.apply.api import apply_edit
from codeplane.apply.rewrite import _head, _stop_line
from codeplane.apply.speculative import MIN_AGREE, Drafter, _draft

ORIGINAL = '''"""Text helpers."""


def shout(text):
    """Upper-case text and add an exclamation mark."""
    return text.upper() + "!"


def whisper(text):
    """Lower-case text and add an ellipsis."""
    return text.lower() + "..."


def munge(self, text):
    """Expand tabs and normalise whitespace."""
    if self.expand_tabs:
        text = text.expandtabs(self.tabsize)
    if self.replace_whitespace:
        text = text.translate(self.table)
    return text


def count_words(text):
    """Number of whitespace-separated words."""
    return len(text.split())
'''
SKETCH = '''# ... existing code ...
def munge(self, text):
    """Expand tabs and normalise whitespace."""
    if not text:
        return text
    if self.expand_tabs:
        text = text.expandtabs(self.tabsize)
# ... existing code ...
'''
EXPECTED = ORIGINAL.replace('''whitespace."""
    if self''', '''whitespace."""
    if not text:
        return text
    if self''')


REGION = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]  # the original window, as tokens
PIECE = [3, 4, 5, 50, 51, 6, 7]  # the edit: context 3 4 5, new 50 51, context 6 7


def test_drafter_follows_the_edit_piece_through_changed_tokens() -> None:
    drafter = Drafter([REGION, PIECE])
    # Output so far agrees with the region, not yet with the piece's first tokens.
    draft, agree = drafter.propose([1, 2], 8)
    assert draft == [3, 4, 5, 6, 7, 8, 9, 10] and agree == 2
    # After 1 2 3 4 5 ... the region and the piece both fit; the region agrees further back,
    # unless the piece was followed from its start long enough to be trusted.
    assert drafter.propose([1, 2, 3, 4, 5], 4)[0] == [6, 7, 8, 9]
    trusted = Drafter([REGION, [3, 4, 5, 20, 21, 22, 50, 51, 6, 7]])
    assert trusted.propose([2, 3, 4, 5, 20, 21, 22], 4)[0] == [50, 51, 6, 7]
    # Once the output has the new tokens, only the piece continues it, up to its end.
    assert drafter.propose([4, 5, 50], 8) == ([51, 6, 7], 3)
    # After the piece's last context token the output goes on in the region.
    assert drafter.propose([50, 51, 6, 7], 3)[0] == [8, 9, 10]


def test_no_draft_without_evidence() -> None:
    drafter = Drafter([REGION, PIECE])
    assert _draft(drafter, [99, 98, 12], 64) == []  # one shared token: write, don't copy
    long = _draft(drafter, list(range(1, 9)), 64)
    assert long == [9, 10, 11, 12] and MIN_AGREE <= 8
    assert _draft(drafter, [77, 1, 2, 3], 64) == [4, 5, 6, 7, 8, 9]  # 2 per agreed token


def test_head_prefills_the_edits_leading_context() -> None:
    region = ["a = 1", "", "def f():", "    x = 1", "    return x", "b = 2"]
    piece = ["def f():", "    x = 1", "    y = 2", "    return x + y"]
    assert _head(region, 1, piece) == region[:4]
    assert _head(region, 1, ["    y = 2"]) == region[:1]  # nothing certain beyond the margin


def test_output_stopping_in_the_margin_gets_the_rest_of_the_window() -> None:
    region = ["def f():", "    x = 1", "    return x", "", "", "def g():", "    pass"]
    # The model stopped after `return x`: the blank lines and g() come from the original.
    assert _stop_line(region, ["def f():", "    y = 2", "    return x"], 2) == 3
    assert _stop_line(region, ["def f():", "    return x", "", "def g():"], 2) == 6
    assert _stop_line(region, ["def f():", "    y = 2"], 2) is None  # stopped before the end


@pytest.mark.model
def test_model_path_speculative_matches_plain_with_fewer_passes(engine) -> None:
    spec = apply_edit(ORIGINAL, SKETCH, "text.py", engine, method="model")
    plain = apply_edit(ORIGINAL, SKETCH, "text.py", engine, method="model", speculative=False)
    assert spec.ok and plain.ok, (spec.diagnostics, plain.diagnostics)
    assert spec.method == plain.method == "model"
    assert spec.merged == plain.merged == EXPECTED
    assert spec.output_tokens == plain.output_tokens > 0
    assert spec.stats["accepted"] > 0
    assert spec.stats["forward_passes"] * 2 < plain.stats["forward_passes"]
    assert spec.tokens_per_second > 0 and spec.seconds > 0


@pytest.mark.model
def test_http_falls_back_to_model_when_told(live_server) -> None:
    response = httpx.post(f"{live_server.url}/v1/apply", timeout=120, json={
        "path": "text.py", "original": ORIGINAL, "edit": SKETCH, "method": "model"})
    assert response.status_code == 200
    data = response.json()
    assert data["ok"] and data["method"] == "model" and data["merged"] == EXPECTED
    assert data["output_tokens"] > 0
    unknown = httpx.post(f"{live_server.url}/v1/apply", timeout=30, json={
        "path": "text.py", "original": ORIGINAL, "edit": SKETCH, "method": "model",
        "model": "no-such-model"})
    assert unknown.status_code == 404
