"""The show/hide decision (tab/decision.py): its signals come from the real generation and the
shown flag follows the fitted model, not the mean token probability alone."""

from __future__ import annotations

import dataclasses
import math

import httpx
import pytest

from codeplane.config import TabSettings
from codeplane.tab import decision, postprocess
from codeplane.tab.context import Budget, build_request
from codeplane.tab.decision import Signals


def sure(**change) -> Signals:
    base = Signals(mean_logprob=math.log(0.6), min_logprob=math.log(0.3),
                   first_logprob=math.log(0.9), tokens=6, mid_line=True, typed_chars=12,
                   truncated=False, closes_bracket=False)
    return dataclasses.replace(base, **change)


def test_signals_of_a_suggestion():
    s = decision.signals("b, c)", "x = f(a, ", [-0.1, -0.5, -0.2], truncated=False)
    assert s.tokens == 3 and s.mid_line and s.typed_chars == len("x = f(a,")
    assert s.mean_logprob == pytest.approx(-0.8 / 3) and s.min_logprob == -0.5
    assert s.first_logprob == -0.1 and s.closes_bracket
    empty = decision.signals("", "    ", [], truncated=True)
    assert empty.tokens == 0 and not empty.mid_line and decision.probability(empty) == 0.0


def test_closes_open_sees_only_brackets_the_prefix_opened():
    opened = postprocess.open_brackets("call(a, [1, ")
    assert opened == ["(", "["]
    assert postprocess.closes_open("2])", opened)
    assert not postprocess.closes_open("g(2) + h[3]", opened)  # balanced inside itself


def test_same_mean_probability_different_decision():
    """The old scalar (the mean token probability, 0.6 for both) could not tell these apart;
    the fitted model puts the suggestion hanging on one unlikely token, and the one the
    token budget cut, far below the even one."""
    even, one_guess = sure(), sure(min_logprob=math.log(0.05))
    assert even.mean_logprob == one_guess.mean_logprob
    assert decision.probability(even) > 5 * decision.probability(one_guess)
    assert decision.probability(sure(truncated=True)) < decision.probability(even) / 2


def test_nothing_is_hidden_by_default():
    """Session 9: the issue's rule with a safety margin, leaving each of the 20 tuning
    projects out, picks 0 - every hidden answer cost edit similarity the decision could not
    win back in exact line. A near-hopeless suggestion is shown, with its low confidence."""
    assert TabSettings().min_confidence == 0.0
    hopeless = sure(min_logprob=math.log(0.01), mean_logprob=math.log(0.2), truncated=True)
    assert 0.0 < decision.probability(hopeless) < 0.05


@pytest.mark.model
def test_tab_response_carries_the_signals_its_confidence_is_computed_from(live_server):
    text = "import os\n\n\ndef home():\n    return os.path.expan"
    body = build_request("home.py", text, len(text), None, Budget(), cursor_id="dec1",
                         min_confidence=0.0)
    tab = httpx.post(f"{live_server.url}/v1/tab", json=body, timeout=120).json()
    assert tab["source"] == "model" and tab["text"], tab
    sig = Signals(**tab["signals"])
    assert sig.tokens > 0 and sig.mid_line and sig.typed_chars == len("return os.path.expan")
    assert tab["confidence"] == pytest.approx(decision.probability(sig), abs=2e-3)
