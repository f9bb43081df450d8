"""Next edits that need no model (`tab/kinds.py`), on hand-written before/after texts: each
kind proposes the follow-up change its edit implies, near the cursor, and nothing where the
edit does not imply one."""

from __future__ import annotations

import pytest

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


@pytest.mark.parametrize("head", ["", "# café\n"])
def test_a_line_that_differs_in_one_name_gets_the_change_with_its_name(head: str):
    """With a comment holding an `é` above, too: the grammar counts bytes, the lines
    characters."""
    first = head.count("\n")
    text = head + ("def check(value1, value2):\n    if value1 is None:\n        return 1\n"
                   "    if not value2:\n        return 2\n")
    got = parallel_change(text, first + 1,
                          edit(first + 1, "    if not value1:\n", "    if value1 is None:\n"))
    assert got == Suggestion(first + 3, first + 4, "    if value2 is None:\n")


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


# -- `parallel`'s rules: a one-name difference that is not a parallel use of a name -------


def test_no_parallel_change_where_the_other_word_is_in_a_string_or_a_comment():
    """The differing word is text, not a name the code uses: a docstring that names another
    function, a URL's scheme."""
    text = ('def wrap(f):\n    """Run f in an apply context."""\n\n\ndef join(f):\n'
            '    """Run f in a join context."""\n')
    edits = edit(1, '    """Run f in a apply context."""\n', '    """Run f in an apply context."""\n')
    assert parallel_change(text, 1, edits) is None
    text = 'get("http://a.org/")\nget("https://a.org/x")\n'
    assert parallel_change(text, 0, edit(0, 'get("http://a.org/x")\n', 'get("http://a.org/")\n')) is None


def test_no_parallel_change_where_the_other_word_is_a_keyword():
    """`return X` rewritten does not make `del X` the same rewrite: a keyword is no name."""
    text = ("class H:\n    def get(self, k):\n        return self.req.get(key(k))\n\n"
            "    def drop(self, k):\n        del self.env[key(k)]\n")
    edits = edit(2, "        return self.env[key(k)]\n", "        return self.req.get(key(k))\n")
    assert parallel_change(text, 2, edits) is None


def test_no_parallel_change_on_an_import():
    """An import of another module is not a use of the renamed one: `import sys` ->
    `from sys import argv` says nothing about `import os`."""
    text = "from sys import argv\nimport os\n\nprint(argv, os.sep)\n"
    assert parallel_change(text, 0, edit(0, "import sys\n", "from sys import argv\n")) is None


def test_no_parallel_change_when_the_edit_already_uses_the_other_name():
    """The edit's new lines already speak of the other line's name: the edit is about both
    names, and renaming in it would leave two copies of one condition."""
    text = ("def width(self):\n    if self.names:\n        return len(self.names)\n"
            "    return len(self.rows[0]) if self.rows else 0\n\n\n"
            "def height(self):\n    return len(self.rows)\n")
    edits = edit(1, "    return len(self.names)\n",
                 "    if self.names:\n        return len(self.names)\n"
                 "    return len(self.rows[0]) if self.rows else 0\n")
    assert parallel_change(text, 3, edits) is None


def test_no_parallel_change_when_the_old_name_occurs_twice_in_the_edit():
    """`key=key` -> `key=self.key`: which `key` the other line's name stands for is not
    known, so a rename would hit the keyword too."""
    text = "make(\n    key=self.key,\n    key=signed_key,\n)\n"
    assert parallel_change(text, 1, edit(1, "    key=key,\n", "    key=self.key,\n")) is None


def test_no_parallel_change_in_a_file_without_a_grammar():
    """Without a parser the name's role cannot be checked, so the kind declines."""
    text = "if value1 is None:\n    pass\nif not value2:\n    pass\n"
    edits = [EditIn(path="notes.txt", line=0, before="if not value1:\n",
                    after="if value1 is None:\n")]
    assert parallel_change(text, 0, edits) is None
