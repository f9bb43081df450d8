"""Whitespace drift in a sketch's context, and the wrong-merge guard.

Models copy context back with its whitespace changed: trailing spaces dropped, blank lines
collapsed or added, a bracketed multi-line call joined onto one line. The rule a careful
reader follows: context is matched modulo whitespace and keeps the file's bytes; only the
edit's new lines are new. `unjoin` puts a joined statement back into the file's lines
before the alignment runs (the alignment is line-based). `check` runs on every sketch merge
before it may be called ok: any original line the merge removes or rewrites must be shown
removed or rewritten by the sketch itself, i.e. sit between two lines the sketch shows next
to each other in one segment, with only new lines between them. Anything else (an elision
marker read as code, a segment reaching over code it does not show) declines with the
reason. `restore_layout` runs after it: a difference from the file that is only layout
(blank lines, whitespace within lines) and touches no line the edit changes goes back to
the file's bytes.
"""

from __future__ import annotations

import difflib
import itertools
import re
from collections import Counter
from typing import NamedTuple

from codeplane.apply.align import (
    DEFINES,
    SUB_MIN_SIMILARITY,
    indent_width,
    norm,
    token_similarity,
    trivial,
)
from codeplane.apply.formats import Sketch, does_something

MAX_JOINED = 8  # lines of one bracketed statement a model may join onto one line
# Code replaced by one comment this short reads as an elision marker no recogniser knew
# (`# (the loop stays as it was)`); a real commit's comment says more (click bc32a92cd2:
# "# The wrapper must not close a stream it does not own.").
MARKERISH_WORDS = 7
_TRAILING_COMMA = re.compile(r",(?=[)\]}])")
# A line that is only a comment, an ellipsis or `pass`: what an elision marker the
# recogniser missed looks like once it is read as code.
_COMMENT_ONLY = re.compile(r"^\s*(#|//|/\*|\*|<!--|--|;|\.\.\.|…|pass\s*$)")


def squash(text: str) -> str:
    """Tokens without whitespace, and without a trailing comma before a closing bracket
    (`f(\\n a,\\n)` joined reads `f(a)`)."""
    return _TRAILING_COMMA.sub("", "".join(text.split()))


def unjoin(original: list[str], sketch: Sketch) -> tuple[Sketch, int]:
    """The sketch with every line that is a joined copy of consecutive original lines (one
    statement spread over 2..MAX_JOINED lines, matched through its tokens) replaced by those
    lines, and how many were replaced. Only when every place it matches has the same text
    (placement is the alignment's job), and never for a line the file has as it is."""
    known = {norm(line) for line in original}
    keys = [squash(line) for line in original]
    segments, count = [], 0
    for segment in sketch.segments:
        out: list[str] = []
        for line in segment:
            spans = [] if not line.strip() or norm(line) in known else _spans(keys, squash(line))
            texts = {tuple(original[a:b]) for a, b in spans}
            if len(texts) == 1:
                out.extend(texts.pop())
                count += 1
            else:
                out.append(line)
        segments.append(out)
    return Sketch(segments, sketch.gap_before, sketch.gap_after, sketch.marker_free,
                  sketch.blank_edges, sketch.marker_indents), count


def _spans(keys: list[str], target: str) -> list[tuple[int, int]]:
    """Runs of 2..MAX_JOINED original lines whose squashed text is `target`."""
    found = []
    for start, key in enumerate(keys):
        if not key or key == target or not target.startswith(key.rstrip(",")):
            continue
        text, end = key, start + 1
        while end < len(keys) and end - start < MAX_JOINED:
            text += keys[end]
            end += 1
            joined = _TRAILING_COMMA.sub("", text)
            if joined == target and _one_bracketed_statement(keys[start:end]):
                found.append((start, end))
                break
            if not target.startswith(joined.rstrip(",")):
                break
    return found


_STRING = re.compile(r"\"(?:[^\"\\\\]|\\\\.)*\"|'(?:[^'\\\\]|\\\\.)*'")
_DEPTH = {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}


def _one_bracketed_statement(keys: list[str]) -> bool:
    """The lines are one statement held together by brackets: open after every line but
    the last, balanced after the last (not two statements, nor part of a larger one)."""
    depth = 0
    for k, key in enumerate(keys):
        depth += sum(_DEPTH.get(ch, 0) for ch in _STRING.sub("", key))
        if depth < 0 or (depth == 0) != (k == len(keys) - 1):
            return False
    return True


def check(original: list[str], sketch: Sketch, merged: list[str]) -> str | None:
    """Why the merge is not safe to call ok, or None: every original line with code on it
    that the merge removes or rewrites must be shown so by the sketch (see the module)."""
    shown = [[norm(line) for line in segment if line.strip()] for segment in sketch.segments]
    twice = _defined_twice(original, merged, shown)
    if twice:
        return twice
    old = [norm(line) for line in original]
    new = [norm(line) for line in merged]
    opcodes = opcodes_between(old, new)
    problem = _torn_context(old, new, shown, opcodes) or _kept_between(new, shown)
    if problem:
        return problem
    for tag, i1, i2, j1, j2 in opcodes:
        removed = [line for line in old[i1:i2] if line]
        if tag == "equal" or not removed:
            continue
        added = [line for line in new[j1:j2] if line]
        code = [line for line in removed if not _COMMENT_ONLY.match(line)]
        if len(added) == 1 and _COMMENT_ONLY.match(added[0]) and len(code) > 1 \
                and (len(added[0].split()) <= MARKERISH_WORDS or "..." in added[0]) \
                and not _commented_out(added[0]):
            return (f"it replaces {len(code)} lines of code from line {i1 + 1} "
                    f"({removed[0][:60]!r}) by only {added[0][:60]!r}: an elision marker "
                    f"read as code?")
        if _rewritten(removed, added) and any(_shows(segment, None, added, None, anywhere=True)
                                              for segment in shown):
            continue  # each line edited in place, as the sketch shows it
        for at in _deletion_points(old, i1, i2, j1) if not added else [j1]:
            before = next((new[j] for j in range(at - 1, -1, -1) if new[j]), None)
            after = next((new[j] for j in range(at + j2 - j1, len(new)) if new[j]), None)
            if not any(_shows(segment, before, added, after) for segment in shown):
                return (f"it removes or rewrites line {i1 + 1} ({removed[0][:60]!r}), which "
                        f"the sketch does not show as deleted or changed")
    return None


def opcodes_between(old: list[str], new: list[str]) -> list[tuple[str, int, int, int, int]]:
    """difflib's opcodes from `old` to `new` (no junk), the very same, found faster where
    lines repeat (see `_Matcher`)."""
    return _Matcher(old, new).get_opcodes()


class _Matcher(difflib.SequenceMatcher):
    """`SequenceMatcher(None, a, b, autojunk=False)` with the same longest-match answers,
    found in linear time where difflib's search is slow: it steps through every copy in
    `b` of every line of `a`, so a long file's hundreds of blank lines cost hundreds of
    thousands of steps per search, and the wrong-merge guard's diff was 23 % of apply time
    (docs/apply.md, "Session apply9"). A suffix automaton of `b`'s range gives, for each
    line of `a`, the longest match ending there and the first place in `b` it ends, which
    is difflib's tie-break (the match ending first in `a`, then in `b`). Where lines
    repeat little difflib's own search is cheaper and is used."""

    def __init__(self, a: list[str], b: list[str]) -> None:
        super().__init__(None, a, b, autojunk=False)

    def find_longest_match(self, alo: int = 0, ahi: int | None = None, blo: int = 0,
                           bhi: int | None = None) -> difflib.Match:
        ahi = len(self.a) if ahi is None else ahi
        bhi = len(self.b) if bhi is None else bhi
        counts = Counter(self.b[blo:bhi])
        steps = sum(counts[line] for line in self.a[alo:ahi])
        if steps <= _AUTOMATON_STEPS * (ahi - alo + bhi - blo):
            return super().find_longest_match(alo, ahi, blo, bhi)
        nxt, link, length, first = _automaton(self.b[blo:bhi])
        best = difflib.Match(alo, blo, 0)
        state = size = 0
        for i in range(alo, ahi):
            line = self.a[i]
            while state and line not in nxt[state]:
                state = link[state]
                size = length[state]
            if line in nxt[state]:
                state, size = nxt[state][line], size + 1
            if size > best.size:
                end = blo + first[state]
                best = difflib.Match(i - size + 1, end - size + 1, size)
        return best


# Below this many steps of difflib's own search per line of the two ranges, it is cheaper
# than building an automaton (a few dictionary operations per line of `b`).
_AUTOMATON_STEPS = 8


def _automaton(seq: list[str]) -> tuple[list[dict[str, int]], list[int], list[int], list[int]]:
    """The suffix automaton of `seq`: per state its transitions, suffix link, longest
    length, and the first position in `seq` where its strings end."""
    nxt: list[dict[str, int]] = [{}]
    link, length, first = [-1], [0], [-1]
    last = 0
    for pos, item in enumerate(seq):
        cur = len(length)
        nxt.append({})
        link.append(0)
        length.append(length[last] + 1)
        first.append(pos)
        p = last
        while p != -1 and item not in nxt[p]:
            nxt[p][item] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][item]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = len(length)
                nxt.append(dict(nxt[q]))
                link.append(link[q])
                length.append(length[p] + 1)
                first.append(first[q])
                while p != -1 and nxt[p].get(item) == q:
                    nxt[p][item] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        last = cur
    return nxt, link, length, first


def _commented_out(line: str) -> bool:
    """A `#` comment whose text is one statement that does something: code the edit
    comments out, not a marker's prose (funcy 8dad95cfee in `fourth`: two settings replaced
    by `# html_style = 'overrides.css'`)."""
    return line.startswith("#") and does_something(line.lstrip("#"))


def _torn_context(old: list[str], new: list[str], shown: list[list[str]],
                  opcodes: list[tuple[str, int, int, int, int]]) -> str | None:
    """A line the sketch shows once, which the file and the merge each have once, next to
    the line that is its neighbour in the file, is context there: the merge may not keep
    the pair with another copy of that neighbour. Read by difflib, a merge can rewrite the
    file's copy of the line into a new one and write the sketch's copy next to a later
    copy of its neighbour, each step an edit the sketch shows (pyjwt 300348f7bc as the
    model path wrote it: a new test like the one after it, spliced over that test's body;
    its closing context, `def test_get_jwk_set` and `url = ...`, then stood where the next
    test's `def` was, before that test's `url = ...`), while the file's `url = ...` after
    it was kept as the new test's. Where the file's neighbour is deleted, the pair is the
    file's with a deletion slid along repeated lines (read as such by `check`); a block
    moved whole keeps its own neighbours."""
    paired = {j: i for tag, i1, i2, j1, _ in opcodes if tag == "equal"
              for i, j in zip(range(i1, i2), range(j1, j1 + i2 - i1))}
    kept = set(paired.values())
    shown_count = Counter(line for segment in shown for line in segment)
    in_old, in_new = Counter(old), Counter(new)
    where = {line: i for i, line in enumerate(old)}
    for j, line in enumerate(new):
        if not line or shown_count[line] != 1 or in_old[line] != 1 or in_new[line] != 1 \
                or trivial(line):
            continue
        i = where[line]
        for step in (-1, 1):
            mine = _neighbour(new, j, step)
            theirs = _neighbour(old, i, step)
            if mine is None or theirs is None or new[mine] != old[theirs] \
                    or paired.get(mine, theirs) == theirs or theirs not in kept:
                continue  # the file's pair, or its neighbour deleted (a deletion slid)
            if any(_shows(segment, *((new[mine], [line], None) if step < 0 else
                                     (None, [line], new[mine])), anywhere=True)
                   for segment in shown):
                return (f"it writes line {i + 1} ({line[:60]!r}), which the sketch shows "
                        f"as context next to {new[mine][:40]!r}, next to another copy of "
                        f"that line (line {paired[mine] + 1}), and keeps the file's copy "
                        f"(line {theirs + 1}) elsewhere")
    return None


def _kept_between(new: list[str], shown: list[list[str]]) -> str | None:
    """Two lines a segment shows one after the other (blank lines aside), each of which the
    merge has once, are one after the other in the merge too: a segment is a stretch of
    the result. The other checks look at what a merge removes; this one at what it keeps
    where the sketch shows nothing (bidict c1e297c824 in `fifth`, the model path: a block
    moved above a comment, its old copy kept between the comment and the next block, which
    the sketch shows together)."""
    count = Counter(new)
    at = {line: j for j, line in enumerate(new)}
    for segment in shown:
        for first, second in itertools.pairwise(segment):
            if count[first] == count[second] == 1 \
                    and _neighbour(new, at[first], 1) != at[second]:
                return (f"the sketch shows {first[:50]!r} and {second[:50]!r} together, but "
                        f"the merge has other code between them or not in that order")
    return None


def moved_and_kept(original: list[str], sketch: Sketch, merged: list[str]) -> str | None:
    """Why a merge the model path wrote keeps a line the sketch may move, or None. A
    segment opens on a line the file has once, right after another line the file has
    once, and shows that other line once, further down, next to a third line the file has
    once (not trivial ones): the sketch moves the line there, or copies it, and cannot say
    which (the file's copy is behind the marker). A merge that keeps the file's pair and
    writes the sketch's copy as well took the copy; read by difflib nothing is removed
    and the line is just twice in the merge, which `check` lets through (bidict
    c1e297c824 in `fifth`, the model's answer: a comment moved below a block, kept above
    it too). The mirror image at a segment's end likewise. Only for the model path: the
    alignment takes the copy where it finds one reading, and commits do copy (tenacity
    3aacb41738 and marshmallow cfb3ac4994 in `third`, a comment repeated above new
    imports: the commit's own file declines here in 6 of the 3,081 wild sketches,
    docs/apply.md); the model path runs where the merge found the sketch ambiguous, and
    none of those 6 is such a case."""
    old = [norm(line) for line in original]
    new = [norm(line) for line in merged]
    shown = [[norm(line) for line in segment if line.strip()] for segment in sketch.segments]
    in_old, in_new = Counter(old), Counter(new)
    shown_count = Counter(line for segment in shown for line in segment)
    where = {line: i for i, line in enumerate(old)}
    for segment in shown:
        for edge, step in ((segment[0], -1), (segment[-1], 1)):
            if in_old[edge] != 1 or in_new[edge] != 1:
                continue
            pair = _neighbour(old, where[edge], step)
            line = old[pair] if pair is not None else ""
            inside = segment[1:] if step < 0 else segment[:-1]
            if not line or trivial(line) or in_old[line] != 1 or shown_count[line] != 1 \
                    or line not in inside or in_new[line] < 2:
                continue
            k = segment.index(line)
            beside = {segment[k + d] for d in (-1, 1) if 0 <= k + d < len(segment)} - {edge}
            if not any(in_old[other] == 1 and not trivial(other) for other in beside):
                continue  # a new copy among new lines (a function ending like the one above)
            kept = _neighbour(new, new.index(edge), step)
            if kept is not None and new[kept] == line:
                return (f"it keeps {line[:60]!r} next to {edge[:40]!r}, where the file has "
                        f"it, and writes the sketch's copy as well: the sketch may move that "
                        f"line, the merge has it twice")
    return None


def _neighbour(lines: list[str], at: int, step: int) -> int | None:
    """The nearest line with code before (`step` -1) or after (+1) `at`."""
    k = at + step
    while 0 <= k < len(lines) and not lines[k]:
        k += step
    return k if 0 <= k < len(lines) else None


def _deletion_points(old: list[str], i1: int, i2: int, j1: int) -> list[int]:
    """Where in the merge a deletion of old[i1:i2] may be read, the same file either way:
    it slides along lines it repeats (deleting `url = ...` up to the next test's `url =
    ...` reads as deleting from right after the first). The sketch shows a deletion only
    if it shows it at each: read at one point it lies between two lines the sketch shows
    together, at another next to a marker, deleting code the marker stands for (the model
    path's wrong merges, pyjwt 300348f7bc)."""
    points = [j1]
    k = 0
    while i2 + k < len(old) and old[i1 + k] == old[i2 + k]:
        k += 1
        points.append(j1 + k)
    k = 0
    while i1 - k - 1 >= 0 and old[i1 - k - 1] == old[i2 - k - 1]:
        k += 1
        points.append(j1 - k)
    return points


def _defined_twice(original: list[str], merged: list[str], shown: list[list[str]]
                   ) -> str | None:
    """A definition line (`def name(...)`, `class Name`) that the merge has twice in one
    scope where the file has it once, while the sketch shows it once: the sketch's copy is
    the file's line as context, and the alignment took it as new (keeping the code it
    meant to delete: pyjwt 0bf1a35ac1, two tests deleted between context lines, read as
    a new copy of the test after them)."""
    before = _definitions(original)
    shown_count = Counter(line for segment in shown for line in segment)
    for key, times in _definitions(merged).items():
        had = before.get(key, 0)
        # Adding a copy next to the file's, the sketch would show both: the context and
        # the new one.
        if had and times > had and shown_count[key[1]] <= times - had:
            return (f"it would define {key[1][:60]!r} {times} times in one scope, where the "
                    f"file has it {had} time(s) and the sketch shows it "
                    f"{shown_count[key[1]]} time(s): context or a new copy? ambiguous")
    return None


def _definitions(lines: list[str]) -> dict[tuple[tuple[str, ...], str], int]:
    """(enclosing definition lines, outermost first; definition line) -> how often,
    whitespace collapsed. The whole chain: a method of a class of the same name in another
    function is in another scope."""
    out: dict[tuple[tuple[str, ...], str], int] = {}
    stack: list[tuple[int, str]] = []  # open definitions: (indentation, line)
    for line in lines:
        if not line.strip():
            continue
        width = indent_width(line)
        while stack and stack[-1][0] >= width:
            stack.pop()
        if DEFINES.match(line.strip()):
            key = (tuple(text for _, text in stack), norm(line))
            out[key] = out.get(key, 0) + 1
            stack.append((width, norm(line)))
    return out


def _rewritten(removed: list[str], added: list[str]) -> bool:
    """Each removed line has an edited version among the added lines, in order (a line
    rewritten, possibly with lines added around it, as the sketch shows it)."""
    at = 0
    for line in removed:
        at = next((k + 1 for k in range(at, len(added))
                   if token_similarity(line, added[k]) >= SUB_MIN_SIMILARITY), -1)
        if at < 0:
            return False
    return True


def _shows(segment: list[str], before: str | None, added: list[str], after: str | None,
           anywhere: bool = False) -> bool:
    """The segment has `before`, then exactly the `added` lines, then `after` (None: the
    file's start or end, which the segment must reach, unless `anywhere`)."""
    want = ([before] if before is not None else []) + added + \
        ([after] if after is not None else [])
    if not want:
        return True
    if not anywhere and before is None and segment[:len(want)] != want:
        return False
    if not anywhere and after is None and segment[len(segment) - len(want):] != want:
        return False
    size = len(want)
    return any(segment[k:k + size] == want for k in range(len(segment) - size + 1))


class Layout(NamedTuple):
    """What `restore_layout` made of a merge: its lines, how many layout-only stretches
    went back to the file's, and why it declines (None: it does not)."""

    lines: list[str]
    restored: int
    ambiguous: str | None = None


def restore_layout(original: list[str], merged: list[str]) -> Layout:
    """`merged` with its layout-only differences from the file put back to the file's
    lines, where they touch no line the edit changes, and how many stretches were: blank
    lines between two unchanged lines of code that are neighbours in the file, whitespace
    within an unchanged line, a statement joined or split. Blank lines next to a changed
    line are the change's; a re-indented line is a change (a block wrapped or unwrapped).
    When the merge changes nothing but layout, that layout is the edit (a commit that
    strips trailing whitespace) and nothing is restored. Lines with code are compared
    first, without their whitespace, and blank lines after, between them: compared as
    lines, a blank line the sketch moved pairs with the wrong one. A line the edit repeats
    next to its change can pair with the file's line as its first copy or as its last, and
    the blank lines around it are context in one reading and the new code's in the other:
    when this reading gives back layout the other does not, the merge is declined
    (`ambiguous`), since commits go either way (tenacity d2bb0f06f6 and pluggy e7baa82cc1
    in docs/apply.md). Layout only the other reading would give back is left as the
    sketch has it, as where no line repeats (funcy c0292117cd: a new function ending like
    the one above it, its own blank lines read as the file's by the other reading)."""
    code_o = [i for i, line in enumerate(original) if line.strip()]
    code_m = [j for j, line in enumerate(merged) if line.strip()]
    keys_o = ["".join(original[i].split()) for i in code_o]
    keys_m = ["".join(merged[j].split()) for j in code_m]
    ops = opcodes_between(keys_o, keys_m)
    spans: list[tuple[int, int, int, int]] = []  # joined or split: merged -> original lines
    for op in ops:
        if _rewrapped(op, keys_o, keys_m):
            _, a1, a2, b1, b2 = op
            spans.append((code_m[b1], code_m[b2 - 1] + 1, code_o[a1], code_o[a2 - 1] + 1))
    changed = any(op[0] != "equal" and not _rewrapped(op, keys_o, keys_m) for op in ops)
    matched = [(a1 + t, b1 + t) for tag, a1, a2, b1, b2 in ops if tag == "equal"
               for t in range(a2 - a1)]
    pairs = _pairs(original, merged, code_o, code_m, matched)
    if not changed and len(pairs) == len(matched):  # nothing but layout, nothing re-indented
        return Layout(merged, 0)
    lines, restored = _relaid(original, merged, pairs, spans)
    for step in (1, -1):
        other = _slid(ops, keys_o, keys_m, matched, step)
        if other is not None and set(restored) - set(_relaid(original, merged, _pairs(
                original, merged, code_o, code_m, other), spans)[1]):
            return Layout(merged, 0, _why_ambiguous(merged, code_m, set(matched) ^ set(other)))
    return Layout(lines, len(restored))


def _rewrapped(op: tuple[str, int, int, int, int], keys_o: list[str], keys_m: list[str]
               ) -> bool:
    """The opcode replaces lines of code by the same statement joined or split (a trailing
    comma before a closing bracket aside): layout, not a change."""
    tag, a1, a2, b1, b2 = op
    return tag == "replace" and \
        squash("".join(keys_o[a1:a2])) == squash("".join(keys_m[b1:b2]))


def _pairs(original: list[str], merged: list[str], code_o: list[int], code_m: list[int],
           matched: list[tuple[int, int]]) -> dict[int, int]:
    """Merged line -> original line, for matched lines of code (indices into `code_o`,
    `code_m`) that are unchanged but for layout: a re-indented line is a change."""
    return {code_m[b]: code_o[a] for a, b in matched
            if indent_width(original[code_o[a]]) == indent_width(merged[code_m[b]])}


def _slid(ops: list[tuple[str, int, int, int, int]], keys_o: list[str], keys_m: list[str],
          matched: list[tuple[int, int]], step: int) -> list[tuple[int, int]] | None:
    """The matched code lines with every change moved as far forward (`step` 1) or back
    (-1) into the unchanged lines next to it as repeated lines allow (a change that starts
    with a copy of the line after it reads as well one line later), or None when none can
    move. Lines joined or split are not a change and do not move."""
    removed: set[tuple[int, int]] = set()
    added: set[tuple[int, int]] = set()
    for k, (tag, a1, a2, b1, b2) in enumerate(ops):
        near = ops[k + step] if 0 <= k + step < len(ops) else None
        if tag == "equal" or near is None or near[0] != "equal" \
                or _rewrapped((tag, a1, a2, b1, b2), keys_o, keys_m):
            continue
        for t in range(near[2] - near[1]):
            at_o, at_m = (a1 + t, b1 + t) if step == 1 else (a1 - 1 - t, b1 - 1 - t)
            to_o, to_m = (a2 + t, b2 + t) if step == 1 else (a2 - 1 - t, b2 - 1 - t)
            if a1 < a2 and keys_o[at_o] != keys_o[to_o] or \
                    b1 < b2 and keys_m[at_m] != keys_m[to_m]:
                break
            # Forward, the unchanged line after the change pairs with the change's first
            # line instead; back, the line before it with the change's last.
            removed.add((to_o, to_m) if step == 1 else (at_o, at_m))
            added.add((at_o, at_m) if step == 1 else (to_o, to_m))
    if not removed:
        return None
    return sorted(set(matched) - removed | added)


def _why_ambiguous(merged: list[str], code_m: list[int], moved: set[tuple[int, int]]) -> str:
    """The decline's reason, naming the repeated line."""
    line = merged[code_m[min(b for _, b in moved)]].strip()
    return (f"the line {line[:60]!r} repeats next to the edit's change and pairs with the "
            f"file's in two equally good places; the blank lines around it are context in "
            f"one reading and the new code's in the other: declined rather than choose")


def _relaid(original: list[str], merged: list[str], pairs: dict[int, int],
            spans: list[tuple[int, int, int, int]]
            ) -> tuple[list[str], list[tuple[int, tuple[str, ...]]]]:
    """The merge rebuilt with the file's bytes for `pairs` and `spans` (see
    `restore_layout`), and the file's blank lines between two paired lines that are
    neighbours in the file; with what it gave back: (merged line, the file's lines put
    there or just before it)."""
    out: list[str] = []
    restored: list[tuple[int, tuple[str, ...]]] = []
    starts = {span[0]: span for span in spans}
    held: list[str] = []  # blank lines since the last line with code
    last: int | None = -1  # the original line the last code line pairs with (-1: the start)
    j = 0
    while j < len(merged):
        line = merged[j]
        if not line.strip():
            held.append(line)
            j += 1
            continue
        o = pairs.get(j)
        if last is not None and o is not None and o > last \
                and not any(x.strip() for x in original[last + 1:o]) \
                and held != original[last + 1:o]:
            held = original[last + 1:o]
            restored.append((j, tuple(held)))
        if j in starts:
            _, end, o1, o2 = starts[j]
            out += held + original[o1:o2]
            restored.append((j, tuple(original[o1:o2])))
            held, last, j = [], o2 - 1, end
            continue
        if o is not None and line != original[o]:
            line = original[o]
            restored.append((j, (line,)))
        out += held + [line]
        held, last, j = [], o, j + 1
    return out + held, restored
