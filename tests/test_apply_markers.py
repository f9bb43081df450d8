"""Sketches as chat models write them: every marker wording, comment syntax and placement
must either merge to what a careful reader would write or decline; never may the code a
marker stands for be deleted with `ok: true`. Also whitespace drift in context lines (the
file keeps its own bytes) and the wrong-merge guard. Deterministic path only (no model)."""

from __future__ import annotations

import pytest
from applykit import merges

from codeplane.apply.formats import is_marker, parse_edit
from codeplane.apply.guard import check
from codeplane.apply.service import apply_edit

STORE = '''import os


class Store:
    """Files under a root directory, cached in memory."""

    def __init__(self, root):
        self.root = root
        self.items = {}
        self.loaded = False

    def load(self):
        for name in os.listdir(self.root):
            with open(os.path.join(self.root, name)) as fh:
                self.items[name] = fh.read()
        self.loaded = True
        return self.items

    def save(self, name, text):
        path = os.path.join(self.root, name)
        with open(path, "w") as fh:
            fh.write(text)
        self.items[name] = text


def main():
    store = Store(".")
    store.load()
    print(len(store.items))
'''
EXPECTED = STORE.replace("        return self.items\n", "        return dict(self.items)\n")

WORDINGS = [
    "# ... existing code ...", "# ... rest of the function unchanged ...", "# (unchanged)",
    "# existing code here", "# [previous implementation]", "...", "# ...",
    "# rest of the code unchanged", "# ... (unchanged) ...", "# … existing methods …",
    "# [rest of file unchanged]", "# unchanged code", "# (rest of the class omitted)",
    "# keep existing code", "# remaining methods unchanged", "# ...existing code...",
    "# ... other methods ...", "# remaining code unchanged", "# (previous code)",
]


def _sketch(wording: str) -> str:
    """Header lines kept as context, markers in function bodies, indented as the block
    they stand for."""
    return f"""{wording}
class Store:
    {wording}
    def load(self):
        {wording}
        self.loaded = True
        return dict(self.items)

    def save(self, name, text):
        {wording}
{wording}
"""


@pytest.mark.parametrize("wording", WORDINGS)
def test_marker_wording_in_body_and_under_headers_merges(wording: str) -> None:
    merges(STORE, _sketch(wording), "store.py", EXPECTED)


@pytest.mark.parametrize("wording", WORDINGS)
def test_marker_wording_between_context_keeps_the_elided_lines(wording: str) -> None:
    sketch = f"""    def __init__(self, root):
        self.root = root
    {wording}
        self.loaded = True
        return dict(self.items)
{wording}
"""
    merges(STORE, sketch, "store.py", EXPECTED)


JS = """import fs from "fs";

export function load(root) {
  const items = {};
  for (const name of fs.readdirSync(root)) {
    items[name] = fs.readFileSync(name, "utf8");
  }
  return items;
}

export function save(root, name, text) {
  fs.writeFileSync(root + "/" + name, text);
}
"""


@pytest.mark.parametrize("wording", ["// existing code here", "// ... rest unchanged ...",
                                     "/* unchanged */", "// (previous implementation)",
                                     "/* ... */"])
def test_c_style_markers_keep_the_loop(wording: str) -> None:
    sketch = f"""{wording}
export function load(root) {{
  {wording}
    items[name] = fs.readFileSync(name, "utf8");
  }}
  return {{ ...items }};
}}
{wording}
"""
    merges(JS, sketch, "store.js", JS.replace("  return items;", "  return { ...items };"))


SQL = """-- schema
CREATE TABLE users (
  id INTEGER PRIMARY KEY,
  name TEXT NOT NULL,
  email TEXT
);

CREATE INDEX users_name ON users (name);
"""


@pytest.mark.parametrize("wording", ["-- ... existing columns ...", "-- (unchanged)"])
def test_sql_markers_keep_the_columns(wording: str) -> None:
    sketch = f"""{wording}
CREATE TABLE users (
  id INTEGER PRIMARY KEY,
  {wording}
  name TEXT NOT NULL,
  email TEXT UNIQUE
);
{wording}
"""
    merges(SQL, sketch, "schema.sql", SQL.replace("email TEXT\n", "email TEXT UNIQUE\n"))


HTML = """<html>
<body>
  <h1>Title</h1>
  <p>First</p>
  <p>Second</p>
  <footer>old</footer>
</body>
</html>
"""


@pytest.mark.parametrize("wording", ["<!-- ... existing markup ... -->",
                                     "<!-- unchanged -->"])
def test_html_markers_keep_the_markup(wording: str) -> None:
    sketch = f"""{wording}
<body>
  <h1>Title</h1>
  {wording}
  <p>Second</p>
  <footer>new</footer>
</body>
{wording}
"""
    merges(HTML, sketch, "page.html", HTML.replace("old", "new"))


def test_new_stub_body_is_code_not_a_marker() -> None:
    sketch = """    def save(self, name, text):
        path = os.path.join(self.root, name)
        with open(path, "w") as fh:
            fh.write(text)
        self.items[name] = text

    def close(self):
        ...
# ... existing code ...
"""
    result = apply_edit(STORE, sketch, "store.py")
    assert result.ok, result.diagnostics
    want = STORE.replace("        self.items[name] = text\n",
                         "        self.items[name] = text\n\n    def close(self):\n        ...\n")
    assert _code(result.merged) == _code(want)  # where the blank lines go is not the point


def _code(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_body_marker_keeps_the_rest_of_the_body_before_new_code() -> None:
    """The marker is indented as `load`'s body: it stands for the rest of that body, so a
    new method after it goes below the body, nothing of it replaced."""
    sketch = """# ... existing code ...
    def load(self):
        for name in os.listdir(self.root):
        # ... existing code ...

    def reload(self):
        self.items = {}
        return self.load()

    def save(self, name, text):
# ... existing code ...
"""
    merges(STORE, sketch, "store.py", STORE.replace(
        "    def save(", "    def reload(self):\n        self.items = {}\n"
        "        return self.load()\n\n    def save("))


def test_guard_declines_code_replaced_by_a_comment_or_not_shown() -> None:
    """The guard on its own (whatever the alignment did): code replaced by nothing but a
    comment (a marker wording read as code), and code removed at a marker's edge, which
    the sketch does not show as deleted, are not ok; the right merge is."""
    original = STORE.splitlines()
    sketch = parse_edit("""    def load(self):
        for name in os.listdir(self.root):
        # (the loop stays as it was)
        self.loaded = True
        return dict(self.items)
# ... existing code ...
""", original).sketch
    loop = original.index("        for name in os.listdir(self.root):")
    as_code = original[:loop + 1] + ["        # (the loop stays as it was)"] + original[loop + 3:]
    assert "elision marker read as code" in (check(original, sketch, as_code) or "")
    right = EXPECTED.splitlines()
    sketch = parse_edit("# ...\n        self.loaded = True\n        return dict(self.items)\n"
                        "# ...\n", original).sketch
    assert check(original, sketch, right) is None
    lost = [line for line in right if "fh.read()" not in line]
    assert "does not show as deleted" in (check(original, sketch, lost) or "")


CONF = """import os

on_rtd = os.environ.get('READTHEDOCS') == 'True'

# -- Options for HTML output ---------------------------------------------------

# The theme to use for HTML and HTML Help pages.  See the documentation for
# a list of builtin themes.
html_theme = 'default'
html_style = 'overrides.css' # Supress the washy theme

# Theme options are theme-specific and customize the look and feel of a theme
# further.
#html_theme_options = {}

# The name for this set of documents.
html_title = 'funcs'
"""


def test_code_commented_out_by_the_edit_is_not_an_elision_marker() -> None:
    """Two settings replaced by one of them commented out (funcy 8dad95cfee in the fourth
    slice, `wordings`, `drift`, `layout`): the comment is code, not a marker wording the
    recogniser missed, so the guard's "elision marker read as code" does not apply."""
    sketch = ("# ... existing code ...\n# The theme to use for HTML and HTML Help pages.  "
              "See the documentation for\n# a list of builtin themes.\n"
              "# html_style = 'overrides.css'\n\n# Theme options are theme-specific and "
              "customize the look and feel of a theme\n# ... existing code ...\n")
    merges(CONF, sketch, "conf.py", CONF.replace(
        "html_theme = 'default'\nhtml_style = 'overrides.css' # Supress the washy theme\n",
        "# html_style = 'overrides.css'\n"))


def test_joined_call_in_context_keeps_the_files_lines() -> None:
    original = ('def build(root):\n    store = Store(\n        root,\n        cache=True,\n'
                '    )\n    store.load()\n    return store\n\n\ndef other():\n    pass\n')
    sketch = ('def build(root):\n    store = Store(root, cache=True)\n    store.load()\n'
              '    store.check()\n    return store\n# ... existing code ...\n')
    merges(original, sketch, "b.py", original.replace("    store.load()\n",
                                                      "    store.load()\n    store.check()\n"))


def test_context_without_trailing_whitespace_keeps_the_files_bytes() -> None:
    original = "def f(x):   \n    y = x + 1  \n    return y\n\n\ndef g():\n    pass\n"
    sketch = "def f(x):\n    y = x + 1\n    return y * 2\n# ... existing code ...\n"
    merges(original, sketch, "f.py", original.replace("return y\n", "return y * 2\n"))


def test_blank_line_added_under_a_marker_is_layout_where_it_can_be_nothing_else() -> None:
    """Read as context, the blank line would delete `def load(self):` and keep its body:
    with the segment opening on three context lines in a row, it is the model's layout."""
    sketch = """# ... existing code ...

        for name in os.listdir(self.root):
            with open(os.path.join(self.root, name)) as fh:
                self.items[name] = fh.read()
        self.loaded = True
        return dict(self.items)
# ... existing code ...
"""
    merges(STORE, sketch, "store.py", EXPECTED)


@pytest.mark.parametrize("wording", WORDINGS)
def test_marker_wording_never_deletes_what_it_stands_for(wording: str) -> None:
    """No marker at either end, a body marker between two context lines: before the
    recogniser knew the wording, it was read as a new comment and the `with` block it stands
    for was deleted with ok: true. Now it merges exactly or declines; never deletes."""
    sketch = f"""    def load(self):
        for name in os.listdir(self.root):
        {wording}
        self.loaded = True
        return dict(self.items)

    def save(self, name, text):
"""
    result = apply_edit(STORE, sketch, "store.py")
    if result.ok:
        assert result.merged == EXPECTED
    assert "fh.read()" in (result.merged or STORE)


MATCH_ARGS = '''import pytest


class TestA:
    def test_one(self):
        x = make(
            "C", "a", None
        )
        assert x

    def test_two(self):
        y = make(
            "D", "b", None
        )

    @pytest.mark.skipif(OLD, reason="Pre-3.10 only.")
    def test_old(self):
        assert None is getattr(C, "__match_args__", None)


@pytest.mark.skipif(
    not OLD, reason="3.10+"
)
class TestB:
    """
    Tests for match args.
    """

    def test_b(self):
        pass
'''


def test_closing_bracket_after_a_body_marker_is_the_one_at_its_depth() -> None:
    """The commit deletes `test_old` and `TestB`'s decorator; the sketch shows the `)` that
    ends `test_two` (at the body's depth) right above `class TestB:`. The top-level `)`
    of the decorator is the cheaper match, and was taken: the deleted code kept, the `)`
    re-indented, ok: true (attrs 9b98a730bf in the wild benchmark). A `)` places nothing,
    but its indentation says which one it is."""
    sketch = '''# ... existing code ...
    def test_two(self):
        # rest of the code unchanged
        )


class TestB:
    """
# ... existing code ...
'''
    merges(MATCH_ARGS, sketch, "test_m.py", MATCH_ARGS.replace(MATCH_ARGS[MATCH_ARGS.index(
        "    @pytest.mark.skipif(OLD"):MATCH_ARGS.index("class TestB")], "\n"))


COMPLETE = '''import os
import sys


def _bashcomplete(cmd, prog_name, complete_var=None):
    if complete_var is None:
        complete_var = "_%s_COMPLETE" % prog_name.upper()
    complete_instr = os.environ.get(complete_var)
    if not complete_instr:
        return

    from click.bashcomplete import bashcomplete
    if bashcomplete(cmd, prog_name, complete_var, complete_instr):
        sys.exit(1)


def main():
    pass
'''


def test_blank_line_added_under_a_marker_with_wide_context_is_layout() -> None:
    """The model added a blank line under the marker, above `if not complete_instr:`
    where the file has code. Read as context it would delete that code with one blank
    line of context, but the segment closes on two lines of context: its context is not
    one line wide, so the blank line is layout and the file keeps its lines (click
    080179683d in the wild benchmark's `drift` style declined)."""
    sketch = '''    # ... existing code ...

    if not complete_instr:
        return

    from click._bashcomplete import bashcomplete
    if bashcomplete(cmd, prog_name, complete_var, complete_instr):
        sys.exit(1)

# ... existing code ...
'''
    merges(COMPLETE, sketch, "complete.py",
           COMPLETE.replace("click.bashcomplete", "click._bashcomplete"))


def test_context_width_counts_lines_a_new_line_repeats() -> None:
    """Three lines of context, then a new test whose body repeats the third. The
    alignment may match the new test's copy and take the context's as new (the same
    file), which left the context one line short of wide, so the blank line under the
    marker was not read as layout (cachetools 083ee5ffdf, third slice: declined before).
    The width is counted by text, as a diff counts it."""
    original = ("class TestCache:\n    def test_expire(self):\n        cache = make()\n"
                "        cache[1] = 1\n        self.assertEqual(1, len(cache))\n\n"
                "        cache.tick()\n        expired = cache.expire()\n"
                "        self.assertEqual(4, len(expired))\n        self.assertEqual(0, len(cache))\n")
    added = ("\n    def test_clear(self):\n        cache = make()\n\n        cache[1] = 1\n"
             "        cache.clear()\n\n        self.assertEqual(0, len(cache))\n"
             "        self.assertEqual(0, cache.size)\n\n        cache[3] = 3\n"
             "        self.assertIn(3, cache)\n")
    sketch = ("        # ... existing code ...\n\n        expired = cache.expire()\n"
              "        self.assertEqual(4, len(expired))\n        self.assertEqual(0, len(cache))\n"
              + added)
    merges(original, sketch, "test_cache.py", original + added)


def test_blank_line_as_the_only_context_of_a_deletion_still_declines() -> None:
    """A one-line-context diff deleting the import: the blank line above it, then the line
    after it. The same sketch as a model's layout would keep the import; not guessed."""
    sketch = '''    # ... existing code ...

    if bashcomplete(cmd, prog_name, complete_var, complete_instr):
    # ... existing code ...
'''
    result = apply_edit(COMPLETE, sketch, "complete.py")
    assert not result.ok
    assert "blank line" in result.diagnostics[-1]


_CHECK = '''

def {name}(cls, other):
    for attr in ATTRS:
        for base in other.__mro__:
            if attr in base.__dict__:
                if base.__dict__[attr] is None:
                    return NotImplemented
                break
            if attr in getattr(base, "__annotations__", {{}}):
                break
        else:
            return NotImplemented
    return {result}
'''
# Two functions with the same loop (the file's two places for one identical segment).
PROTOCOL = 'annotations = getattr(base, "__annotations__", {})\n' + \
    _CHECK.format(name="check", result="True") + _CHECK.format(name="check2", result="False")


def test_new_line_copying_one_at_another_depth_does_not_set_the_shift() -> None:
    """Both loops gain `annotations = ...`, a line the file has at the top level. Taken as
    the segment's evidence of a shift, it forbade every `break` and `else:` in place and
    the two identical segments went wrong (typing_extensions ff435a1ca4 in `markers` and
    `dedented`): a distinctive line is evidence only if the others agree with it."""
    segment = '''# ... existing code ...
                if base.__dict__[attr] is None:
                    return NotImplemented
                break
            annotations = getattr(base, "__annotations__", {})
            if attr in annotations:
                break
        else:
'''
    sketch = segment * 2 + "# ... existing code ...\n"
    old = '            if attr in getattr(base, "__annotations__", {}):\n'
    new = ('            annotations = getattr(base, "__annotations__", {})\n'
           '            if attr in annotations:\n')
    merges(PROTOCOL, sketch, "protocol.py", PROTOCOL.replace(old, new))


def test_line_moved_to_the_files_start_is_not_copied_twice() -> None:
    """The sketch shows the file's start (no marker above) with `from random import seed`
    moved up from below the imports. Read as starting anywhere, the sketch's first line
    matched the moved line and the imports it shows above it were added a second time,
    the file's own kept above (more-itertools e9d9d9e120 in the fresh held-out slice). The
    reading that reaches the file's start deletes only a line the sketch shows elsewhere."""
    original = ("from unittest import TestCase\n\nfrom nose.tools import eq_\n\n"
                "from more_itertools import *\n\nfrom random import seed\n\n\n"
                "def setup_module():\n    seed(1)\n\n\nclass Tests(TestCase):\n"
                "    def test_it(self):\n        eq_(1, 1)\n")
    sketch = ("from random import seed\nfrom unittest import TestCase\n\n"
              "from nose.tools import eq_\n\nfrom more_itertools import *\n\n\n"
              "def setup_module():\n# ... rest of the function unchanged ...\n")
    merges(original, sketch, "test_recipes.py", "from random import seed\n" + original.replace(
        "\nfrom random import seed\n", ""))


RECIPES = '''def quantify(iterable, pred=bool):
    """Count how many times pred is true.

        >>> quantify([True, False, True])
        2

    """
    return sum(map(pred, iterable))


def filter_len(func, iterable):
    """Count the items where func is truthy.

        >>> filter_len(lambda x: x % 3 == 0, range(10))
        4

    """
    return sum(1 for _ in filter(func, iterable))


def padnone(iterable):
    return chain(iterable, repeat(None))
'''


def test_common_line_and_the_file_line_after_it_are_not_split() -> None:
    """The sketch deletes `filter_len`: its context above is the closing quotes and the
    `return` of `quantify`, which the file has together once. The quotes place nothing,
    so the alignment matched `filter_len`'s own quotes, took `return sum(map(...))` as new
    in place of `filter_len`'s `return`, and kept the rest of `filter_len`: ok with a
    wrong file (more-itertools 61a2d7be70, the one wrong merge of the fresh slice). That
    split reading writes a second copy of `quantify`'s `return`, a line the file has once
    and keeps: never merged. Until session apply13 the merge declined; now the pair is
    read as the context it is, and `filter_len` is deleted."""
    sketch = '''# ... existing code ...
    """
    return sum(map(pred, iterable))


def padnone(iterable):
# ... rest of the file unchanged ...
'''
    start = RECIPES.index("def filter_len")
    expected = RECIPES[:start] + RECIPES[RECIPES.index("def padnone"):]
    merges(RECIPES, sketch, "recipes.py", expected)


OPTION_TESTS = '''import click


def test_default(runner):
    @click.command()
    @click.option("--name", default="x")
    def cmd(name):
        click.echo(name)

    result = runner.invoke(cmd, [])
    assert result.output == "x\\n"


def test_option_custom_class(runner):
    class CustomOption(click.Option):
        def get_help_record(self, ctx):
            return ("--help", "I am a help text")

    @click.command()
    @click.option("--testoption", cls=CustomOption, help="you wont see me")
    def cmd(testoption):
        click.echo(testoption)

    result = runner.invoke(cmd, ["--help"])
    assert "I am a help text" in result.output
    assert "you wont see me" not in result.output


def test_aliases_for_flags(runner):
    @click.command()
    @click.option("--warnings/--no-warnings", " /-W", default=True)
    def cli(warnings):
        click.echo(warnings)
'''
NEW_TEST = '''def test_option_custom_class_reusable(runner):
    class CustomOption(click.Option):
        def get_help_record(self, ctx):
            return ("--help", "I am a help text")

    testoption = click.option("--testoption", cls=CustomOption, help="you wont see me")

    @click.command()
    @testoption
    def cmd1(testoption):
        click.echo(testoption)

    for cmd in (cmd1,):
        result = runner.invoke(cmd, ["--help"])
        assert "I am a help text" in result.output
        assert "you wont see me" not in result.output


'''


@pytest.mark.parametrize("wording", ["# ... rest of the function unchanged ...",
                                     "# (unchanged)", "# [previous implementation]", "..."])
def test_new_function_after_a_body_marker_goes_below_the_block(wording: str) -> None:
    """A marker indented as a function body, then a new function: the marker stands for
    the rest of the function above, which stays whole; the new one goes below it. The
    new function copies many lines of that neighbour, and the cheapest alignment rewrote
    the neighbour into it (deleting its `def` line and two more: declined as an open end,
    the cause of most `body`/`header` declines; click a17b544788)."""
    sketch = f'''    {wording}


{NEW_TEST}def test_aliases_for_flags(runner):
    @click.command()
# ... rest of the file unchanged ...
'''
    at = OPTION_TESTS.index("def test_aliases_for_flags")
    merges(OPTION_TESTS, sketch, "test_options.py",
           OPTION_TESTS[:at] + NEW_TEST + OPTION_TESTS[at:])


def test_code_appended_at_the_files_end_may_copy_lines_the_file_has_together() -> None:
    """The split-context check (a common line and the file line next to it read apart)
    applies only at a marker: a new test appended at the end of the file, with no marker
    after it, ends on `'Error: ...'` and `]` as the test above it does, and is new (click
    ee780c3af4 declined in five styles when the check also ran at the file's edge)."""
    test = '''def test_{name}(runner):
    result = runner.invoke(cmd, [])
    assert result.output.splitlines() == [
        'Usage: cmd [OPTIONS] ARG',
        'Error: Missing argument "arg".'
    ]
'''
    original = test.format(name="usage") + "\n\n" + test.format(name="other")
    sketch = "# ... existing code ...\n" + test.format(name="other") + "\n\n" + \
        test.format(name="appended")
    merges(original, sketch, "test_formatting.py", original + "\n\n" + test.format(name="appended"))


PARSER = '''import argparse


def build():
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "name", help="what to greet", nargs="?"
    )

    parser.add_argument(
        "-q",
        "--quiet",
        action="store_false",
        dest="verbose",
        default=True,
        help="print nothing but errors on the console",
    )

    parser.set_defaults(func=greet)

    return parser
'''

# Two new options after the last one. Read as new lines, the sketch's opening `)` is the
# `-q` block's and nothing is lost; read as edits, the new blocks' lines rewrite the `-q`
# block (`"--greeting"` for `"-q"`), which the sketch never shows.
TWO_NEW_OPTIONS = '''# ... existing code ...
    )

    parser.add_argument(
        "--greeting",
        action="append",
        dest="greeting",
        default=None,
        help="greeting text to use, can be given multiple times",
    )

    parser.add_argument(
        "--name",
        action="store",
        dest="name",
        default=None,
        help="the name to greet, if specified",
    )

    parser.set_defaults(func=greet)
# ... existing code ...
'''


def test_new_blocks_that_read_as_new_or_as_rewriting_an_unshown_block_decline() -> None:
    """Every line of the file between the segment's first and last line is shown, so the
    sketch reads as pure insertion there; the alignment's cheaper reading rewrites a block
    the sketch does not show. Two readings, two files: decline (the model path gets it),
    never write the rewrite."""
    result = apply_edit(PARSER, TWO_NEW_OPTIONS, "cli.py")
    assert not result.ok, result.merged
    assert "ambiguous" in result.diagnostics[-1]


SETTINGS = '''# Settings of the documentation build.

project = "Store"
copyright = "2024, the authors"

# The version, shown in the title and used to name the build.
version = "1.0"

# The version, shown in the title and used to name the build.
release = "1.0.2"
'''

# The commit deletes the first comment and `version`: the sketch shows the comment that
# follows `copyright`, which the file has twice.
DELETE_DUPLICATE = '''# ... existing code ...
copyright = "2024, the authors"

# The version, shown in the title and used to name the build.

# ... existing code ...
'''


def test_a_sketch_that_reads_as_a_no_op_through_a_repeated_line_declines() -> None:
    """Matched to its first copy, the repeated comment makes the edit change nothing;
    matched to its second, the lines between are deleted. An edit is meant to change
    something, so the no-op reading is not written: the merge declines."""
    result = apply_edit(SETTINGS, DELETE_DUPLICATE, "conf.py")
    assert not result.ok, result.merged
    assert "ambiguous" in result.diagnostics[-1]


PICK = '''def pick(sink, kwargs):
    if isinstance(sink, str):
        colorize = True
    elif isinstance(sink, int):
        colorize = False
    elif callable(sink):
        writer = sink
        colorize = False
    else:
        raise TypeError(sink)
    return colorize
'''


def test_an_insertion_reading_that_copies_a_line_the_file_has_once_is_no_rival() -> None:
    """Read as new lines between the second `colorize = False` and `else:`, the sketch
    would add a second `elif callable(sink):`, a line the file has once and the edit
    shows as context: that reading is no rival, and the edit of the branch is written."""
    sketch = '''# ... existing code ...
        colorize = False
    elif callable(sink):
        writer = functools.partial(sink, **kwargs)
        colorize = False
    else:
# ... existing code ...
'''
    merges(PICK, sketch, "pick.py",
           PICK.replace("writer = sink", "writer = functools.partial(sink, **kwargs)"))


COERCE = '''from functools import wraps


def Length(min=None):
    """Check the length of a value."""
    return min


def Coerce(type, msg=None):
    """Coerce a value to a type.

    If the type constructor throws a ValueError, the value is marked as invalid.
    """
    @wraps(Coerce)
    def f(v):
        try:
            return type(v)
        except ValueError:
            raise Invalid(msg)
    return f


def Boolean(v):
    """Convert human-readable boolean values to a bool."""
    return bool(v)
'''


def test_doctest_continuation_lines_are_code_not_elision_markers() -> None:
    """A docstring's doctest continuation (`...   validate('foo')`: three dots, then a
    call) is code the edit writes, not a "... existing code ..." marker (voluptuous
    b376831c7b in the fifth slice, `mixed`: read as two markers, the docstring's
    segment kept only blank lines and the merge declined)."""
    sketch = ('# ... existing code ...\n'
              '    """Coerce a value to a type.\n\n'
              '    If the type constructor throws a ValueError or TypeError, the value\n'
              '    is marked as invalid.\n\n'
              '        >>> validate = Schema(Coerce(int))\n'
              "        >>> with raises(MultipleInvalid, 'expected int'):\n"
              '        ...   validate(None)\n'
              '    """\n'
              '    @wraps(Coerce)\n'
              '    # ... rest of the function unchanged ...\n'
              '        try:\n'
              '            return type(v)\n'
              '        except (ValueError, TypeError):\n'
              '            raise Invalid(msg)\n'
              '    return f\n'
              '# ... rest of the code unchanged ...\n')
    merges(COERCE, sketch, "v.py", COERCE.replace(
        "    If the type constructor throws a ValueError, the value is marked as invalid.\n",
        "    If the type constructor throws a ValueError or TypeError, the value\n"
        "    is marked as invalid.\n\n"
        "        >>> validate = Schema(Coerce(int))\n"
        "        >>> with raises(MultipleInvalid, 'expected int'):\n"
        "        ...   validate(None)\n").replace(
        "        except ValueError:\n", "        except (ValueError, TypeError):\n"))


VALIDATE = '''def validate(*a, **kw):
    """Decorator for validating arguments of a function against a given schema.

    Set restriction for returned value:

        >>> @validate(arg=int, __return__=int)
        ... def foo(arg1):
        ...   return arg1 * 2

    """
    RETURNS_KEY = '__return__'
    return a, kw
'''


def test_doctest_continuation_headers_and_returns_are_code_not_elision_markers() -> None:
    """`... def bar(arg1):` (a compound statement's header) and `...   return arg1 * 2` (a
    return of a computed value) in a doctest are code, not markers: read as markers, the
    segment kept only `>>> @validate(...)` and blank lines, changed nothing and declined
    (voluptuous aa66c60644 in the fifth slice)."""
    sketch = ('    # (unchanged)\n\n'
              '        >>> @validate(arg=int, __return__=int)\n'
              '        ... def bar(arg1):\n'
              '        ...   return arg1 * 2\n\n'
              '    # [previous implementation]\n')
    merges(VALIDATE, sketch, "v.py", VALIDATE.replace("def foo(arg1)", "def bar(arg1)"))


@pytest.mark.parametrize("line", ["... existing code ...", "... rest unchanged",
                                  "... (unchanged)", "...  other methods",
                                  "... return unchanged", "... rest of the code here"])
def test_uncommented_ellipsis_markers_stay_markers(line: str) -> None:
    """The doctest rule takes only code after `... `: marker prose still elides."""
    assert is_marker("    " + line)


DIGITS = '''import unittest


class Digits(unittest.TestCase):
    def test_path(self):
        self.assertEqual(path(), "root")

    def test_digits(self):
        result = compare([0.012, 0.98], [0.013, 0.99], digits=1)
        self.assertEqual(result, {})

    @unittest.expectedFailure
    def test_digits_with_sets(self):
        result = compare(
            set([0.012, 0.98]), set([0.013, 0.99]), digits=1)
        self.assertEqual(result, {})

    def test_digits_with_order(self):
        result = compare(
            [0.012, 0.98], [0.013, 0.99],
            ignore_order=True)
        self.assertEqual(result, {})


class Other(unittest.TestCase):
    def test_other(self):
        self.assertTrue(True)
'''


def test_a_smaller_reading_that_would_keep_a_test_twice_is_no_rival() -> None:
    """The sketch rewrites three tests that each end in the same line. Closing like the
    first of them, a smaller reading would keep the second and third tests as they are
    after the rewritten text, which shows them too: two copies of lines the file has
    once (`def test_digits_with_sets`). That reading is no rival; the rewrite is written
    (deepdiff 61e76b325e in the fifth slice declined before)."""
    rewritten = '''    def test_digits(self):
        result = compare(
            [0.012, 0.98],
            [0.013, 0.99],
            digits=1,
            view="tree")
        self.assertEqual(result, {})

    def test_digits_with_sets(self):
        result = compare(
            {0.012, 0.98},
            {0.013, 0.99},
            digits=1,
            view="tree")
        self.assertEqual(result, {})

    def test_digits_with_order(self):
        result = compare(
            [0.012, 0.98], [0.013, 0.99],
            ignore_order=True,
            view="tree")
        self.assertEqual(result, {})
'''
    sketch = f"# ... existing code ...\n\n{rewritten}\n# ... existing code ...\n"
    expected = DIGITS[:DIGITS.index("    def test_digits(self):")] + rewritten + \
        DIGITS[DIGITS.index("\n\nclass Other"):]
    merges(DIGITS, sketch, "test_digits.py", expected)


HANDLER = '''import threading


class Handler:
    def __init__(self, sink, enqueue, catch):
        self._sink = sink
        self._enqueue = enqueue
        self._catch = catch
        self._lock = threading.Lock()
        self._stopped = False

    def emit(self, record):
        try:
            text = str(record)
            with self._lock:
                if self._stopped:
                    return
                if self._enqueue:
                    try:
                        self._queue.put(text)
                    except Exception:
                        if not self._catch:
                            raise
                        self._handle_error()
                else:
                    self._sink.write(text)

        except Exception:
            if not self._catch:
                raise
            self._handle_error(record)

    def stop(self):
        with self._lock:
            self._stopped = True
            if self._enqueue:
                if self._owner != current():
                    return
                self._queue.put(None)
'''


def test_a_common_line_and_its_neighbour_are_context_where_reading_them_new_copies_code() -> None:
    """The sketch unwraps a `try:` and opens on `return` (a common line) and
    `if self._enqueue:`, which the file has together once. The cheapest alignment takes
    them and `self._queue.put(text)` as new lines before `else:`, keeping the file's own
    copies above: a second copy of `self._queue.put(text)`, a line the file has once. That
    reading is not one an edit means; the pair is the segment's context, and the `try:`
    and its handler are deleted (loguru 1d11396329 in the fourth slice declined before)."""
    sketch = '''# ... existing code ...
                    return
                if self._enqueue:
                    self._queue.put(text)
                else:
                    self._sink.write(text)
# ... existing code ...
'''
    merges(HANDLER, sketch, "handler.py", HANDLER.replace("""                    try:
                        self._queue.put(text)
                    except Exception:
                        if not self._catch:
                            raise
                        self._handle_error()
""", """                    self._queue.put(text)
"""))


def test_a_pinned_pair_that_leaves_a_class_body_without_its_header_is_not_taken() -> None:
    """A new docstring for `Column` copies `Table`'s `Args:` lines, which the file has once
    each. Read as new lines, they copy `Table`'s; pinned to `Table`'s closing `caption`,
    `width` and quotes, the merge deleted every field of `Column`, `Table`'s header and
    docstring opening, and kept `Table`'s body under `Column` (rich ae12e09065 in
    bench/apply.py, `tight`: a wrong file on 66735a1). Declined, as before the pin."""
    fields = "".join(f'    field_{i}: int = {i}\n    """The field {i}."""\n\n' for i in range(8))
    args = "        title: The title.\n        caption: The caption.\n        width: The width.\n"
    original = (f'class Column:\n    """Defines a column in a table."""\n\n{fields}\n'
                f'class Table:\n    """A renderable that draws a table.\n\n    Args:\n'
                f'        *headers: Column headers.\n{args}    """\n\n    rows: int = 0\n')
    sketch = (f'# ... existing code ...\nclass Column:\n    """Defines a column within a Table.\n\n'
              f'    Args:\n{args}    """\n\n# ... existing code ...\n')
    result = apply_edit(original, sketch, "table.py")
    assert not result.ok, result.merged
