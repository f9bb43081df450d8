"""Next edits that need no model: each function reads the user's recent edits and the file and
proposes the one follow-up change its kind implies, or None.

The base model gives no exact next edit on the held-out cases (docs/tab.md, "Next edit"), and
the trained adapter is compute-blocked, so these rules answer what a rule can: the same
change again (`same_change`) and the change made on lines that differ from the edited ones
in one name (`parallel_change`), near the cursor. A kind is kept only while it keeps
precision >= 0.5 on the tuning repositories (docs/tab.md, "Next edits without a model", has
the table, and the kinds tried and dropped: a parameter added to a `def` passed at its
calls, an import whose last use an edit removed). They read lines, so any language.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher
from typing import Protocol

MAX_BLOCK_LINES = 4  # an edit of more lines is not repeated elsewhere as it is
NEAR_LINES = 10  # the line kinds look this far from the cursor (next edit's window)
_TOKEN = re.compile(r"\w+|\s+|\W")
_WORD = re.compile(r"\w*[^\W\d]\w*")


class Edit(Protocol):
    """One recent edit (`nextedit.EditIn`): lines from `line` (0-based, after it) were
    `before` and are now `after`."""

    line: int
    before: str
    after: str


@dataclass
class Suggestion:
    """Replace lines [start_line, end_line) (0-based) of the file with `text`."""

    start_line: int
    end_line: int
    text: str

    def apply(self, source: str) -> str:
        lines = source.splitlines(keepends=True)
        return "".join(lines[:self.start_line]) + self.text + "".join(lines[self.end_line:])


Kind = Callable[[str, int, Sequence[Edit]], Suggestion | None]


def nearest(spots: list[int], cursor: int) -> int:
    """The place to go: the first at or after the cursor's line, else the last before it
    (the one-word baseline's order)."""
    after = [n for n in spots if n >= cursor]
    return after[0] if after else spots[-1]


# -- the line kinds: the newest edit's change again -----------------------------------------


def same_change(text: str, cursor: int, edits: Sequence[Edit]) -> Suggestion | None:
    """The newest edit's old lines found again near the cursor (indented alike or not):
    the same change there (`@task` -> `@task()` at the next `@task`)."""
    return _repeat(text, cursor, edits, renamed=False)


def parallel_change(text: str, cursor: int, edits: Sequence[Edit]) -> Suggestion | None:
    """Lines that are the newest edit's old lines but for one name: the edit's new lines
    with that name (`if not value1:` -> `if value1 is None:`, so `if not value2:` ->
    `if value2 is None:`)."""
    return _repeat(text, cursor, edits, renamed=True)


def _repeat(text: str, cursor: int, edits: Sequence[Edit], renamed: bool) -> Suggestion | None:
    if not edits:
        return None
    e = edits[-1]
    before, after = e.before.splitlines(keepends=True), e.after.splitlines(keepends=True)
    if not before or len(before) > MAX_BLOCK_LINES or before == after \
            or not re.search(r"\w\w", e.before):
        return None
    lines = text.splitlines(keepends=True)
    own = range(e.line, e.line + max(len(after), 1))  # the edit's own lines are done
    last = min(len(lines) - len(before), cursor + NEAR_LINES)
    places = range(max(0, cursor - NEAR_LINES), last + 1)
    found = {at: new for at in places if at not in own
             if (new := _redone(lines[at:at + len(before)], before, after, renamed))}
    if not found:
        return None
    at = nearest(sorted(found), cursor)
    return Suggestion(at, at + len(before), found[at])


def _redone(place: list[str], before: list[str], after: list[str], renamed: bool
            ) -> str | None:
    """`after` as it would read at `place` when `place` is `before` shifted to another
    indentation - and, if `renamed`, with exactly one name in it another."""
    old, new = _indent(before[0]), _indent(place[0])
    shifted = _shift(before, old, new)
    moved = _shift(after, old, new)
    if shifted is None or moved is None:
        return None
    if not renamed:
        return "".join(moved) if shifted == place else None
    swap = _one_name(shifted, place)
    if swap is None or not re.search(rf"(?<!\w){re.escape(swap[0])}(?!\w)", "".join(moved)):
        return None
    return re.sub(rf"(?<!\w){re.escape(swap[0])}(?!\w)", swap[1], "".join(moved))


def _indent(line: str) -> str:
    return line[:len(line) - len(line.lstrip(" \t"))]


def _shift(lines: list[str], old: str, new: str) -> list[str] | None:
    """`lines` moved from indentation `old` to `new`; None if one is indented less."""
    out = []
    for line in lines:
        if not line.strip():
            out.append(line)
        elif line.startswith(old):
            out.append(new + line[len(old):])
        else:
            return None
    return out


def _one_name(a: list[str], b: list[str]) -> tuple[str, str] | None:
    """(old name, new name) when `b` is `a` with one name replaced by another."""
    x, y = _TOKEN.findall("".join(a)), _TOKEN.findall("".join(b))
    ops = [op for op in SequenceMatcher(None, x, y, autojunk=False).get_opcodes()
           if op[0] != "equal"]
    if len(ops) != 1 or ops[0][0] != "replace" or ops[0][2] - ops[0][1] != 1 \
            or ops[0][4] - ops[0][3] != 1:
        return None
    old, new = x[ops[0][1]], y[ops[0][3]]
    return (old, new) if _WORD.fullmatch(old) and _WORD.fullmatch(new) else None


KINDS: dict[str, Kind] = {"same": same_change, "parallel": parallel_change}


def propose(text: str, cursor: int, edits: Sequence[Edit]) -> tuple[str, Suggestion] | None:
    """(kind, suggestion) of the first kind that fires, in KINDS' order."""
    for name, kind in KINDS.items():
        if (found := kind(text, cursor, edits)) is not None:
            return name, found
    return None
