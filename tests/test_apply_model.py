"""Apply's model path on the real code-small model: a small window, decoded speculatively
(original as the draft) and plainly; greedy verification must give identical output in far
fewer forward passes. Also `POST /v1/apply` falling back to the model."""

from __future__ import annotations

import httpx
import pytest

from codeplane.apply.api import apply_edit

pytestmark = pytest.mark.model

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
