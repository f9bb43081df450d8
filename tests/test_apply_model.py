"""Apply's model path on the real code-small model: a small window, decoded speculatively
(original as the draft) and plainly; greedy verification must give identical output in far
fewer forward passes. Also `POST /v1/apply` falling back to the model, and the drafter's
choice of where to copy from (plain token lists, no model)."""

from __future__ import annotations

import httpx
import pytest

from codeplane.apply.rewrite import Watch, _head, _stop_line, reshape
from codeplane.apply.service import apply_edit
from codeplane.models.speculative import DECAY, MIN_AGREE, Drafter, _Acceptance, _draft

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


def test_draft_length_from_evidence_acceptance_and_row_tiles() -> None:
    drafter = Drafter([REGION, PIECE])
    assert _draft(drafter, [99, 98, 12], 64) == []  # one shared token: write, don't copy
    # 4 tokens left in the region, but a 5-row pass pays a whole extra pass for its last row.
    assert _draft(drafter, list(range(1, 9)), 64) == [9, 10, 11] and MIN_AGREE <= 8
    source = Drafter([list(range(1, 200))])
    assert _draft(source, [77, 1, 2, 3], 64) == list(range(4, 15))  # <= 4 per agreed: 12 rows
    # Length from the recent acceptance: long drafts only where they are mostly accepted.
    assert len(_draft(source, list(range(1, 60)), 100, accept=0.999)) == 63
    assert len(_draft(source, list(range(1, 60)), 100, accept=0.9)) == 7
    assert _draft(source, list(range(1, 60)), 100, accept=0.5) == []  # a 1-row pass is cheaper
    assert len(_draft(source, list(range(1, 60)), 20, accept=0.999)) == 15  # room: tiles
    acceptance = _Acceptance()
    start = acceptance.rate
    acceptance.add(16, 16)
    assert acceptance.rate > start
    tries = acceptance.tries
    acceptance.add(16, 2)  # 2 accepted, the 3rd rejected; the other 13 were never tested
    assert acceptance.rate < start and acceptance.tries == pytest.approx(tries * DECAY + 3)


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


def test_reshape_accepts_only_the_original_with_pieces_spliced_in() -> None:
    region = ["def f():", "    x = 1", "    return x", "", "", "def g():", "    pass"]
    piece = ["def f():", "    x = 2", "    return x"]
    good = ["def f():", "    x = 2", "    return x", "", "", "def g():", "    pass"]
    assert reshape(region, good, [piece]) == good
    # A line in neither the original nor the edit (the model made it up): rejected.
    assert reshape(region, good[:2] + ["    y = 3"] + good[2:], [piece]) is None
    # The piece not kept whole, or an original line kept inside it: rejected.
    assert reshape(region, region, [piece]) is None
    assert reshape(region, good[:1] + ["    x = 1"] + good[1:], [piece]) is None
    # Pieces out of order: rejected.
    two = [["def f():", "    x = 2"], ["def g():", "    return 0"]]
    merged = ["def f():", "    x = 2", "    return x", "", "", "def g():", "    return 0"]
    assert reshape(region, merged, two) == merged
    assert reshape(region, merged[4:] + merged[:4], two) is None
    # An empty piece (a deleting SEARCH/REPLACE block) removes original lines anywhere.
    assert reshape(region, good[:1] + good[2:], [[]]) == region[:1] + region[2:]


def test_reshape_takes_original_bytes_and_puts_a_dedented_piece_back() -> None:
    region = ["class A:", "    def f(self):  ", "        return 1", "", "    x = 0"]
    piece = ["def f(self):", "    return 2"]  # written at column 0
    out = ["class A:", "    def f(self):", "        return 2", "", " x = 0"]
    # Original lines keep their bytes (trailing spaces, indentation the model dropped); the
    # piece gets the indentation the model gave it.
    assert reshape(region, out, [piece]) == ["class A:", "    def f(self):",
                                             "        return 2", "", "    x = 0"]
    # Blank lines between a piece's edge and the original, which a segment does not show
    # and the model dropped, are the original's and stay.
    blank = ["    T = 1", "", "    @runtime", "    class P:"]
    assert reshape(blank, ["    U = 0", "    T = 1", "    @runtime", "    class P:"],
                   [["    U = 0", "    T = 1"]]) == ["    U = 0", "    T = 1", "",
                                                     "    @runtime", "    class P:"]
    # A line the model alone indented differently keeps the piece's relative indentation.
    odd = ["class A:", "    def f(self):", "      return 2", "", "    x = 0"]
    assert reshape(region, odd, [piece + ["", "x = 0"]])[:3] == out[:3]


def test_watch_stops_bad_lines_and_forces_the_rest_of_a_started_piece() -> None:
    region = ["def f():", "    x = 1", "    return x", "", "def g():", "    pass"]
    piece = ["    x = 1", "    y = 2", "    z = 3", "    return x"]
    watch = Watch(region, [piece], ["def f():"])
    assert watch.feed("    x = 1") and watch.force(False) is None  # still a plain copy?
    assert watch.feed("    y = 2")  # now inside the piece, for certain
    assert watch.force(False) == "    z = 3\n    return x\n"
    assert not Watch(region, [piece], ["def f():"]).feed("    w = 0")  # in neither
    # The model wants to stop after the piece's first (context) line: the rest must follow.
    tail = ["    return x", "", "", "def chain():", "    pass"]
    ends = Watch(region[:3], [tail], region[:3])
    assert ends.force(True) == "\n\ndef chain():\n    pass\n"
    assert ends.force(False) is None  # not stopping: the copy may go on
    # A refused line is replaced by what it resembles: the rest of the piece the output is
    # in, or the original's next lines (a marker where the model means "unchanged").
    drift = Watch(region, [piece], ["def f():"])
    assert drift.feed("    x = 1") and not drift.feed("    y = 22")
    assert drift.repair("    y = 22") == "    y = 2\n    z = 3\n    return x\n"
    later = Watch(region, [["def g():", "    return 0"]], ["def f():"])
    assert not later.feed("    # ... existing code ...")
    assert later.repair("    # ... existing code ...") == "    x = 1\n    return x\n\n"
    # A marker right after a piece: the original goes on after the piece's last line.
    done = Watch(region + ["", "def h():", "    return 2"], [piece[:1] + piece[2:]], [])
    assert all(done.feed(x) for x in ["def f():", "    x = 1", "    z = 3", "    return x"])
    assert not done.feed("# ... existing code ...")
    assert done.repair("# ... existing code ...") == \
        "\ndef g():\n    pass\n\ndef h():\n    return 2\n"
    two = Watch(region + ["", "def h():", "    return 2"],
                [piece[:1] + piece[2:], ["def h():", "    return 3"]], [])
    assert all(two.feed(x) for x in ["def f():", "    x = 1", "    z = 3", "    return x"])
    assert two.repair("# ... existing code ...") == "\ndef g():\n    pass\n\n"
    # A piece written at column 0 is forced at the indentation the model gave it.
    flat = Watch(region, [["x = 1", "y = 2", "return x"]], ["def f():"])
    assert flat.feed("    x = 1") and flat.feed("    y = 2")
    assert flat.force(False) == "    return x\n"


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


def model_answers(engine, monkeypatch, merged: list[str]) -> None:
    """The model's rewrite (in its worker) answers `merged`; every other job runs as is."""
    from codeplane.apply.rewrite import Rewrite

    run_sync = engine.run_sync

    def rewrite(model: str, job: str, *args, **kwargs):
        return Rewrite(list(merged)) if job == "apply.rewrite" else run_sync(model, job, *args,
                                                                             **kwargs)
    monkeypatch.setattr(engine, "run_sync", rewrite)


def test_model_result_that_leaves_the_file_unchanged_is_rejected(engine, monkeypatch) -> None:
    """An edit that only re-indents a line aligns as "changes nothing" (the alignment
    collapses whitespace) and declines; a model rewrite that then returns the file as it was
    must not count as applied (the benchmark had one such wrong merge)."""
    original = "def f(x):\n    if x:\n        y = 1\n    return y\n\n\ndef g():\n    pass\n"
    sketch = "# ... existing code ...\n    if x:\n        y = 1\n        return y\n\n\n# ... existing code ...\n"
    model_answers(engine, monkeypatch, original.removesuffix("\n").split("\n"))
    result = apply_edit(original, sketch, "f.py", engine, "code-small")
    assert not result.ok and result.merged is None
    assert any("original file unchanged" in d for d in result.diagnostics), result.diagnostics


def test_model_result_that_python_cannot_compile_is_rejected(engine, monkeypatch) -> None:
    """The model's answer keeps a deleted function's body under the sketch's `try:` (pyjwt
    e1e4d02c5d, `fourth`, with the model path forced): tree-sitter's grammar recovers from
    it without an error node, so it was written; Python's own parser rejects it."""
    original = ("import hmac\n\n\nstring_types = (str, bytes)\n\n\ndef seconds(delta):\n"
                "    try:\n        delta.total_seconds\n    except AttributeError:\n"
                "        return delta.days\n\n    return 0\n\n\ntry:\n"
                "    compare = hmac.compare_digest\nexcept AttributeError:\n    compare = None\n")
    sketch = "# ... existing code ...\nstring_types = (str, bytes)\n\n\ntry:\n# ... existing code ...\n"
    lines = original.removesuffix("\n").split("\n")
    wrong = lines[:6] + ["try:"] + lines[8:]
    model_answers(engine, monkeypatch, wrong)
    result = apply_edit(original, sketch, "compat.py", engine, method="model")
    assert not result.ok and result.merged is None, result.merged
    assert any("does not compile" in d for d in result.diagnostics), result.diagnostics


def test_model_result_that_keeps_code_the_sketch_shows_deleted_is_rejected(
        engine, monkeypatch) -> None:
    """The sketch moves a block above a comment and shows the comment and the next block
    together; the model's answer adds the block above the comment and keeps the old copy
    between the two (bidict c1e297c824, `fifth`, `body`). Nothing it removes is unshown,
    so only the lines it keeps tell: two lines a segment shows together must be together
    in the result."""
    original = ("import os\n\n\n# Keep these pins in sync with CI.\n\nSETUP = [\n"
                "    'scm < 4',\n]\n\nDOCS = [\n    'sphinx',\n]\n")
    sketch = ("# ... existing code ...\n\n\nSETUP = [\n    'scm',\n]\n\n"
              "# Keep these pins in sync with CI.\n\nDOCS = [\n# ... existing code ...\n")
    lines = original.removesuffix("\n").split("\n")
    wrong = lines[:3] + ["SETUP = [", "    'scm',", "]", ""] + lines[3:]
    model_answers(engine, monkeypatch, wrong)
    result = apply_edit(original, sketch, "setup.py", engine, method="model")
    assert not result.ok and result.merged is None, result.merged
    assert any("together, but" in d for d in result.diagnostics), result.diagnostics


def test_model_result_that_keeps_a_moved_line_twice_is_rejected(engine, monkeypatch) -> None:
    """The same sketch as above; the model's own answer (bidict c1e297c824, `fifth`,
    `body`, written by the full path until session apply10): the old block rewritten in
    place into the new one, the file's comment kept above it and the sketch's copy of the
    comment written after it. Each of the two checks above passes it (it removes nothing
    unshown; the comment is in it twice); the comment is a line the file has once and the
    sketch shows once, so the sketch moves it: the merge may not keep the file's copy next
    to the segment that shows it elsewhere."""
    original = ("import os\n\n\n# Keep these pins in sync with CI.\n\nSETUP = [\n"
                "    'scm < 4',\n]\n\nDOCS = [\n    'sphinx',\n]\n")
    sketch = ("# ... existing code ...\n\n\nSETUP = [\n    'scm',\n]\n\n"
              "# Keep these pins in sync with CI.\n\nDOCS = [\n# ... existing code ...\n")
    lines = original.removesuffix("\n").split("\n")
    wrong = lines[:6] + ["    'scm',"] + lines[7:9] + [lines[3], ""] + lines[9:]
    model_answers(engine, monkeypatch, wrong)
    result = apply_edit(original, sketch, "setup.py", engine, method="model")
    assert not result.ok and result.merged is None, result.merged
    assert any("wrong-merge guard" in d for d in result.diagnostics), result.diagnostics


CLIENT_TEST = '''    def test_{0}(self):
        url = "https://example.com/data.json"

        with mocked():
            client = Client(url)
            {0} = client.{0}()

        assert len({0}) == 1
'''
CLIENT_TESTS = ("import os\n\n\nclass TestClient:\n" + CLIENT_TEST.format("get") + "\n"
                + CLIENT_TEST.format("keys"))
NEW_TEST = '''# ... existing code ...
class TestClient:
    def test_headers(self):
        url = "https://example.com/data.json"
        assert Client(url, headers={}).headers == {}

    def test_get(self):
        url = "https://example.com/data.json"

# ... existing code ...
'''
# A new test whose body copies `test_get`'s: read by difflib, the wrong answer below is
# `test_get` rewritten in place into it and `def test_keys` into `def test_get`, each line
# an edit the sketch shows (pyjwt 300348f7bc as the model wrote it).
LIKE_GET = '''# ... existing code ...
class TestClient:
    def test_headers(self):
        url = "https://example.com/data.json"

        with mocked() as request:
            client = Client(url, headers={"a": "b"})
            get = client.get()
            assert request.headers == {"a": "b"}

        assert len(get) == 1

    def test_get(self):
        url = "https://example.com/data.json"

# ... existing code ...
'''


@pytest.mark.parametrize("sketch", [NEW_TEST, LIKE_GET], ids=["new-test", "like-get"])
@pytest.mark.parametrize("drift", ["", "   "])
def test_model_result_that_deletes_code_the_sketch_does_not_show_is_rejected(
        engine, monkeypatch, drift, sketch) -> None:
    """The model path's result passes the deterministic merge's guards: the shape check
    lets a piece replace any run of original lines, so the model may splice the new test
    in and go on from the second copy of its last context line, deleting `test_get`'s body
    and `def test_keys` (pyjwt 300348f7bc, the full-path benchmark's wrong merges, in four
    styles). And context it wrote with the sketch's layout gets the file's back."""
    lines = CLIENT_TESTS.removesuffix("\n").split("\n")
    shown = sketch.split("\n")
    new = shown[2:shown.index("    def test_get(self):")]
    wrong = lines[:4] + new + lines[4:6] + lines[15:]
    right = lines[:4] + new + [lines[4] + drift] + lines[5:]
    model_answers(engine, monkeypatch, wrong)
    result = apply_edit(CLIENT_TESTS, sketch, "test_client.py", engine, method="model")
    assert not result.ok and result.merged is None
    assert any("wrong-merge guard" in d for d in result.diagnostics), result.diagnostics
    monkeypatch.undo()
    model_answers(engine, monkeypatch, right)
    result = apply_edit(CLIENT_TESTS, sketch, "test_client.py", engine, method="model")
    assert result.ok and result.method == "model", result.diagnostics
    assert result.merged == "\n".join(lines[:4] + new + lines[4:]) + "\n"
