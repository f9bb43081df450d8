"""The one-word change of an edit, and the lines where a word occurs.

Both sides of next edit read them: the server, for the repeat-the-last-edit baseline and the
jump (`tab/nextedit.py`), and the editor's process (`tab/lsp.py`), to send a request only the
open document the jump can lead to. Plain `re`/`difflib` here, so the editor's process does
not import the server's modules.
"""

from __future__ import annotations

import re
from difflib import SequenceMatcher

_TOKEN = re.compile(r"\w+|\W")


def word_change(before: str, after: str) -> tuple[str, str] | None:
    """(old word, new word) when `after` is `before` with exactly one identifier replaced."""
    a, b = _TOKEN.findall(before), _TOKEN.findall(after)
    ops = [op for op in SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
           if op[0] != "equal"]
    if len(ops) != 1 or ops[0][0] != "replace":
        return None
    _, i1, i2, j1, j2 = ops[0]
    old, new = "".join(a[i1:i2]), "".join(b[j1:j2])
    return (old, new) if re.fullmatch(r"\w+", old) and re.fullmatch(r"\w+", new) else None


def occurrences(text: str, word: str) -> list[int]:
    """0-based lines where `word` occurs as a whole word."""
    pattern = re.compile(rf"(?<!\w){re.escape(word)}(?!\w)")
    return [n for n, line in enumerate(text.split("\n")) if pattern.search(line)]
