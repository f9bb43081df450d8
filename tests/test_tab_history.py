"""Edit history for next-edit Tab (`tab/history.py`): keystrokes coalesce into edits."""

from __future__ import annotations

from codeplane.tab.history import MAX_SNIPPET_CHARS, History

DOC = "def area(w, h):\n    return w * h\n\n\nprint(area(2, 3))\nprint(area(4, 5))\n"


def type_over(history: History, path: str, text: str, old: str, new: str, now: float
              ) -> str:
    """Turn the first `old` into `new` one keystroke at a time (delete, then type)."""
    at = text.index(old)
    head, rest = text[:at], text[at + len(old):]
    steps = [old[:n] for n in range(len(old) - 1, -1, -1)] + [new[:n] for n in
                                                              range(1, len(new) + 1)]
    for typed in steps:  # backspaces, then the new text
        after = head + typed + rest
        history.record(path, text, after, now)
        text, now = after, now + 0.1
    return text


def test_keystrokes_in_one_place_are_one_edit():
    history = History()
    text = type_over(history, "a.py", DOC, "area(2", "surface(2", 100.0)
    edits = history.recent()
    assert len(edits) == 1, edits
    edit = edits[0]
    assert (edit.line, edit.before, edit.after) == (4, "print(area(2, 3))\n",
                                                    "print(surface(2, 3))\n")
    assert not edit.is_insertion()
    assert history.wants_next_edit("a.py", 5)  # a rename nearby: next edit, not FIM
    assert not history.wants_next_edit("b.py", 5)
    assert not history.wants_next_edit("a.py", 40)
    assert "surface(2" in text


def test_a_pause_or_another_place_starts_a_new_edit():
    history = History(pause_s=2.0)
    text = type_over(history, "a.py", DOC, "area(2", "surface(2", 0.0)
    text = type_over(history, "a.py", text, "area(4", "surface(4", 60.0)  # after a pause
    history.record("b.py", "x = 1\n", "x = 2\n", 60.1)  # another document, at once
    assert [(e.path, e.line) for e in history.recent()] == [("a.py", 4), ("a.py", 5),
                                                           ("b.py", 0)]
    history.forget("a.py")
    assert [e.path for e in history.recent()] == ["b.py"]


def test_plain_typing_is_an_insertion_and_keeps_fim():
    history = History()
    text = DOC
    for n, ch in enumerate("x = 1"):
        new = text + ch
        history.record("a.py", text, new, 10 + n * 0.1)
        text = new
    assert len(history.recent()) == 1 and history.recent()[0].is_insertion()
    assert not history.wants_next_edit("a.py", 6)


def test_typed_and_erased_leaves_no_edit():
    history = History()
    history.record("a.py", DOC, DOC + "x", 1.0)
    history.record("a.py", DOC + "x", DOC, 1.1)
    assert history.recent() == []


def test_bounded_in_count_and_characters():
    history = History(max_edits=4, max_chars=10 * MAX_SNIPPET_CHARS)
    for n in range(10):
        history.record(f"{n}.py", "a\n", "b\n", n * 10.0)
    assert [e.path for e in history.recent()] == ["6.py", "7.py", "8.py", "9.py"]
    big = "y = 1\n" * 5000
    history.record("big.py", "", big, 500.0)
    edit = history.recent()[-1]
    assert len(edit.after) <= MAX_SNIPPET_CHARS and edit.after.endswith("\n")
    small = History(max_chars=3 * MAX_SNIPPET_CHARS)
    for n in range(6):
        small.record(f"{n}.py", "", big, n * 10.0)
    assert sum(e.size for e in small.recent()) <= 3 * MAX_SNIPPET_CHARS
