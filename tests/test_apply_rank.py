"""A sketch that fits two places equally well: the deterministic merge declines and hands
over both complete readings; with a model, the likelier one is taken (real code-small,
scoring only). The two orders of the same file put the right answer first, then second, so
a scorer that ignores the code cannot pass both."""

from __future__ import annotations

import pytest

from codeplane.apply import rank
from codeplane.apply.formats import parse_edit, split_lines
from codeplane.apply.merge import merge
from codeplane.apply.service import apply_edit

AREA = "def area(width, height):\n    check(width)\n    check(height)\n    return width * height\n"
VOLUME = ("def volume(width, height, depth):\n    check(width)\n    check(height)\n"
          "    return width * height * depth\n")
# `depth` only exists in volume(); the context lines exist in both functions.
SKETCH = ("# ... existing code ...\n    check(width)\n    check(depth)\n    check(height)\n"
          "# ... existing code ...\n")


def _file(first: str, second: str) -> str:
    return f"{first}\n\n{second}"


def _expected(original: str) -> str:
    head, tail = original.split("def volume", 1)
    return head + "def volume" + tail.replace("    check(width)\n",
                                              "    check(width)\n    check(depth)\n", 1)


def test_tie_declines_without_a_model_and_hands_over_both_readings() -> None:
    original = _file(AREA, VOLUME)
    result = apply_edit(original, SKETCH, "geo.py")
    assert not result.ok and result.merged is None
    assert any("fits the original equally well" in d for d in result.diagnostics)
    lines, _, _ = split_lines(original)
    readings = merge(lines, parse_edit(SKETCH, lines)).readings
    joined = sorted("\n".join(r) + "\n" for r in readings)
    assert len(readings) == 2 and _expected(original) in joined
    assert original.replace("    check(width)\n", "    check(width)\n    check(depth)\n",
                            1) in joined


@pytest.mark.parametrize("order", [(AREA, VOLUME), (VOLUME, AREA)])
def test_model_picks_the_reading_where_the_new_line_makes_sense(engine, order) -> None:
    original = _file(*order)
    result = apply_edit(original, SKETCH, "geo.py", engine, "code-small")
    assert result.ok, result.diagnostics
    assert result.method == "model" and result.merged == _expected(original)
    ranking = result.stats["ranking"]
    assert abs(ranking["scores"][0] - ranking["scores"][1]) >= rank.MIN_MARGIN
    assert any("ranked by code-small" in d for d in result.diagnostics)


def test_a_close_ranking_is_not_taken(engine, monkeypatch) -> None:
    monkeypatch.setattr(rank, "MIN_MARGIN", 1e9)
    result = apply_edit(_file(AREA, VOLUME), SKETCH, "geo.py", engine, "code-small",
                        speculative=False)
    assert any("too close to call" in d for d in result.diagnostics), result.diagnostics
    assert "ranking" in result.stats

