"""Tab pieces that need no model: post-processing, client context, transport rule, telemetry."""

from __future__ import annotations

import json

import pytest

from codeplane.tab import postprocess
from codeplane.tab.client import TabClientError, check_transport
from codeplane.tab.context import QUANTUM, Budget, Ring, build_request, offset_of, window
from codeplane.tab.postprocess import Mode, choose_mode, clean
from codeplane.tab.telemetry import Telemetry

SINGLE = Mode(False, 1)


def test_single_line_stops_at_end_of_line():
    assert clean("x + 1\n    return y\n", "    y = ", "\n", SINGLE) == "x + 1"


def test_duplicate_closing_bracket_from_suffix_is_dropped():
    assert clean("a, b)", "x = foo(", ")\n", SINGLE) == "a, b"


def test_bracket_nothing_opened_is_cut():
    assert clean("a + b) * 2", "x = ", "\n", SINGLE) == "a + b"


def test_no_whitespace_duplicating_the_space_left_of_the_cursor():
    assert clean("  1 + 2", "x = ", "\n", SINGLE) == "1 + 2"
    assert clean(" self.x = 1", "        ", "\n", SINGLE) == " self.x = 1"  # indentation


def test_balanced_brackets_inside_suggestion_are_kept():
    assert clean("bar(a)[0] + 1", "x = ", "\n", SINGLE) == "bar(a)[0] + 1"


def test_multiline_block_ends_at_dedent_and_blank_line():
    prefix = "class A:\n    def f(self):"
    raw = "\n        y = 1\n        return y\n    def g(self):\n        pass\n"
    mode = choose_mode(prefix, "\n")
    assert mode.multiline
    assert clean(raw, prefix, "\n", mode) == "\n        y = 1\n        return y"
    raw = "    z = 2\n    return z\n\n    def h(self):\n"
    assert clean(raw, "class A:\n    def f(self):\n", "\n", Mode(True, 6)) == \
        "    z = 2\n    return z"


def test_multiline_does_not_repeat_next_existing_line():
    raw = "    y = 1\n    return y + 1\n"
    assert clean(raw, "def f():\n", "\n    return y + 1\n", Mode(True, 6)) == "    y = 1"


def test_multiline_respects_line_limit_and_early_stop():
    raw = "".join(f"    a{i} = {i}\n" for i in range(10))
    assert clean(raw, "def f():\n", "\n", Mode(True, 3)).count("\n") == 2
    mode = Mode(True, 6)
    assert not postprocess.complete_lines_done("    a = 1\n    b", "def f():\n", mode)
    assert postprocess.complete_lines_done("    a = 1\n\n    def g", "def f():\n", mode)


def test_mode_is_single_line_with_code_right_of_cursor():
    assert not choose_mode("x = foo(", ")\n").multiline
    assert not choose_mode("    x = 1", "\n").multiline
    assert choose_mode("def f():", "\n").multiline


def test_mid_line_edits_are_skipped():
    assert postprocess.mid_line_blocked("some_call(a, b)\n")
    assert not postprocess.mid_line_blocked(")\n")
    assert not postprocess.mid_line_blocked("\nnext line")


def test_whitespace_only_is_empty():
    assert clean("   \n", "x = ", "\n", SINGLE) == ""


def test_offset_of_is_zero_based_and_validates():
    text = "ab\ncde\n"
    assert offset_of(text, 1, 2) == 5
    assert offset_of(text, 1, 99) == 6  # clamped to the end of the line
    with pytest.raises(ValueError):
        offset_of(text, 5, 0)


def test_window_prefix_start_is_quantized_and_stable_while_typing():
    text = "".join(f"line_{i:04d} = {i}\n" for i in range(400))
    budget = Budget(prefix_tokens=300, suffix_tokens=20)
    offset = offset_of(text, 300, 0)
    prefix, suffix = window(text, offset, budget)
    assert len(prefix) <= 300 * 3 and text[:offset].endswith(prefix)
    first = int(prefix.split("\n")[0][5:9])
    assert first % QUANTUM == 0
    assert suffix.startswith("line_0300") and suffix.endswith("\n") is False
    # typing a few characters only extends the prefix: the start does not move
    typed = text[:offset] + "abc"
    prefix2, _ = window(typed, len(typed), budget)
    assert prefix2 == prefix + "abc"


def test_ring_keeps_order_dedups_and_respects_budget():
    ring = Ring(size=3, chunk_lines=4)
    text = "\n".join(f"x{i}" for i in range(20))
    ring.add("a.py", text, 2)
    ring.add("b.py", text, 10)
    ring.add("a.py", text, 2)  # same chunk again: replaces the older copy
    assert [c.path for c in ring.chunks] == ["b.py", "a.py"]
    assert [c.path for c in ring.snippets("a.py", 1000)] == ["b.py"]
    assert ring.snippets("c.py", 1) == []
    body = build_request("c.py", "x = 1\n", 5, ring, Budget(), cursor_id="k")
    assert [c["path"] for c in body["context"]] == ["b.py", "a.py"]
    assert body["cursor_id"] == "k" and body["prefix"] == "x = 1"


def test_plain_http_only_to_loopback():
    assert check_transport("http://127.0.0.1:8300/") == "http://127.0.0.1:8300"
    assert check_transport("http://localhost:1") == "http://localhost:1"
    assert check_transport("https://tab.example.com") == "https://tab.example.com"
    with pytest.raises(TabClientError, match="TLS"):
        check_transport("http://10.1.2.3:8300")
    with pytest.raises(TabClientError):
        check_transport("ftp://127.0.0.1")


def test_telemetry_records_outcomes_without_code(tmp_path, monkeypatch):
    log = Telemetry(tmp_path / "events.jsonl")
    log.shown("s1", latency_ms=12.5, chars=7, source="model", confidence=0.9, language="py")
    log.shown("s2", latency_ms=1.0, chars=3, source="cache", confidence=0.8, language="py")
    assert log.accepted("s1")
    assert not log.accepted("s1")  # only once
    assert not log.rejected("s2")  # replaced within 250 ms: never really seen
    log.shown("s3", latency_ms=2.0, chars=3, source="model", confidence=0.5, language="py")
    monkeypatch.setattr("codeplane.tab.telemetry.SEEN_AFTER_S", 0.0)
    assert log.rejected("s3")
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["shown", "shown", "accepted", "shown", "rejected"]
    assert events[2]["latency_ms"] == 12.5 and "after_ms" in events[2]
    assert all(set(e) <= {"ts", "event", "id", "latency_ms", "chars", "source", "confidence",
                          "language", "after_ms"} for e in events)


def test_multiline_only_where_a_block_body_starts():
    assert choose_mode("def f():\n    ", "\n").multiline
    assert not choose_mode("x = 1\n    ", "\n").multiline
    assert not choose_mode("x = 1\n", "\n").multiline


def test_fast_only_and_mid_line_never_touch_the_model(settings):
    from codeplane.config import TabSettings
    from codeplane.models.engine import Engine
    from codeplane.tab.service import TabRequest, TabService

    engine = Engine(settings)
    svc = TabService(engine, TabSettings())
    miss = svc.complete_sync(TabRequest(path="a.py", prefix="x = ", suffix="\n",
                                        fast_only=True))
    assert miss.source == "miss" and miss.text == "" and not miss.shown
    mid = svc.complete_sync(TabRequest(path="a.py", prefix="x = ", suffix="foo(bar)\n"))
    assert mid.source == "skipped" and mid.reason == "mid_line"
    assert engine.loaded() == [] and svc.stats["model_calls"] == 0
    assert svc.stats["requests"] == 1  # the fast-only miss is counted by its follow-up


def test_healing_allows_only_tokens_consistent_with_the_backed_off_text():
    import numpy as np

    from codeplane.tab.healing import HealingMask, VocabIndex, back_off

    pieces = [b"", b"   ", b"    ", b" ", b" self", b"self", b"Opti", b"Optional", b"O", b"x"]
    index = VocabIndex(pieces)
    assert sorted(index.allowed(b"    ").tolist()) == [1, 2, 3]  # "    ", or "   " / " "
    assert sorted(index.allowed(b"Opti").tolist()) == [6, 7, 8]
    assert sorted(index.allowed(b" ").tolist()) == [1, 2, 3, 4]
    heal = back_off([9, 9, 2], [2], pieces.__getitem__, index.extends)
    assert heal.tokens == [9, 9] and heal.text == "    "
    mask = HealingMask(index, pieces, heal.text, prompt_tokens=2)
    scores = np.zeros(len(pieces), dtype=np.float32)
    first = mask(np.array([9, 9]), scores)
    assert set(np.flatnonzero(np.isfinite(first))) == {1, 2, 3}
    # after "   " only one space is still owed: " self" is allowed, "self" is not
    second = mask(np.array([9, 9, 1]), scores)
    assert np.isfinite(second[4]) and not np.isfinite(second[5])
    assert np.isfinite(mask(np.array([9, 9, 1, 4]), scores)).all()  # healed: no mask


def test_healing_backs_off_every_token_of_a_split_word_start():
    """` ret` + `u` is the start of ` return`: backing off `u` alone leaves the model to
    finish a word from a split it never saw, so both go (llama.cpp's dynamic healing);
    ` x` + `.` is no token's start, so only `.` goes."""
    from codeplane.tab.healing import VocabIndex, back_off

    pieces = [b"", b" ret", b"u", b" return", b" x", b".", b"    ", b"urn"]
    index = VocabIndex(pieces)
    assert index.extends(b" retu") and not index.extends(b" return")
    heal = back_off([6, 1, 2], [1, 2], pieces.__getitem__, index.extends)
    assert heal.tokens == [6] and heal.text == " retu"
    heal = back_off([6, 4, 5], [4, 5], pieces.__getitem__, index.extends)
    assert heal.tokens == [6, 4] and heal.text == "."
    assert back_off([6], [], pieces.__getitem__, index.extends).text == ""


def test_a_suggestion_inside_a_string_closes_the_string_first():
    """Session 9: with the cursor inside a string literal (`f'... {se|`, a raw regex) the
    suggestion's `}` / `)` were walked as code, found unmatched and cut: `lf.max_level`
    instead of `lf.max_level}')`. The walk starts inside the quote open at the cursor."""
    prefix = "        raise ValueError(f'\"max-level\" option MUST be <= {se"
    assert postprocess.open_quote(prefix) == "'"
    assert clean("lf.max_level}')", prefix, "\n", SINGLE) == "lf.max_level}')"
    prefix = '        r"(?!(?:10|127)(?:\\.'
    assert clean('\\d{1,3}){3})" +', prefix, "\n", SINGLE) == '\\d{1,3}){3})" +'
    # outside a string the old rule holds: a bracket nothing opened is still cut
    assert postprocess.open_quote("x = f('a') + ") == ""
    assert clean("')  + b) * 2", "x = f('a", "\n", SINGLE) == "')  + b"


def test_healing_at_indentation_continues_with_code_not_more_blanks():
    """Session 9: at the start of an indented line the healed indentation could be
    re-emitted with a longer run of spaces (`   except`, deeper than typed) or followed by
    spaces only (an empty answer). With `code_next` the first byte after the backed-off
    text must not be a blank."""
    import numpy as np

    from codeplane.tab.healing import HealingMask, VocabIndex

    pieces = [b"", b"    ", b"        ", b"   ", b" self", b"self", b" ", b"\n", b"x", b"    x"]
    index = VocabIndex(pieces)
    assert sorted(index.allowed(b"    ").tolist()) == [1, 2, 3, 6, 9]  # free: 8 spaces too
    assert sorted(index.allowed(b"    ", code_next=True).tolist()) == [1, 3, 6, 9]
    assert sorted(index.allowed(b" ", code_next=True).tolist()) == [4, 6]
    mask = HealingMask(index, pieces, "    ", prompt_tokens=1, code_next=True)
    scores = np.zeros(len(pieces), dtype=np.float32)
    assert set(np.flatnonzero(np.isfinite(mask(np.array([8]), scores)))) == {1, 3, 6, 9}
    # the indentation re-emitted exactly: the next token must start with code
    assert set(np.flatnonzero(np.isfinite(mask(np.array([8, 1]), scores)))) == {5, 8}
    assert np.isfinite(mask(np.array([8, 1, 5]), scores)).all()  # healed: no mask
    free = HealingMask(index, pieces, "    ", prompt_tokens=1)
    assert np.isfinite(free(np.array([8, 1]), scores)).all()


def test_code_first_masks_every_kind_of_blank():
    """With nothing (more) to re-emit, `code_next` lets only tokens that start with code
    through - not a space (`" self.x"`, issue 18), not a newline, not a tab, and not a
    no-break space (what the model reached for when ASCII spaces were masked)."""
    import numpy as np

    from codeplane.tab.healing import HealingMask, VocabIndex

    pieces = [b"", b"    ", b" self", b"self", b"\n", b"\xc2\xa0return", b"return", b"\t"]
    index = VocabIndex(pieces)
    mask = HealingMask(index, pieces, "", prompt_tokens=2, code_next=True)
    scores = np.zeros(len(pieces), dtype=np.float32)
    assert set(np.flatnonzero(np.isfinite(mask(np.array([6, 1]), scores)))) == {3, 6}
    assert np.isfinite(mask(np.array([6, 1, 3]), scores)).all()  # then free
