"""Recognise what kind of edit a model returned and parse it into line blocks.

Four shapes occur in practice: a sketch with elision markers (`# ... existing code ...`),
Aider-style SEARCH/REPLACE blocks, a unified diff, or a whole new file. Everything is handled
as lists of lines without line endings; `split_lines`/`join_lines` keep the original file's
newline style and final newline exact.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Comment openers and closers of the common languages; a marker is a comment (or a bare
# "... words ...") whose text is an ellipsis plus a few words, or a "rest unchanged" phrase.
_OPENERS = ("{/*", "/*", "<!--", "//", "#", "--", ";", "%", "*")
_CLOSERS = ("*/}", "*/", "-->")
_ELLIPSIS = re.compile(r"(\.\.\.|…)")
_PHRASE = re.compile(
    r"^(rest of|existing|unchanged|remaining|previous|other|same|keep|omitted|snip)\b.*"
    r"(code|unchanged|methods|functions|file|lines|imports|implementation|as before|here|"
    r"omitted|same)\W*$", re.IGNORECASE)
_SEARCH = re.compile(r"^\s*<{5,9} ?SEARCH\b")
_DIVIDER = re.compile(r"^\s*={5,9}\s*$")
_REPLACE = re.compile(r"^\s*>{5,9} ?REPLACE\b")
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@|^@@+\s*$|^@@ .*@@")
_FENCE = re.compile(r"^\s*(```|~~~)")


@dataclass
class Block:
    """Replace `old` lines with `new` lines; `hint` is a 0-based line where `old` should be."""

    old: list[str]
    new: list[str]
    hint: int | None = None


@dataclass
class Sketch:
    """Segments of new text separated by elided (unchanged) original code."""

    segments: list[list[str]]
    gap_before: bool  # a marker precedes the first segment
    gap_after: bool  # a marker follows the last segment
    marker_free: bool = False  # no marker at all: a whole file or a bare fragment
    # Blank lines trimmed off each segment's start and end where it touches a marker: the
    # merge may still use them as context (they are layout or context, nobody can tell).
    blank_edges: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class ParsedEdit:
    kind: str  # "sketch" | "search_replace" | "unified_diff" | "whole"
    sketch: Sketch | None = None
    blocks: list[Block] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    # Whether the result ends with a newline, when the edit says so (a diff's
    # `\ No newline at end of file`); None keeps the original's.
    final_newline: bool | None = None


def split_lines(text: str) -> tuple[list[str], str, bool]:
    """Lines without endings, the newline style, and whether the text ends with a newline.
    Only \\n and \\r\\n separate lines (str.splitlines would also split on form feeds)."""
    newline = "\r\n" if "\r\n" in text else "\n"
    body = text.replace("\r\n", "\n")
    final = body.endswith("\n")
    if final:
        body = body[:-1]
    return (body.split("\n") if body or not final else [""]), newline, final


def join_lines(lines: list[str], newline: str, final: bool) -> str:
    return newline.join(lines) + (newline if final and lines else "")


def is_marker(line: str) -> bool:
    """True for elision comments like `# ... existing code ...` or `// rest unchanged`."""
    text = line.strip()
    opened = False
    for opener in _OPENERS:
        if text.startswith(opener):
            text, opened = text[len(opener):].strip(), True
            break
    for closer in _CLOSERS:
        if text.endswith(closer):
            text = text[: -len(closer)].strip()
            break
    if len(text.split()) > 9:
        return False
    if _ELLIPSIS.search(text):
        if opened:
            return text.startswith(("...", "…")) or text.endswith(("...", "…"))
        # Uncommented, `...` is Python's Ellipsis (stub bodies, `def f(): ...`): only a line
        # that starts with it and has words ("... existing code ...") is a marker.
        return text.startswith(("...", "…")) and bool(_ELLIPSIS.sub("", text).strip())
    return opened and bool(_PHRASE.match(text))


def parse_edit(edit: str, original_lines: list[str]) -> ParsedEdit:
    lines, _, _ = split_lines(edit)
    lines = _strip_fence(lines)
    if any(_SEARCH.match(line) for line in lines):
        return _parse_search_replace(lines)
    if any(_HUNK.match(line) for line in lines):
        return _parse_unified_diff(lines)
    return _parse_sketch(lines, original_lines)


def _strip_fence(lines: list[str]) -> list[str]:
    """Drop one Markdown code fence wrapping the whole edit (chat models add them)."""
    start = next((i for i, line in enumerate(lines) if line.strip()), None)
    end = next((i for i in range(len(lines) - 1, -1, -1) if lines[i].strip()), None)
    if start is None or end is None or start == end:
        return lines
    if _FENCE.match(lines[start]) and lines[end].strip() in ("```", "~~~"):
        return lines[start + 1:end]
    return lines


def _parse_sketch(lines: list[str], original_lines: list[str]) -> ParsedEdit:
    literal = {line.strip() for line in original_lines}
    segments: list[list[str]] = [[]]
    markers = 0
    for line in lines:
        # A marker-like comment that exists verbatim in the original is real content.
        if is_marker(line) and line.strip() not in literal:
            markers += 1
            if segments[-1]:
                segments.append([])
        else:
            segments[-1].append(line)
    if not segments[-1]:
        segments.pop()
    first_content = next((i for i, line in enumerate(lines) if not _marker_at(lines, i, literal)),
                         len(lines))
    last_content = max((i for i in range(len(lines)) if not _marker_at(lines, i, literal)),
                       default=-1)
    gap_before = any(_marker_at(lines, i, literal) for i in range(first_content))
    gap_after = any(_marker_at(lines, i, literal) for i in range(last_content + 1, len(lines)))
    trimmed = [_trim_blank_edges(s, i == 0 and not gap_before,
                                 i == len(segments) - 1 and not gap_after)
               for i, s in enumerate(segments)]
    kept = [(t, s) for t, s in zip(trimmed, segments) if t]
    sketch = Sketch([t for t, _ in kept], gap_before, gap_after, marker_free=markers == 0,
                    blank_edges=[(_leading_blanks(s) - _leading_blanks(t),
                                  _leading_blanks(s[::-1]) - _leading_blanks(t[::-1]))
                                 for t, s in kept])
    return ParsedEdit("sketch" if markers else "whole", sketch=sketch)


def _leading_blanks(lines: list[str]) -> int:
    return next((i for i, line in enumerate(lines) if line.strip()), len(lines))


def _marker_at(lines: list[str], i: int, literal: set[str]) -> bool:
    return is_marker(lines[i]) and lines[i].strip() not in literal


def _trim_blank_edges(segment: list[str], keep_start: bool, keep_end: bool) -> list[str]:
    """Blank lines touching a marker belong to the elided code, not to the edit."""
    start, end = 0, len(segment)
    if not keep_start:
        while start < end and not segment[start].strip():
            start += 1
    if not keep_end:
        while end > start and not segment[end - 1].strip():
            end -= 1
    return segment[start:end]


def _parse_search_replace(lines: list[str]) -> ParsedEdit:
    parsed = ParsedEdit("search_replace")
    state, old, new = "outside", [], []
    for line in lines:  # file names and prose outside blocks are ignored
        if state == "outside" and _SEARCH.match(line):
            state, old, new = "search", [], []
        elif state == "search" and _DIVIDER.match(line):
            state = "replace"
        elif state == "replace" and _REPLACE.match(line):
            parsed.blocks.append(Block(old, new))
            state = "outside"
        elif state == "search":
            old.append(line)
        elif state == "replace":
            new.append(line)
    if state != "outside":
        parsed.problems.append(f"SEARCH/REPLACE block {len(parsed.blocks) + 1} is not closed "
                               "(missing ======= or >>>>>>> REPLACE)")
    return parsed


def _parse_unified_diff(lines: list[str]) -> ParsedEdit:
    parsed = ParsedEdit("unified_diff")
    block: Block | None = None
    previous = ""
    while lines and lines[-1] == "":
        lines = lines[:-1]
    for line in lines:
        header = _HUNK.match(line)
        if header:
            block = Block([], [], int(header.group(1)) - 1 if header.group(1) else None)
            parsed.blocks.append(block)
        elif block is None or line.startswith(("--- ", "+++ ", "diff ", "index ")):
            continue
        elif line.startswith("\\"):
            # "\ No newline at end of file" after the file's last line: of the new file
            # (after a "+" or context line) or only of the old one (after a "-" line).
            parsed.final_newline = previous.startswith("-")
        elif line.startswith("-"):
            block.old.append(line[1:])
        elif line.startswith("+"):
            block.new.append(line[1:])
        else:  # context; editors and models often strip the space of blank context lines
            text = line.removeprefix(" ")
            block.old.append(text)
            block.new.append(text)
        previous = line
    if not parsed.blocks:
        parsed.problems.append("unified diff has no hunks")
    return parsed
