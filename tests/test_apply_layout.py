"""Issue #33: lines a sketch shows as unchanged context keep the file's exact bytes (blank
lines, whitespace within lines, line breaks of a statement); only what the sketch changes is
written. Models redraw the layout of the context they copy back: blank lines collapsed,
removed or added, trailing whitespace stripped or added, a call joined onto one line.
Deterministic path only (no model)."""

from __future__ import annotations

import difflib
import random

from applykit import merges
from conftest import bench_script

from codeplane.apply.guard import opcodes_between, restore_layout
from codeplane.apply.service import apply_edit

MODULE = '''"""Files under a root directory."""

import os
import sys

from store.base import Base


def load(root):
    items = {}
    for name in os.listdir(root):
        items[name] = read(name)
    return items


def save(root, items):
    for name, text in items.items():
        write(os.path.join(root, name), text)


def main():
    print(load(sys.argv[1]))
'''
FIXED = MODULE.replace("read(name)", "read(os.path.join(root, name))")


def merged(original: str, sketch: str, path: str = "store.py") -> str:
    result = apply_edit(original, sketch, path)
    assert result.ok, result.diagnostics
    return result.merged or ""


def test_blank_lines_redrawn_in_context_keep_the_files() -> None:
    """The blank line under the module docstring removed, one added between the imports,
    two collapsed to one between functions: the file's blank lines stay, only the changed
    line is written."""
    sketch = '''"""Files under a root directory."""
import os

import sys

from store.base import Base

def load(root):
    items = {}
    for name in os.listdir(root):
        items[name] = read(os.path.join(root, name))
    return items
# ... existing code ...
'''
    result = merges(MODULE, sketch, "store.py", FIXED)
    assert any("layout guard" in note for note in result.diagnostics)


def test_blank_lines_shown_next_to_new_code_are_the_edits() -> None:
    """A new function with blank lines around it: those are part of the change and written
    as shown (one line less below it than the file has between functions), while the blank
    lines collapsed between two context lines in the same segment keep the file's."""
    sketch = '''# ... existing code ...
    return items


def check(root):
    return os.path.isdir(root)

def save(root, items):
    for name, text in items.items():
        write(os.path.join(root, name), text)

def main():
# ... existing code ...
'''
    assert merged(MODULE, sketch) == MODULE.replace(
        "\n\ndef save", "\n\ndef check(root):\n    return os.path.isdir(root)\n\ndef save")


def test_whitespace_within_context_lines_keeps_the_files_bytes() -> None:
    """Trailing whitespace stripped (the file keeps it), added (the file's line has none),
    and a blank line indented as the block around it where the file's is empty."""
    original = MODULE.replace("    items = {}\n", "    items = {}  \n")
    sketch = ("# ... existing code ...\ndef load(root):   \n    items = {}\n    \n"
              "    for name in os.listdir(root):\n        items[name] = read(os.path.join(root, name))\n"
              "    return items\n# ... existing code ...\n")
    expected = original.replace("read(name)", "read(os.path.join(root, name))")
    assert merged(original.replace("    for name in os", "\n    for name in os", 1),
                  sketch) == expected.replace("    for name in os", "\n    for name in os", 1)


def test_joined_statement_in_context_maps_back_to_the_files_lines() -> None:
    """The same call is wrapped two ways in the file, so the joined copy in the sketch's
    context cannot be put back before the alignment (it matches two texts): the merge
    still gives the file's lines back for it."""
    call = "    store = Store(\n        root,\n        cache=True,\n    )\n"
    other = "    store = Store(root,\n                  cache=True)\n"
    original = (f"def build(root):\n{call}    store.load()\n    return store\n\n\n"
                f"def rebuild(root):\n{other}    store.clear()\n    return store\n")
    sketch = ("def build(root):\n    store = Store(root, cache=True)\n    store.load()\n"
              "    store.check()\n    return store\n# ... existing code ...\n")
    assert merged(original, sketch, "b.py") == original.replace(
        "    store.load()\n", "    store.load()\n    store.check()\n")


def test_layout_guard_restores_layout_changes_outside_the_edit() -> None:
    """The guard on its own, whatever the alignment did: layout-only differences that touch
    no changed line go back to the file's lines; blank lines next to a changed line, a
    re-indented block and an edit that changes nothing but layout are left as they are."""
    original = MODULE.splitlines()
    change = original.index("        items[name] = read(name)")
    drifted = [line for k, line in enumerate(original) if k != 1]  # under the docstring
    drifted.insert(drifted.index("import sys"), "")  # between the imports
    drifted[drifted.index("        items[name] = read(name)")] = \
        "        items[name] = read(os.path.join(root, name))"
    drifted[drifted.index("    items = {}")] = "    items = {}   "
    repaired, count, ambiguous = restore_layout(original, drifted)
    assert ambiguous is None
    assert repaired == FIXED.splitlines() and count == 3
    # A blank line added right after the changed line belongs to the change.
    spaced = FIXED.splitlines()
    spaced.insert(change + 1, "")
    assert restore_layout(original, spaced) == (spaced, 0, None)
    # Re-indented lines are the edit (a loop unwrapped), not layout.
    unwrapped = original[:change - 1] + ["    name = root", "    items[name] = read(name)"] + \
        original[change + 1:]
    assert restore_layout(original, unwrapped) == (unwrapped, 0, None)
    # Layout alone is the edit: nothing to restore.
    only_layout = [line for k, line in enumerate(original) if k != 1]
    assert restore_layout(original, only_layout) == (only_layout, 0, None)


# A commit adds a function that ends like the one above it (`return job.run()`) and gives
# the blank lines after it a layout of its own. The repeated line pairs with the file's
# line either as its first copy or as its last; with the last, the blank lines before
# `class Runner` are context and would get the file's layout back, with the first they are
# the new code's. Both readings are equally good, so the guard may not choose.
REPEATED = '''import jobs


def first(job):
    return job.run()


class Runner:
    def start(self):
        return 1
'''


def second_after_first(blank: str) -> str:
    """A sketch adding `second` below `first`, with `blank` between the functions and
    before the class."""
    return (f"# ... existing code ...\ndef first(job):\n    return job.run()\n{blank}"
            f"def second(job):\n    return job.run()\n{blank}class Runner:\n"
            f"# ... existing code ...\n")


def test_blank_lines_next_to_a_repeated_line_that_pairs_two_ways_decline() -> None:
    """The sketch's one blank line before the class is the commit's (new code above it) or
    drift (context): the merge declines rather than restore the file's two blank lines."""
    result = apply_edit(REPEATED, second_after_first("\n"), "runner.py")
    assert not result.ok, result.merged
    reason = result.diagnostics[-1]
    assert "layout guard" in reason and "two equally good places" in reason


def test_repeated_line_without_layout_to_restore_still_merges() -> None:
    """The same repeated line, but the sketch keeps the file's blank lines: whichever copy
    pairs with the file's line, the merge is the same file, so it is written."""
    assert merged(REPEATED, second_after_first("\n\n"), "runner.py") == REPEATED.replace(
        "\n\n\nclass", "\n\n\ndef second(job):\n    return job.run()\n\n\nclass")


def test_benchmark_drops_commits_a_sketch_cannot_express() -> None:
    """The benchmark's well-posedness filter is a rule about the commit's diff: a blank
    line removed between two unchanged definitions, or a call re-wrapped with a trailing
    comma, is layout of context that the merge keeps, so no sketch can say it; those cases
    are not counted as wrong merges. A re-indented line whose blank lines also go is a
    change, and a commit that is nothing but layout is its own edit."""
    bench = bench_script("apply.py")
    fixed = MODULE.replace("read(name)", "read(os.path.join(root, name))")
    # A blank line removed between `load` and `save`, which the commit does not change.
    fewer_blanks = fixed.replace("    return items\n\n\ndef save", "    return items\n\ndef save")
    # The same, where the commit's one change re-indents a line and drops a blank line
    # after it in the same diff stretch: that stretch is a change, not layout.
    write = "        write(os.path.join(root, name), text)\n"
    reindented = MODULE.replace("    return items\n\n\ndef save", "    return items\n\ndef save")
    reindented = reindented.replace(write + "\n\n", "    " + write + "\n")
    rewrapped = fixed.replace("print(load(sys.argv[1]))", "print(\n        load(sys.argv[1]),\n    )")
    for expected in (fewer_blanks, reindented, rewrapped):
        assert bench.layout_changes({"original": MODULE, "expected": expected})
    assert not bench.layout_changes({"original": MODULE, "expected": fixed})
    assert not bench.layout_changes({"original": MODULE, "expected": MODULE.replace(
        write + "\n\n", "    " + write + "\n")})
    only_layout = MODULE.replace("    return items\n\n\ndef save", "    return items\n\ndef save")
    assert not bench.layout_changes({"original": MODULE, "expected": only_layout})


def test_layout_only_the_other_pairing_would_give_back_is_left_as_sketched() -> None:
    """A new decorator factory ends like the one above it, but with a blank line inside its
    ending where the file's has none. Paired with the new copy's lines, the file's ending
    would lend it that layout; the guard's own reading restores nothing there, so nothing
    is ambiguous and the new code is written as the sketch shows it."""
    original = ("def once(func):\n    def wrapper():\n        return func()\n"
                "        return wrapper\n    return decorator\n\n\nclass Last:\n    pass\n")
    added = ("def twice(func):\n    def wrapper():\n        func()\n        return func()\n"
             "        return wrapper\n\n    return decorator\n\n\n")
    sketch = ("# ... existing code ...\n        return wrapper\n    return decorator\n\n\n"
              f"{added}class Last:\n# ... existing code ...\n")
    assert merged(original, sketch, "deco.py") == original.replace("class Last", added + "class Last")


def test_end_to_end_benchmark_caps_declines_per_style_smallest_file_first() -> None:
    """`wild.py --model M --model-cases N` runs the product's full path on at most N
    declines of each style, the smallest files first (the model path's time grows with
    the window), so a capped run on a slow box still covers every style."""
    wild = bench_script("apply/wild.py")
    declined = [(style, {"original": "x\n" * size}, f"{style}{size}")
                for style, size in (("body", 9), ("drift", 3), ("body", 2), ("body", 5))]
    assert [d[2] for d in wild.capped(declined, 2)] == ["body2", "body5", "drift3"]
    assert wild.capped(declined, None) == declined


def test_end_to_end_benchmark_resumes_from_its_log(tmp_path, capsys) -> None:
    """`wild.py --model M --resume FILE` appends each end-to-end outcome to FILE and takes
    the applies already there from it instead of running them again, so a long run splits
    over short holds of the CPU lock. Every decline here is recorded: no model is loaded."""
    wild = bench_script("apply/wild.py")
    case = {"repo": "o/r", "commit": "c" * 40, "path": "a.py", "original": "x\n"}
    declined = [("body", case, "sketch one\n"), ("body", case, "sketch two\n")]
    log = tmp_path / "log.jsonl"
    log.write_text("".join(
        wild.json.dumps({"key": wild.case_key("body", case, text), "kind": kind}) + "\n"
        for (_, _, text), kind in zip(declined, ("exact", "rejected"), strict=True)))
    kinds = {("body", "tune"): [], ("body", "held-out"): ["exact", "declined", "declined"]}
    wild.end_to_end(declined, wild.defaultdict(list, kinds), "code-small", log=log)
    printed = capsys.readouterr().out
    assert printed.count("(recorded)") == 2
    assert "body        1 /   0 /   1   final  66.7% /  0.0% /" in printed
    assert wild.case_key("body", case, "sketch three\n") not in wild.recorded(log)


def test_the_guards_diff_is_difflibs_where_lines_repeat() -> None:
    """The guards read a merge through difflib's opcodes; the faster search used where
    lines repeat (blank lines, closing brackets) must give exactly difflib's, ties and
    crossing matches included, or a guard decision could change. Sequences of a few
    distinct lines repeat enough to take the faster search."""
    rng = random.Random(7)
    for _ in range(300):
        old = [rng.choice("ab()") for _ in range(rng.randint(40, 160))]
        new = list(old)
        for _ in range(rng.randint(0, 8)):
            at = rng.randint(0, len(new))
            new[at:at + rng.randint(0, 3)] = [rng.choice("abc)") for _ in range(rng.randint(0, 3))]
        if rng.random() < 0.2:
            new = [rng.choice("ab()") for _ in range(rng.randint(0, 160))]
        assert opcodes_between(old, new) == difflib.SequenceMatcher(
            None, old, new, autojunk=False).get_opcodes()
