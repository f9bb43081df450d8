"""Next edits that need no model: each function reads the user's recent edits and the file and
proposes the one follow-up change its kind implies, or None.

The base model gives no exact next edit on the held-out cases (docs/tab.md, "Next edit"), and
the trained adapter is compute-blocked, so these rules answer what a rule can: the same
change again (`same_change`) and the change made on lines that differ from the edited ones
in one name (`parallel_change`), near the cursor. A kind is kept only while it keeps
precision >= 0.5 on the tuning repositories (docs/tab.md, "Next edits without a model", has
the table, and the kinds tried and dropped: a parameter added to a `def` passed at its
calls, an import whose last use an edit removed). They read lines, so any language; only
`parallel` asks the file's grammar whether a word is a name, so it fires only in a language
with one (`core.languages`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher
from functools import cached_property
from itertools import accumulate
from typing import Any, Protocol

from codeplane.core.languages import code_language, parser

MAX_BLOCK_LINES = 4  # an edit of more lines is not repeated elsewhere as it is
NEAR_LINES = 10  # the line kinds look this far from the cursor (next edit's window)
_TOKEN = re.compile(r"\w+|\s+|\W")
_WORD = re.compile(r"\w*[^\W\d]\w*")


class Edit(Protocol):
    """One recent edit (`nextedit.EditIn`): lines from `line` (0-based, after it) were
    `before` and are now `after`."""

    path: str
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
    return _repeat(text, cursor, edits, None)


def parallel_change(text: str, cursor: int, edits: Sequence[Edit]) -> Suggestion | None:
    """Lines that are the newest edit's old lines but for one name: the edit's new lines
    with that name (`if not value1:` -> `if value1 is None:`, so `if not value2:` ->
    `if value2 is None:`). Shaped alike is not meant alike (docs/tab.md, "Next edits
    without a model", has the misses), so the other word must be a name the code uses
    (`_Names`: the file's grammar - the newest edit's file's - is needed to tell), the
    edit's old lines must hold the old name once (else which of them the other line's
    name stands for is unknown), and the edit's new lines must not hold the other name
    already (the edit is then about both names: renaming in it repeats a condition)."""
    if not edits or (language := code_language(edits[-1].path)) is None:
        return None
    return _repeat(text, cursor, edits, _Names(text, language))


def _repeat(text: str, cursor: int, edits: Sequence[Edit], names: _Names | None
            ) -> Suggestion | None:
    """The newest edit redone at the nearest place near the cursor: the same lines
    (`names` None) or, with `names`, lines that differ from them in one name."""
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
    starts = [0, *accumulate(len(line) for line in lines)]
    found = {at: new for at in places if at not in own
             if (new := _redone(lines[at:at + len(before)], before, after, names, starts[at]))}
    if not found:
        return None
    at = nearest(sorted(found), cursor)
    return Suggestion(at, at + len(before), found[at])


def _redone(place: list[str], before: list[str], after: list[str], names: _Names | None,
            start: int) -> str | None:
    """`after` as it would read at `place` (at character `start` of the file) when `place`
    is `before` shifted to another indentation - and, with `names`, with exactly one name
    in it another (`parallel_change` says which)."""
    old, new = _indent(before[0]), _indent(place[0])
    shifted = _shift(before, old, new)
    moved = _shift(after, old, new)
    if shifted is None or moved is None:
        return None
    if names is None:
        return "".join(moved) if shifted == place else None
    swap = _one_name(shifted, place)
    if swap is None:
        return None
    name, other, offset = swap
    word, written = _word(name), "".join(moved)
    if len(word.findall("".join(shifted))) != 1 or not word.search(written) \
            or _word(other).search(written) or not names.is_name(start + offset, other):
        return None
    return word.sub(other, written)


def _word(name: str) -> re.Pattern[str]:
    return re.compile(rf"(?<!\w){re.escape(name)}(?!\w)")


class _Names:
    """Which words of a file are names its code uses, by its syntax tree (parsed on the
    first question: most requests ask none)."""

    def __init__(self, text: str, language: str) -> None:
        self.text, self.language = text, language

    @cached_property
    def _tree(self) -> Any:
        return parser(self.language).parse(_utf8(self.text))

    def is_name(self, offset: int, word: str) -> bool:
        """Whether `word`, at character `offset`, is an identifier outside any import: not
        a keyword (`return` -> `del` is no rename), not text in a string or comment, not a
        module an import names (another module is no parallel use of the first)."""
        start = len(_utf8(self.text[:offset]))
        end = start + len(_utf8(word))
        node = self._tree.root_node.descendant_for_byte_range(start, end)
        if not node.type.endswith("identifier") or (node.start_byte, node.end_byte) != (start, end):
            return False
        while node is not None:
            if "import" in node.type:
                return False
            node = node.parent
        return True


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


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _one_name(a: list[str], b: list[str]) -> tuple[str, str, int] | None:
    """(old name, new name, the new name's character offset in `b`) when `b` is `a` with
    one name replaced by another."""
    x, y = _TOKEN.findall("".join(a)), _TOKEN.findall("".join(b))
    ops = [op for op in SequenceMatcher(None, x, y, autojunk=False).get_opcodes()
           if op[0] != "equal"]
    if len(ops) != 1 or ops[0][0] != "replace" or ops[0][2] - ops[0][1] != 1 \
            or ops[0][4] - ops[0][3] != 1:
        return None
    old, new = x[ops[0][1]], y[ops[0][3]]
    offset = sum(len(token) for token in y[:ops[0][3]])
    return (old, new, offset) if _WORD.fullmatch(old) and _WORD.fullmatch(new) else None


KINDS: dict[str, Kind] = {"same": same_change, "parallel": parallel_change}


def propose(text: str, cursor: int, edits: Sequence[Edit]) -> tuple[str, Suggestion] | None:
    """(kind, suggestion) of the first kind that fires, in KINDS' order."""
    for name, kind in KINDS.items():
        if (found := kind(text, cursor, edits)) is not None:
            return name, found
    return None
