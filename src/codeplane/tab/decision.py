"""Show or hide a suggestion: a logistic model over signals that cost nothing at serve time.

One threshold on the geometric-mean token probability hid right answers (issue 18): a long
line the model is sure of except for one name, and a short guess it is sure of, get the same
mean. The model below combines what the generation already tells us - the mean, minimum and
first token log-probabilities, the length, where the cursor is, what the suggestion does to
the line - into P(the suggestion is exactly the line the author wrote). Its coefficients are
fitted on the tuning positions (`bench/tab.py --fit`, projects the held-out benchmark never
scores) and written here as plain numbers: no pickles, reviewable, and a re-fit is a diff.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from codeplane.tab import postprocess


@dataclass(frozen=True)
class Signals:
    """What the decision reads; every field is known when the generation ends."""

    mean_logprob: float  # per-token mean over the kept tokens (log of the old `confidence`)
    min_logprob: float  # the least likely kept token
    first_logprob: float  # the first generated token (healed tokens: constrained)
    tokens: int  # kept tokens
    mid_line: bool  # code left of the cursor on its line (not just indentation)
    typed_chars: int  # non-blank characters left of the cursor on its line
    truncated: bool  # the token budget ran out before the line ended
    closes_bracket: bool  # the suggestion closes a bracket the prefix opened

    def to_json(self) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}


FEATURES = ("mean_logprob", "min_logprob", "first_logprob", "log_tokens", "mid_line",
            "log_typed_chars", "truncated", "closes_bracket")
# Fitted by `bench/tab.py --fit` (L2-regularised logistic regression, target: exact line) on
# the pooled tuning positions; the data, the curves and the threshold rule are in docs/tab.md
# ("Session 9: nothing hidden, two fixes, and `heldout3`"). Read: a
# suggestion is more likely right when its tokens on average and its least likely token are
# likely, when it closes the bracket in progress, when it is short; less when the token
# budget cut it.
COEFFICIENTS = {"intercept": 1.3431, "mean_logprob": 1.9868, "min_logprob": 1.7567,
                "first_logprob": 0.278, "log_tokens": -0.5344, "mid_line": 0.2772,
                "log_typed_chars": 0.1932, "truncated": -1.0268, "closes_bracket": 0.5799}


def features(s: Signals) -> dict[str, float]:
    """The model's inputs (logs keep long lines and long prefixes from dominating)."""
    return {"mean_logprob": s.mean_logprob, "min_logprob": s.min_logprob,
            "first_logprob": s.first_logprob, "log_tokens": math.log1p(s.tokens),
            "mid_line": float(s.mid_line), "log_typed_chars": math.log1p(s.typed_chars),
            "truncated": float(s.truncated), "closes_bracket": float(s.closes_bracket)}


def probability(s: Signals, coefficients: dict[str, float] = COEFFICIENTS) -> float:
    """P(exact line | signals) under the fitted model; 0 for an empty suggestion."""
    if s.tokens == 0:
        return 0.0
    return logistic(features(s), coefficients)


def logistic(x: dict[str, float], coefficients: dict[str, float]) -> float:
    """The show/hide mechanism FIM and next-edit Tab (`nextedit.py`) share: intercept plus
    each feature times its coefficient, through the logistic function."""
    z = coefficients["intercept"] + sum(coefficients[k] * v for k, v in x.items())
    return 1.0 / (1.0 + math.exp(-max(min(z, 60.0), -60.0)))


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = 1.0) -> np.ndarray:
    """L2-regularised logistic regression (Newton's method: ten coefficients do not need a
    machine-learning library) of `y` (0/1) on `x`, whose first column is the intercept's 1s
    (not shrunk). The coefficients, in `x`'s column order."""
    w = np.zeros(x.shape[1])
    ridge = np.diag([0.0] + [l2] * (x.shape[1] - 1))
    for _ in range(50):
        p = 1 / (1 + np.exp(-x @ w))
        step = np.linalg.solve(x.T @ (x * (p * (1 - p))[:, None]) + ridge,
                               x.T @ (y - p) - ridge @ w)
        w += step
        if np.abs(step).max() < 1e-8:
            break
    return w


def signals(text: str, prefix: str, logprobs: list[float], truncated: bool) -> Signals:
    """The signals of a post-processed suggestion `text` whose kept tokens had `logprobs`."""
    line = prefix.rsplit("\n", 1)[-1]
    lps = logprobs or [0.0]
    opened = postprocess.open_brackets(prefix)
    return Signals(mean_logprob=sum(lps) / len(lps), min_logprob=min(lps),
                   first_logprob=lps[0], tokens=len(logprobs) if text else 0,
                   mid_line=bool(line.strip()), typed_chars=len(line.strip()),
                   truncated=truncated,
                   closes_bracket=postprocess.closes_open(text, opened,
                                                          postprocess.open_quote(prefix)))
