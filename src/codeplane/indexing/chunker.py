"""Split a source file into search chunks: one per function/class/method where the syntax tree
says so (tree-sitter), merged or split to a size budget, with a line-window fallback.

Why definitions: queries ask "where is X done", and the answer is a function. A definition that
fits the budget is its own chunk; consecutive small non-definition statements (imports,
constants, comments) are merged; an oversized definition is split into its children, each
carrying the enclosing signatures (`class Foo:` / `def bar(...)`) as context in the embedded
text. Budget is in characters (~4 per token): 1,600 chars stays under bge-small's 512 tokens.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from codeplane.core.languages import DEF_TYPES, code_language, parser

MAX_CHARS = 1600
GLUE_MERGE = 160  # smaller non-definition code joins following non-definition code
WINDOW_LINES = 60
# The layout of the text the embedder sees (`Chunk.embed_text`). Bump it with every change
# there: sync rebuilds an index whose vectors were made from another layout (a Merkle leaf
# hashes the file, so an unchanged file would otherwise keep its old vector). 1 is the layout
# below, measured against variants in bench/search/layouts.py (docs/search.md).
EMBED_FORMAT = 1


@dataclass(frozen=True)
class Chunk:
    start_line: int  # 1-based, inclusive
    end_line: int
    text: str  # the source lines themselves
    context: str  # enclosing signatures, embedded with the text but not part of the range

    @property
    def digest(self) -> str:
        return hashlib.sha256(f"{self.context}\n{self.text}".encode()).hexdigest()

    def embed_text(self, rel: str) -> str:
        head = f"# {rel}\n" + (f"{self.context}\n" if self.context else "")
        return head + self.text


@dataclass
class _Span:
    start: int  # 0-based rows, inclusive
    end: int
    context: tuple[str, ...]
    is_def: bool


def chunk_text(rel: str, text: str) -> list[Chunk]:
    lines = text.splitlines()
    if not lines:
        return []
    language = code_language(rel)
    spans = None
    if language:
        try:
            tree = parser(language).parse(text.encode())
            spans = _merge(_spans(tree.root_node, ()), lines)
        except (LookupError, ValueError, RuntimeError):
            spans = None  # grammar missing from this build: fall back to line windows
    if not spans:
        spans = _windows(lines, 0, len(lines) - 1, ())
    chunks = []
    for span in spans:
        body = "\n".join(lines[span.start:span.end + 1])
        if body.strip():
            chunks.append(Chunk(span.start + 1, span.end + 1, body, "\n".join(span.context)))
    return chunks


def _size(node) -> int:
    return node.end_byte - node.start_byte


def _spans(node, context: tuple[str, ...]) -> list[_Span]:
    out: list[_Span] = []
    group: _Span | None = None
    group_start_byte = 0
    for child in node.children:
        start, end = child.start_point[0], child.end_point[0]
        is_def = child.is_named and child.type in DEF_TYPES  # `class` is also a keyword
        if is_def or _size(child) > MAX_CHARS:
            if group:
                out.append(group)
                group = None
            if _size(child) <= MAX_CHARS:
                out.append(_Span(start, end, context, is_def))
            elif child.child_count:
                out += _spans(child, context + _signature(child))
            else:
                out.append(_Span(start, end, context, False))  # split into windows later
        elif group and child.end_byte - group_start_byte <= MAX_CHARS:
            group.end = max(group.end, end)
        else:
            if group:
                out.append(group)
            group, group_start_byte = _Span(start, end, context, False), child.start_byte
    if group:
        out.append(group)
    return out


def _signature(node) -> tuple[str, ...]:
    """The first line of a definition we descend into (e.g. `class Foo(Base):`)."""
    if node.type not in DEF_TYPES:
        return ()
    first = node.text.decode(errors="replace").split("\n", 1)[0].strip()
    return (first[:200],) if first else ()


def _merge(spans: list[_Span], lines: list[str]) -> list[_Span]:
    """Fold a small non-definition span (a header, a lone decorator or import) into the span that
    follows; split oversized spans into line windows; keep rows strictly increasing."""
    out: list[_Span] = []
    carry: int | None = None
    for index, span in enumerate(spans):
        if out and span.start <= out[-1].end:
            span.start = out[-1].end + 1
            if span.start > span.end:
                continue
        if carry is not None:
            span.start, carry = carry, None
        chars = sum(len(line) + 1 for line in lines[span.start:span.end + 1])
        # definitions keep their exact ranges: a small header only joins non-definition code
        following = spans[index + 1] if index + 1 < len(spans) else None
        if not span.is_def and chars < GLUE_MERGE and following and not following.is_def:
            carry = span.start
            continue
        if chars > MAX_CHARS * 1.25:
            out += _windows(lines, span.start, span.end, span.context)
        else:
            out.append(span)
    if carry is not None and (not out or carry > out[-1].end):
        out.append(_Span(carry, len(lines) - 1, (), False))
    return out


def _windows(lines: list[str], first: int, last: int, context: tuple[str, ...]) -> list[_Span]:
    """Consecutive windows of at most MAX_CHARS / WINDOW_LINES, cut at line ends."""
    out: list[_Span] = []
    start, chars = first, 0
    for row in range(first, last + 1):
        size = len(lines[row]) + 1
        if row > start and (chars + size > MAX_CHARS or row - start >= WINDOW_LINES):
            out.append(_Span(start, row - 1, context, False))
            start, chars = row, 0
        chars += size
    out.append(_Span(start, last, context, False))
    return out
