"""The user's recent edits, across open documents, for next-edit requests (`tab/nextedit.py`).

The LSP server feeds every `didChange` here as (text before, text after). An edit is kept as
the lines it replaced and the lines that replaced them (`before`/`after`, with the first line's
position), not as raw keystrokes: keystrokes in one place within a short pause are one edit
(typing a word, or a rename's letters, is one change), computed as the line diff between the
document when the burst began and now. Bounded in count and characters; nothing is persisted.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass

PAUSE_S = 2.0  # keystrokes closer together than this, in the same place, are one edit
MAX_EDITS = 16
MAX_SNIPPET_CHARS = 2000  # per side of one edit; a larger edit keeps its first lines
MAX_TOTAL_CHARS = 12_000  # over all kept edits; the oldest go first
NEAR_LINES = 10  # "near the cursor" for the FIM / next-edit choice


@dataclass(frozen=True)
class Edit:
    """One edit: lines [line, line + len(before lines)) of `path` became `after`. `line` is
    0-based, in the document as it was just after the edit."""

    path: str
    line: int
    before: str
    after: str
    time: float

    def to_json(self) -> dict:
        return {"path": self.path, "line": self.line, "before": self.before,
                "after": self.after}

    @property
    def size(self) -> int:
        return len(self.before) + len(self.after)

    def is_insertion(self) -> bool:
        """True when the edit only added text at one place (plain typing, a pasted block):
        `before` is `after` with one contiguous piece removed."""
        head = _common_prefix(self.before, self.after)
        tail = _common_suffix(self.before[head:], self.after[head:])
        return head + tail >= len(self.before)


@dataclass
class _Burst:
    """The newest edit's document before it began: later keystrokes extend the edit."""

    path: str
    base: str


class History:
    def __init__(self, pause_s: float = PAUSE_S, max_edits: int = MAX_EDITS,
                 max_chars: int = MAX_TOTAL_CHARS) -> None:
        self.pause_s, self.max_chars = pause_s, max_chars
        self._edits: deque[Edit] = deque(maxlen=max_edits)
        self._burst: _Burst | None = None

    def record(self, path: str, old: str, new: str, now: float | None = None) -> None:
        """Note that document `path` went from `old` to `new` (one `didChange`)."""
        now = time.monotonic() if now is None else now
        last = self._edits[-1] if self._edits else None
        burst = self._burst
        if (last is not None and burst is not None and burst.path == path
                and now - last.time <= self.pause_s and _touches(last, old, new)):
            self._edits.pop()
            edit = _diff(path, burst.base, new, now)
        else:
            burst = self._burst = _Burst(path, old)
            edit = _diff(path, old, new, now)
        if edit is None:  # typed and erased again: nothing left of the burst
            self._burst = None
            return
        self._edits.append(edit)
        while sum(e.size for e in self._edits) > self.max_chars and len(self._edits) > 1:
            self._edits.popleft()

    def forget(self, path: str) -> None:
        """A closed document: its edits go (they describe text no longer held)."""
        self._edits = deque((e for e in self._edits if e.path != path),
                            maxlen=self._edits.maxlen)
        if self._burst and self._burst.path == path:
            self._burst = None

    def recent(self) -> list[Edit]:
        """Oldest first."""
        return list(self._edits)

    def wants_next_edit(self, path: str, line: int) -> bool:
        """The FIM / next-edit choice (docs/tab.md, "Next edit"): next edit when the newest
        edit is in this document, within NEAR_LINES of the cursor, and not plain typing."""
        if not self._edits:
            return False
        last = self._edits[-1]
        end = last.line + last.after.count("\n")
        return (last.path == path and last.line - NEAR_LINES <= line <= end + NEAR_LINES
                and not last.is_insertion())


def _touches(last: Edit, old: str, new: str) -> bool:
    """Whether the change old -> new lies within (or right next to) the newest edit's lines."""
    region = _region(old, new)
    if region is None:
        return True
    start, old_end, _ = region
    return last.line - 1 <= start and old_end <= last.line + last.after.count("\n") + 2


def _diff(path: str, old: str, new: str, now: float) -> Edit | None:
    region = _region(old, new)
    if region is None:
        return None
    start, old_end, new_end = region
    before = "".join(old.splitlines(keepends=True)[start:old_end])
    after = "".join(new.splitlines(keepends=True)[start:new_end])
    return Edit(path, start, _clip(before), _clip(after), now)


def _region(old: str, new: str) -> tuple[int, int, int] | None:
    """(first changed line, its end in old, its end in new), or None when equal. Hand-written
    rather than difflib: one common prefix and suffix of lines is all an edit burst needs,
    in linear time on every keystroke."""
    if old == new:
        return None
    a, b = old.splitlines(keepends=True), new.splitlines(keepends=True)
    head = 0
    while head < min(len(a), len(b)) and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < min(len(a), len(b)) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    return head, len(a) - tail, len(b) - tail


def _clip(text: str) -> str:
    if len(text) <= MAX_SNIPPET_CHARS:
        return text
    cut = text.rfind("\n", 0, MAX_SNIPPET_CHARS)
    return text[:cut + 1] if cut >= 0 else text[:MAX_SNIPPET_CHARS]


def _common_prefix(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def _common_suffix(a: str, b: str) -> int:
    return len(os.path.commonprefix([a[::-1], b[::-1]]))
