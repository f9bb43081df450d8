"""Turn a raw FIM continuation into something worth showing as ghost text.

Why this exists: the small instruct model rarely emits an end token after filling the hole; it
keeps writing the code that already follows the cursor. So the suggestion is cut at a sensible
boundary here: the end of the line (single-line mode), the end of the block (multi-line mode),
the point where it starts repeating the suffix, or a closing bracket nothing opened.
"""

from __future__ import annotations

from dataclasses import dataclass

OPENERS = {"(": ")", "[": "]", "{": "}"}
CLOSERS = {v: k for k, v in OPENERS.items()}
# Characters right of the cursor that still allow a suggestion in the middle of a line
# (editors auto-insert these, so "foo(|)" is really the end of the line).
AUTO_CLOSED = set(")]}\"'`;:, \t")
BLOCK_OPENERS = (":", "{", "(", "[")


@dataclass(frozen=True)
class Mode:
    multiline: bool
    max_lines: int


def line_suffix(suffix: str) -> str:
    return suffix.split("\n", 1)[0]


def mid_line_blocked(suffix: str, limit: int = 8) -> bool:
    """llama.vim's `max_line_suffix`: real code right of the cursor means the user is editing,
    not writing; a suggestion there is almost always noise, so skip the model entirely."""
    rest = line_suffix(suffix)
    return len(rest) > limit or any(c not in AUTO_CLOSED for c in rest)


def choose_mode(prefix: str, suffix: str, max_lines: int = 6) -> Mode:
    """Multi-line only where a block body starts (right after `def f():`, `{`, ...);
    elsewhere finish the current line: a block costs many times a line's decoding and is more
    often wrong."""
    lines = prefix.split("\n")
    current = lines[-1]
    if line_suffix(suffix).strip():
        return Mode(False, 1)
    previous = lines[-2].rstrip() if len(lines) > 1 and not current.strip() else ""
    if current.rstrip().endswith(BLOCK_OPENERS) or previous.endswith(BLOCK_OPENERS):
        return Mode(True, max_lines)
    return Mode(False, 1)


def clean(raw: str, prefix: str, suffix: str, mode: Mode) -> str:
    """Cut `raw` to what should be shown; "" when nothing useful remains."""
    text = _no_double_space(raw.replace("\r\n", "\n"), prefix)
    text = _cut_lines(text, prefix, mode)
    text = _cut_suffix_repeat(text, suffix)
    text = _cut_unbalanced(text, prefix)
    text = _cut_suffix_overlap(text, line_suffix(suffix))
    text = "\n".join(line.rstrip() for line in text.split("\n")).rstrip()
    return text if text.strip() else ""


def _no_double_space(text: str, prefix: str) -> str:
    """After code and a space (`x = |`) a leading blank would duplicate the one left of the
    cursor. Indentation (a line that is blank so far) is left alone: deeper is legitimate."""
    current = prefix.rsplit("\n", 1)[-1]
    if current.strip() and current[-1:] in (" ", "\t"):
        return text.lstrip(" \t")
    return text


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def _cut_lines(text: str, prefix: str, mode: Mode) -> str:
    """Single-line: the rest of the line. Multi-line: the block being written - it ends at a
    blank line, a line indented less than where it started, or (after a block opener such
    as `def f():`) a line not indented more than the opener."""
    lines = text.split("\n")
    if not mode.multiline:
        return lines[0]
    current = prefix.rsplit("\n", 1)[-1]
    opener = current.rstrip().endswith(BLOCK_OPENERS)
    first = current + lines[0]
    base = _indent(current) if opener or not first.strip() else _indent(first)
    kept: list[str] = [lines[0]]
    for line in lines[1:]:
        if not line.strip():
            if any(k.strip() for k in kept):
                break
            continue  # leading newline(s): the block starts on the next line
        if _indent(line) < base or (opener and _indent(line) <= base):
            break
        if sum(1 for k in kept if k.strip()) >= mode.max_lines:
            break
        kept.append(line)
    return "\n".join(kept)


def complete_lines_done(text: str, prefix: str, mode: Mode) -> bool:
    """True once the finished lines of a streaming suggestion already run past the cut, so
    decoding can stop early (every generated token costs a decoding step)."""
    done = text[: max(text.rfind("\n"), 0)]  # finished lines, without the open one
    if not mode.multiline or not done:
        return False
    return _cut_lines(done, prefix, mode).count("\n") < done.count("\n")


def _cut_suffix_repeat(text: str, suffix: str) -> str:
    """Stop where the suggestion starts re-writing the next existing non-empty line."""
    following = [ln.strip() for ln in suffix.split("\n")[1:] if ln.strip()][:1]
    if not following or len(following[0]) < 4:
        return text
    lines = text.split("\n")
    for i, line in enumerate(lines[1:], start=1):
        if line.strip() == following[0]:
            return "\n".join(lines[:i])
    return text


def _scan(text: str, quote: str = ""):
    """(index, char, the quote open after it) for each character, starting inside `quote`
    ("" outside a string literal); a quote ends at its match or the end of the line -
    rough, but enough to keep ')' from being invented."""
    for i, ch in enumerate(text):
        if quote:
            if ch == quote or ch == "\n":
                quote = ""
        elif ch in "\"'":
            quote = ch
        yield i, ch, quote


def _brackets(text: str, quote: str = ""):
    """(index, char) of each bracket outside string literals."""
    for i, ch, inside in _scan(text, quote):
        if not inside and (ch in OPENERS or ch in CLOSERS):
            yield i, ch


def open_quote(prefix: str) -> str:
    """The quote still open at the cursor ("" outside a string literal). A suggestion
    starts inside it: the `}` of `f'... {se|` + `lf.x}')` closes nothing the code opened, and
    a cut there as unbalanced lost the suggestion's ending (docs/tab.md, "Session 9")."""
    quote = ""
    for _, _, quote in _scan(prefix.rsplit("\n", 1)[-1]):
        pass
    return quote


def open_brackets(prefix: str) -> list[str]:
    """Brackets still open at the cursor, looking back over the last few lines."""
    stack: list[str] = []
    for _, ch in _brackets("\n".join(prefix.split("\n")[-8:])):
        if ch in OPENERS:
            stack.append(ch)
        elif stack and stack[-1] == CLOSERS[ch]:
            stack.pop()
        else:
            stack.clear()  # closes something older than the window: start over
    return stack


def _closers(text: str, stack: list[str], quote: str = ""):
    """(index, matched) of each closing bracket of `text`, walking it on top of the open
    brackets `stack` (updated in place: a matched closer pops, an opener pushes) from
    inside `quote`."""
    for i, ch in _brackets(text, quote):
        if ch in OPENERS:
            stack.append(ch)
        elif stack and stack[-1] == CLOSERS[ch]:
            stack.pop()
            yield i, True
        else:
            yield i, False


def _cut_unbalanced(text: str, prefix: str) -> str:
    """Cut before the first closing bracket that neither the suggestion nor the open
    statement in the prefix opened (the classic duplicated ')' of Tab completions)."""
    for i, matched in _closers(text, open_brackets(prefix), open_quote(prefix)):
        if not matched:
            return text[:i]
    return text


def closes_open(text: str, opened: list[str], quote: str = "") -> bool:
    """True if `text` (starting inside `quote`, from `open_quote`) closes one of the
    brackets `opened` (from `open_brackets`): a suggestion that finishes the statement in
    progress (a show/hide signal)."""
    stack = list(opened)
    return any(matched and len(stack) < len(opened)
               for _, matched in _closers(text, stack, quote))


def _cut_suffix_overlap(text: str, rest_of_line: str) -> str:
    """Drop a tail the editor already has right of the cursor (e.g. the auto-inserted ')')."""
    rest = rest_of_line.rstrip()
    first, sep, more = text.partition("\n")
    for size in range(min(len(rest), len(first)), 0, -1):
        if first.endswith(rest[:size]) and rest[:size].strip():
            return first[: len(first) - size] + sep + more
    return text
