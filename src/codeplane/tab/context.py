"""Client side of Tab: what to send for a cursor position, within a token budget.

The client is the trust boundary, so it decides what leaves the machine: a window of the
current file around the cursor and a few recently viewed/edited snippets from other files
(a ring buffer, as llama.vim keeps). Windows start on line boundaries quantized to
`QUANTUM` lines so the text sent changes only at its end while the user types - that is what
lets the server reuse its KV cache from one keystroke to the next.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from codeplane.tab.related import Related

# The client has no model tokenizer; Qwen's BPE averages ~3.5 characters per token on code,
# so 3 errs on the side of sending less than the budget.
CHARS_PER_TOKEN = 3
QUANTUM = 16


@dataclass(frozen=True)
class Budget:
    prefix_tokens: int = 1024
    suffix_tokens: int = 128
    context_tokens: int = 512
    related_tokens: int = 384  # definitions of names near the cursor (tab/related.py)


@dataclass(frozen=True)
class Excerpt:
    path: str
    text: str


@dataclass
class Ring:
    """Recently viewed/edited snippets from other files, oldest first.

    Order is kept stable (new chunks go to the end, nothing reorders on reuse) because the
    snippets are the start of the prompt: any change there recomputes everything after it.
    """

    size: int = 16
    chunk_lines: int = 64
    chunks: deque[Excerpt] = field(default_factory=deque)

    def add(self, path: str, text: str, line: int) -> None:
        """Remember the lines around `line` (0-based) of `path`; a chunk that mostly
        repeats an older one replaces it (llama.vim's >90% Dice line overlap)."""
        lines = text.split("\n")
        start = max(0, line - self.chunk_lines // 2)
        body = "\n".join(lines[start:start + self.chunk_lines]).strip("\n")
        if not body.strip():
            return
        chunk = Excerpt(path, body)
        for old in list(self.chunks):
            if old.path == path and _dice(old.text, body) > 0.9:
                self.chunks.remove(old)
        self.chunks.append(chunk)
        while len(self.chunks) > self.size:
            self.chunks.popleft()

    def snippets(self, exclude_path: str, budget_tokens: int) -> list[Excerpt]:
        """Newest snippets that fit the budget, returned oldest first."""
        out: list[Excerpt] = []
        left = budget_tokens * CHARS_PER_TOKEN
        for chunk in reversed(self.chunks):
            if chunk.path == exclude_path or len(chunk.text) > left:
                continue
            out.append(chunk)
            left -= len(chunk.text)
        return out[::-1]


def _dice(a: str, b: str) -> float:
    la, lb = set(a.split("\n")), set(b.split("\n"))
    return 2 * len(la & lb) / (len(la) + len(lb)) if la or lb else 1.0


def offset_of(text: str, line: int, col: int) -> int:
    """Offset of a 0-based (line, column-in-characters) position; clamps the column to the
    line, raises ValueError for a line past the end."""
    lines = text.split("\n")
    if line < 0 or line >= len(lines):
        raise ValueError(f"line {line + 1} is outside the file (1..{len(lines)})")
    return sum(len(ln) + 1 for ln in lines[:line]) + min(max(col, 0), len(lines[line]))


def window(text: str, offset: int, budget: Budget) -> tuple[str, str]:
    """(prefix, suffix) around `offset`: the prefix starts on a quantized line boundary, the
    suffix ends on a line boundary, both within the budget."""
    before, after = text[:offset], text[offset:]
    lines = before.split("\n")
    cursor_line = len(lines) - 1
    left = budget.prefix_tokens * CHARS_PER_TOKEN - len(lines[-1])
    start = cursor_line
    while start > 0 and left - len(lines[start - 1]) - 1 >= 0:
        start -= 1
        left -= len(lines[start]) + 1
    if start > 0:  # move the start forward to the next quantum so it changes rarely
        start = min(cursor_line, -(-start // QUANTUM) * QUANTUM)
    prefix = "\n".join(lines[start:])
    keep = budget.suffix_tokens * CHARS_PER_TOKEN
    if len(after) > keep:
        cut = after.rfind("\n", 0, keep)
        after = after[: cut if cut > 0 else keep]
    return prefix, after


def build_request(path: str, text: str, offset: int, ring: Ring | None = None,
                  budget: Budget = Budget(), related: Related | None = None,
                  **extra: object) -> dict:
    """The JSON body for `POST /v1/tab`: recently viewed snippets, then definitions of the
    names near the cursor (both change rarely: they are the head of the prompt)."""
    prefix, suffix = window(text, offset, budget)
    snippets = ring.snippets(path, budget.context_tokens) if ring else []
    if related is not None:
        line = text.count("\n", 0, offset)
        shown = (line - prefix.count("\n"), line + suffix.count("\n"))
        snippets += related.for_cursor(path, text, offset, shown, budget.related_tokens)
    return {"path": path, "prefix": prefix, "suffix": suffix,
            "context": [{"path": c.path, "text": c.text} for c in snippets], **extra}
