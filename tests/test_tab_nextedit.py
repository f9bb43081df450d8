"""Next-edit Tab's model-free parts (`tab/nextedit.py`): reading the model's answer in each
format, the repeat-the-last-edit baseline, jumps, request validation."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from pydantic import ValidationError

from codeplane.tab import decision, lsp
from codeplane.tab.nextedit import (
    MAX_OPEN_FILE_CHARS,
    MAX_OPEN_FILES,
    NextRequest,
    Suggestion,
    _Watch,
    answer_budget,
    jump_for,
    near_repeat,
    next_features,
    next_probability,
    next_signals,
    parse,
    prompt_parts,
    repeat_last_edit,
    rewrite_of,
    window_of,
)

TEXT = "".join(f"line{n} = {n}\n" for n in range(40))
RENAME = {"path": "a.py", "line": 5, "before": "line5 = old(5)\n", "after": "line5 = new(5)\n"}


def req(text: str = TEXT, line: int = 20, **extra) -> NextRequest:
    return NextRequest(path="a.py", text=text, cursor={"line": line, "character": 0}, **extra)


def test_window_answer_is_the_smallest_changed_range():
    start, window = window_of(TEXT, 20)
    assert (start, len(window)) == (10, 21)
    new = window.copy()
    new[5] = "line15 = changed\n"
    got = parse("".join(new), "window", req())
    assert got == Suggestion(15, 16, "line15 = changed\n")
    assert parse("".join(window), "window", req()) is None  # a copy changes nothing
    # the model stopped early on a window line: the rest of the window stays
    assert parse("".join(new[:7]), "window", req()) == Suggestion(15, 16, "line15 = changed\n")


def test_a_cursor_answer_starts_at_the_cursors_line():
    """`cursor`: the prompt's updated window already holds the lines above the cursor's,
    so the model writes from there; an answer that ends at once changes nothing."""
    r = req(format="cursor")
    _, window = window_of(TEXT, 20)
    _, current, lead = prompt_parts(r, "cursor")
    assert current == "".join(window) and lead == "".join(window[:10])
    got = parse(lead + "line20 = 20\nline21 = 21\nline22 = changed\nline23 = 23\n", "cursor", r)
    assert got == Suggestion(22, 23, "line22 = changed\n")
    assert parse(lead, "cursor", r) is None
    watch = _Watch(threading.Event(), 40, window, lead, 2)
    assert watch.feed("line20 = 20") and watch.feed("line21 = 21")
    assert watch.feed("inserted = 1") and watch.feed("line22 = 22")
    assert not watch.feed("line23 = 23")  # two lines copied after the change: done
    assert parse(watch.spliced, "cursor", r) == Suggestion(22, 22, "inserted = 1\n")


def test_diff_answer_applies_at_the_old_lines_nearest_the_cursor():
    text = TEXT.replace("line12 = 12", "x = 1").replace("line25 = 25", "x = 1")
    got = parse("@@ line 21 @@\n-x = 1\n+x = 2\nsome prose\n", "diff", req(text))
    assert got == Suggestion(25, 26, "x = 2\n")
    assert parse("-not in the window\n+y\n", "diff", req()) is None
    assert parse("+only added\n", "diff", req()) is None


def test_baseline_repeats_a_one_word_change_at_the_next_occurrence():
    text = TEXT.replace("line22 = 22", "line22 = old(22)").replace("line30 = 30",
                                                                   "line30 = old(3)")
    r = req(text, edits=[RENAME])
    assert repeat_last_edit(r) == Suggestion(22, 23, "line22 = new(22)\n")
    assert near_repeat(r) == Suggestion(22, 23, "line22 = new(22)\n")
    assert jump_for(r, near_repeat(r)) == {"path": "a.py", "line": 30}
    two_words = {**RENAME, "after": "line5 = new(6)\n"}
    assert repeat_last_edit(req(text, edits=[two_words])) is None
    far = req(TEXT.replace("line35 = 35", "line35 = old(1)"), line=5, edits=[RENAME])
    assert near_repeat(far) is None and jump_for(far, None) == {"path": "a.py", "line": 35}


@pytest.mark.parametrize("line,character", [(40, 1), (41, 0), (3, 12)])
def test_cursor_outside_the_text_is_refused(line, character):
    with pytest.raises(ValidationError):
        NextRequest(path="a.py", text=TEXT, cursor={"line": line, "character": character})


def test_suggestion_applies_to_the_file():
    assert Suggestion(1, 2, "B\n").apply("a\nb\nc\n") == "a\nB\nc\n"
    assert Suggestion(1, 1, "new\n").apply("a\nb\n") == "a\nnew\nb\n"


def test_rule_signals_of_a_served_suggestion():
    text = TEXT.replace("line22 = 22", "line22 = old(22)")
    r = req(text, edits=[RENAME])
    found = near_repeat(r)
    s = next_signals(r, None, found, "repeat")
    assert (s.repeat, s.agrees, s.distance, s.changed_lines) == (True, True, 2, 2)
    assert (s.min_logprob, s.sum_logprob) == (0.0, 0.0)  # no model output behind it
    other = next_signals(r, None, Suggestion(30, 31, "x = 1\n"), "repeat")
    assert not other.agrees and other.distance == 10
    # the rule is tab/decision.py's logistic over these signals: sure answers score higher
    coef = {"intercept": 0.0, "min_logprob": 1.0, "sum_logprob": 0.0, "log_changed_lines": 0.0,
            "log_distance": -1.0, "agrees": 2.0, "repeat": 0.0}
    assert next_probability(s, coef) > next_probability(other, coef)
    assert next_probability(s, coef) == pytest.approx(
        decision.logistic(next_features(s), coef))


def test_the_rule_is_fitted_as_fims_decision_is():
    """`bench/nextedit.py --fit` and `bench/tab.py --fit` share decision.fit_logistic: on
    data drawn from a known logistic model it finds that model's coefficients."""
    rng = np.random.default_rng(34)
    x = rng.normal(size=2000)
    y = (rng.random(2000) < 1 / (1 + np.exp(-(0.5 + 2.0 * x)))).astype(float)
    w = decision.fit_logistic(np.column_stack([np.ones_like(x), x]), y, l2=0.0)
    assert list(w) == pytest.approx([0.5, 2.0], abs=0.3)


def test_a_window_rewrite_stops_once_it_rejoins_the_window():
    """The decode's guide stops a `window` rewrite after JOIN_LINES copied lines that follow
    a change, and splices the window's remaining lines in; a rewrite that has changed
    nothing yet, or copied fewer lines since its change, goes on."""
    _, window = window_of(TEXT, 20)
    watch = _Watch(threading.Event(), 40, window, window[0], 2)
    assert all(watch.feed(line.rstrip("\n")) for line in window[1:5])  # a copy so far
    assert watch.feed("inserted = 1") and watch.feed("line15 = changed")  # the edit
    assert watch.feed("line16 = 16") and watch.spliced is None  # one line copied
    assert not watch.feed("line17 = 17")  # two: the rest is the window's
    new = [*window[:5], "inserted = 1\n", "line15 = changed\n", *window[6:]]
    assert watch.spliced == "".join(new)
    assert parse(watch.spliced, "window", req()) == Suggestion(15, 16,
                                                               "inserted = 1\nline15 = changed\n")


BLANKS = "a = 10\nb = 2\n\n\ndef one():\n    return 1\n\n\ndef two():\n    return 2\n"


def test_a_decoded_answer_is_read_as_the_decode_reads_it():
    """What `predict` makes of a decode that wrote `output`: the guide's splice once the
    rewrite re-joined the window - not `parse`'s guess of where an answer that stops early
    ends, which two inserted lines before a run of blank lines fooled (it cut the window
    at the blank line nearest the answer's length, and removed `def one`)."""
    r = req(BLANKS, 0, format="cursor")
    output = "b = 2\nc = 3\nd = 4\n\n\n"  # two lines inserted, two blank lines copied
    want = BLANKS.replace("b = 2\n", "b = 2\nc = 3\nd = 4\n")
    assert parse(rewrite_of(r, output), "cursor", r).apply(BLANKS) == want
    assert parse(rewrite_of(r, ""), "cursor", r) is None  # "no change": the end token alone
    assert parse(rewrite_of(req(BLANKS, 0), BLANKS[7:]), "window", req(BLANKS, 0)) is None


def test_a_cursor_answers_budget_is_the_window_after_the_cursors_line():
    """The decode may write the window's text after the prompt's lead and WINDOW_SLACK_TOKENS
    more: for `cursor` the lines from the cursor's on, not the whole window (a model that
    copies on past the window stops sooner)."""
    chars = list  # one token a character
    _, window = window_of(TEXT, 20)
    slack = answer_budget(req(format="window"), chars) - len("".join(window[1:]))
    assert answer_budget(req(format="cursor"), chars) == len("".join(window[10:])) + slack


OPEN = [{"path": "b.py", "text": "x = 1\n"},
        {"path": "c.py", "text": "import a\n\ny = a.old(2)\nold()\n"},
        {"path": "d.py", "text": "old(3)\n"}]


def test_a_jump_goes_to_the_first_open_file_that_still_has_the_old_word():
    """The current file first (as the rename's next call site there); when it has none
    left, the first occurrence in the first of the editor's other open files, in the order
    given (the LSP sends the most recently edited first)."""
    r = req(TEXT, line=5, edits=[RENAME], open_files=OPEN)
    assert jump_for(r, None) == {"path": "c.py", "line": 2}
    here = req(TEXT.replace("line35 = 35", "line35 = old(1)"), line=5, edits=[RENAME],
               open_files=OPEN)
    assert jump_for(here, None) == {"path": "a.py", "line": 35}
    whole_words = [{"path": "b.py", "text": "older(1)\nbold = 2\n"}]
    assert jump_for(req(TEXT, line=5, edits=[RENAME], open_files=whole_words), None) is None
    assert jump_for(req(TEXT, line=5, open_files=OPEN), None) is None  # no rename, no jump
    assert r.for_model().open_files == [] and r.open_files  # their text stays on the server


@pytest.mark.parametrize("open_files", [
    [{"path": f"f{n}.py", "text": ""} for n in range(MAX_OPEN_FILES + 1)],  # too many
    [{"path": "b.py", "text": "x" * (MAX_OPEN_FILE_CHARS + 1)}],  # too long
    [{"path": "", "text": "old()\n"}],  # no path
    [{"path": "b\x00.py", "text": "old()\n"}],  # a control character
    [{"path": "a.py", "text": "old()\n"}],  # the current file is not another open file
    [{"path": "b.py", "text": "old()\n"}, {"path": "b.py", "text": "x\n"}],  # twice
    [{"path": "b.py", "text": "old()\n", "uri": "file:///b.py"}],  # unknown field
])
def test_bad_open_files_are_refused(open_files):
    with pytest.raises(ValidationError):
        req(TEXT, edits=[RENAME], open_files=open_files)


def test_the_lsp_sends_no_more_open_files_than_the_api_takes():
    assert lsp.JUMP_DOCUMENTS <= MAX_OPEN_FILES
    assert lsp.JUMP_DOCUMENT_CHARS <= MAX_OPEN_FILE_CHARS
