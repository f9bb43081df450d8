"""Recognise what kind of edit a model returned and parse it into line blocks.

Four shapes occur in practice: a sketch with elision markers (`# ... existing code ...`),
Aider-style SEARCH/REPLACE blocks, a unified diff, or a whole new file. Everything is handled
as lists of lines without line endings; `split_lines`/`join_lines` keep the original file's
newline style and final newline exact.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

from codeplane.apply.align import indent_width

# Comment openers and closers of the common languages; a marker is a comment (or a bare
# "... words ...") whose text is an ellipsis plus a few words, or a "rest unchanged" phrase.
_OPENERS = ("{/*", "/*", "<!--", "//", "#", "--", ";", "%", "*")
_CLOSERS = ("*/}", "*/", "-->")
_ELLIPSIS = re.compile(r"(\.\.\.|…)")
# A marker without an ellipsis is a comment made only of these words, at least one of them
# saying "unchanged" (`# (unchanged)`, `// existing code here`, `# [previous implementation]`,
# `# rest of the function unchanged`); any other word makes it prose (`# TODO: the rest`).
_KEEP_WORDS = frozenset({
    "existing", "unchanged", "rest", "remaining", "previous", "omitted", "elided", "snip",
    "snipped", "original", "earlier", "prior", "unmodified", "untouched", "intact", "skipped",
})
_FILLER_WORDS = frozenset({
    "code", "the", "of", "function", "functions", "method", "methods", "class", "classes",
    "file", "module", "body", "implementation", "implementations", "here", "lines", "line",
    "imports", "import", "as", "before", "is", "are", "kept", "keep", "stays", "stay",
    "remains", "remain", "this", "that", "and", "other", "others", "a", "an", "in", "for",
    "to", "more", "logic", "fields", "properties", "attributes", "tests", "content",
    "contents", "definitions", "helpers", "block", "loop", "statements", "stuff", "goes",
    "same", "above", "below", "etc", "also", "everything", "all",
})
_WORD = re.compile(r"[a-z]+")
_BRACKETS = "()[]{}<>.,:;-–—*!"
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
    # Indentation width of the marker(s) before each segment and after the last (None: no
    # marker there). A marker indented deeper than the code next to it stands for the rest
    # of the block it is indented as (`merge._open_end`).
    marker_indents: list[int | None] = field(default_factory=list)

    def marker_indent(self, gap: int) -> int | None:
        return self.marker_indents[gap] if gap < len(self.marker_indents) else None


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
    """True for elision comments like `# ... existing code ...`, `// rest unchanged`,
    `# (unchanged)`, `<!-- existing code here -->`. A bare `...` is not one here (it is
    Python's Ellipsis in a stub): `_elides` decides it from the lines around it."""
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
    inner = text.strip(_BRACKETS + " ")
    if _ELLIPSIS.search(text):
        if opened:
            return text.startswith(("...", "…")) or text.endswith(("...", "…")) \
                or not _ELLIPSIS.sub("", inner).strip(_BRACKETS + " ") \
                or _elision_words(_ELLIPSIS.sub(" ", inner))
        # Uncommented, `...` is Python's Ellipsis (stub bodies, `def f(): ...`): only a line
        # that starts with it and has words ("... existing code ...") is a marker; words
        # that are one Python statement are a doctest's continuation line.
        return text.startswith(("...", "…")) and bool(_ELLIPSIS.sub("", text).strip()) \
            and not (text.startswith("... ") and _doctest_code(text[4:]))
    return opened and _elision_words(inner)


def _doctest_code(text: str) -> bool:
    """Whether the words after a doctest's `... ` are code: a statement that does something
    (`does_something`), a compound statement's header (`def bar(arg1):`, `for x in y:`)
    or a `return` of a computed value (`return arg1 * 2`); marker prose is none of these
    (voluptuous aa66c60644 in the fifth slice: `... def bar(arg1):` read as a marker)."""
    if does_something(text):
        return True
    try:
        body = ast.parse(text.strip() + "\n    pass").body
    except SyntaxError:
        try:
            body = ast.parse(text.strip()).body
        except SyntaxError:
            return False
        return len(body) == 1 and isinstance(body[0], ast.Return) \
            and isinstance(body[0].value, (ast.BinOp, ast.Call, ast.Attribute, ast.Subscript,
                                           ast.BoolOp, ast.Compare, ast.UnaryOp))
    return len(body) == 1 and isinstance(body[0], _COMPOUND)


_COMPOUND = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.For, ast.AsyncFor,
             ast.While, ast.If, ast.With, ast.AsyncWith, ast.Try)


def does_something(text: str) -> bool:
    """Whether `text` is one Python statement that does something (an assignment, an
    import, a call): code, which an elision marker's prose never is (`(the loop stays as it
    was)` does not parse, `(unchanged)` is a bare name)."""
    try:
        body = ast.parse(text.strip()).body
    except SyntaxError:
        return False
    return len(body) == 1 and (isinstance(body[0], _STATEMENTS) or isinstance(
        body[0], ast.Expr) and isinstance(body[0].value, ast.Call))


_STATEMENTS = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Import, ast.ImportFrom)


def _elision_words(text: str) -> bool:
    """Only "unchanged"-vocabulary words, at least one saying the code stays as it is."""
    words = _WORD.findall(text.lower())
    return bool(words) and len(words) <= 8 and any(w in _KEEP_WORDS for w in words) \
        and all(w in _KEEP_WORDS or w in _FILLER_WORDS for w in words) \
        and len(re.sub(r"[a-z\s" + re.escape(_BRACKETS) + r"'…]", "", text.lower())) == 0


def _elides(lines: list[str], i: int, literal: set[str]) -> bool:
    """Whether sketch line `i` is an elision marker. A marker-like comment that exists
    verbatim in the original is the file's own comment. A bare `...` is a marker unless the
    original has such a line, or it is the body of a `def`/`class` header the original does
    not have (a new stub: `def f(self): ...` written on two lines); under a header the file
    has it stands for that body, which must never be read as "body is `...`"."""
    line = lines[i]
    if line.strip() in literal:
        return False
    if is_marker(line):
        return True
    if line.strip() not in ("...", "…"):
        return False
    above = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), None)
    if above is not None and above.rstrip().endswith(":") \
            and indent_width(above) < indent_width(line):
        return above.strip() in literal
    return True


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
    for i, line in enumerate(lines):
        if _elides(lines, i, literal):
            markers += 1
            if segments[-1]:
                segments.append([])
        else:
            segments[-1].append(line)
    if not segments[-1]:
        segments.pop()
    first_content = next((i for i, line in enumerate(lines) if not _elides(lines, i, literal)),
                         len(lines))
    last_content = max((i for i in range(len(lines)) if not _elides(lines, i, literal)),
                       default=-1)
    gap_before = any(_elides(lines, i, literal) for i in range(first_content))
    gap_after = any(_elides(lines, i, literal) for i in range(last_content + 1, len(lines)))
    trimmed = [_trim_blank_edges(s, i == 0 and not gap_before,
                                 i == len(segments) - 1 and not gap_after)
               for i, s in enumerate(segments)]
    kept = [(t, s) for t, s in zip(trimmed, segments) if t]
    sketch = Sketch([t for t, _ in kept], gap_before, gap_after, marker_free=markers == 0,
                    blank_edges=[(_leading_blanks(s) - _leading_blanks(t),
                                  _leading_blanks(s[::-1]) - _leading_blanks(t[::-1]))
                                 for t, s in kept],
                    marker_indents=_marker_indents(lines, literal))
    return ParsedEdit("sketch" if markers else "whole", sketch=sketch)


def _marker_indents(lines: list[str], literal: set[str]) -> list[int | None]:
    """The deepest marker indentation in each gap between segments (see `Sketch`)."""
    indents: list[int | None] = [None]
    in_content = False
    for i, line in enumerate(lines):
        if _elides(lines, i, literal):
            if in_content:
                indents.append(None)
                in_content = False
            indents[-1] = max(indent_width(line), indents[-1] or 0)
        elif line.strip():
            in_content = True
    if in_content:
        indents.append(None)
    return indents


def _leading_blanks(lines: list[str]) -> int:
    return next((i for i, line in enumerate(lines) if line.strip()), len(lines))


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
