"""Next edits that need no model (`tab/kinds.py`), on hand-written before/after texts: each
kind proposes the follow-up change its edit implies, near the cursor, and nothing where the
edit does not imply one."""

from __future__ import annotations

from codeplane.tab.kinds import (
    NEAR_LINES,
    Suggestion,
    parallel_change,
    propose,
    same_change,
)
from codeplane.tab.nextedit import EditIn

TASKS = """from invoke import task


@task()
def lint(c):
    c.run("ruff check")


@task
def test(c):
    c.run("pytest")


@task
def docs(c):
    c.run("mkdocs build")
"""


def edit(line: int, before: str, after: str) -> list[EditIn]:
    return [EditIn(path="a.py", line=line, before=before, after=after)]


def test_the_same_change_is_made_at_the_next_place_that_still_has_the_old_lines():
    """`@task` -> `@task()` on line 3: the next `@task` (line 8) gets it, then line 13."""
    got = same_change(TASKS, 3, edit(3, "@task\n", "@task()\n"))
    assert got == Suggestion(8, 9, "@task()\n")
    done = got.apply(TASKS)
    assert same_change(done, 8, edit(8, "@task\n", "@task()\n")) == Suggestion(13, 14, "@task()\n")


def test_the_same_change_follows_the_old_lines_to_another_indentation():
    """A two-line change at one indentation, repeated where the same lines sit deeper."""
    text = ("def a():\n    value = chr(1)\n\n\nclass B:\n    def c(self):\n"
            "        try:\n            value = unichr(1)\n        except NameError:\n"
            "            value = chr(1)\n")
    before = "    try:\n        value = unichr(1)\n    except NameError:\n        value = chr(1)\n"
    got = same_change(text, 1, edit(1, before, "    value = chr(1)\n"))
    assert got == Suggestion(6, 10, "        value = chr(1)\n")


def test_a_change_is_not_proposed_again_where_it_was_just_made():
    """Wrapping a call in an `if` leaves the call, deeper, in the edit's own new lines:
    that is not a place to wrap it again, and nothing else has the old line."""
    text = "def f(full):\n    if full:\n        handler.start()\n    body()\n"
    edits = edit(1, "    handler.start()\n", "    if full:\n        handler.start()\n")
    assert same_change(text, 2, edits) is None
    assert parallel_change(text, 2, edits) is None


def test_a_line_that_differs_in_one_name_gets_the_change_with_its_name():
    text = ("def check(value1, value2):\n    if value1 is None:\n        return 1\n"
            "    if not value2:\n        return 2\n")
    got = parallel_change(text, 1, edit(1, "    if not value1:\n", "    if value1 is None:\n"))
    assert got == Suggestion(3, 4, "    if value2 is None:\n")


def test_a_wrapped_line_is_wrapped_again_on_its_parallel_line():
    text = ("def unparse(out, full):\n    if full:\n        out.startDocument()\n"
            "    emit(out)\n    out.endDocument()\n")
    edits = edit(1, "    out.startDocument()\n", "    if full:\n        out.startDocument()\n")
    assert parallel_change(text, 2, edits) == \
        Suggestion(4, 5, "    if full:\n        out.endDocument()\n")


def test_no_parallel_change_for_two_names_changed_or_a_name_the_edit_dropped():
    text = "g()\nf(b)\nif q is None:\n    pass\nif not r or s:\n    pass\n"
    # `f(a)` -> `g()` drops the name: on `f(b)` the rule cannot tell what `b` becomes
    assert parallel_change(text, 0, edit(0, "f(a)\n", "g()\n")) is None
    # `if not r or s:` differs from the edit's old line in two names
    assert parallel_change(text, 2, edit(2, "if not q or r:\n", "if q is None:\n")) is None


def test_kinds_look_only_near_the_cursor():
    text = "@task\n" + "\n" * (NEAR_LINES + 2) + "@task\n"
    assert same_change(text, 0, edit(0, "@task\n", "@task()\n")) is None
    near = "@task()\n" + "\n" * (NEAR_LINES - 2) + "@task\n"
    assert same_change(near, 0, edit(0, "@task\n", "@task()\n")) is not None


def test_an_insertion_or_a_blank_edit_implies_nothing():
    assert propose(TASKS, 3, edit(3, "", "@task()\n")) is None
    assert propose(TASKS, 3, edit(3, "\n", "\n\n")) is None
    assert propose(TASKS, 3, []) is None


def test_propose_names_the_kind_that_fired_first():
    assert propose(TASKS, 3, edit(3, "@task\n", "@task()\n")) == \
        ("same", Suggestion(8, 9, "@task()\n"))
    text = "if value1 is None:\n    pass\nif not value2:\n    pass\n"
    assert propose(text, 0, edit(0, "if not value1:\n", "if value1 is None:\n")) == \
        ("parallel", Suggestion(2, 3, "if value2 is None:\n"))
