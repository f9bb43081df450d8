"""Deterministic merge: align an edit to the original file and splice it in, or say why not.

Sketches go through the global alignment in `align.py`; a segment that anchors on nothing
distinctive, or fits elsewhere equally well, declines the merge instead of guessing.
SEARCH/REPLACE blocks and diff hunks are located exactly, then with whitespace collapsed,
then without blank edge lines; a block that matches several places declines (diff hunks use
their stated line numbers to choose, tolerating drift).
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from codeplane.apply.align import (
    DELETE_EXTEND,
    INF,
    INSERT_EDGE,
    SUB_BASE,
    SUB_MIN_SIMILARITY,
    SUB_SCALE,
    Aligner,
    Alignment,
    indent_width,
    norm,
    token_similarity,
    trivial,
)
from codeplane.apply.formats import Block, ParsedEdit, Sketch
from codeplane.apply.guard import check, moved_and_kept, restore_layout, unjoin

# A line a segment rewrites right before its new lines, with no context after them, must be
# at least this similar to the file's (token_similarity; the aligner itself takes 0.5).
OPEN_SUB_MIN = 0.7
SUB_WEAKEST = int(SUB_BASE + SUB_SCALE * (1 - SUB_MIN_SIMILARITY))  # an edit's highest cost


@dataclass
class MergeOutcome:
    merged: list[str] | None
    reasons: list[str] = field(default_factory=list)  # why it declined
    notes: list[str] = field(default_factory=list)  # assumptions made while merging
    # A tie declined: the two complete files it stands between, each passing every other
    # check (the caller may let a model pick one: `rank.py`). Empty for other declines.
    readings: list[list[str]] = field(default_factory=list)


@dataclass
class _Tie:
    """A segment that fits another place about as well: the decline, and that other place."""

    reason: str
    number: int
    rival: Alignment


Breaks = Callable[[list[str]], bool]  # whether a merged file fails to parse (the original did)


def merge(original: list[str], parsed: ParsedEdit, breaks: Breaks | None = None
          ) -> MergeOutcome:
    """`breaks`, when the caller can parse the file's language, lets a sketch's declined
    reading that breaks the syntax give way to the one other reading (`_merge_sketch`)."""
    if parsed.problems:
        return MergeOutcome(None, reasons=list(parsed.problems))
    if parsed.kind in ("search_replace", "unified_diff"):
        return _merge_blocks(original, parsed.blocks, ordered=parsed.kind == "unified_diff")
    assert parsed.sketch is not None
    sketch, joined = unjoin(original, parsed.sketch)
    outcome = _merge_any_sketch(original, sketch, breaks)
    if joined and outcome.merged == original:
        # Read as drift, the joined lines change nothing; an edit is meant to change
        # something, so joining them is the change (a commit that joins a statement).
        sketch = parsed.sketch
        outcome = _merge_any_sketch(original, sketch, breaks)
    elif joined:
        outcome.notes.append(f"{joined} joined line(s) matched the file's multi-line "
                             f"statement(s) through their tokens: the file's lines kept")
    return _guarded(original, sketch, outcome)


def guard_sketch_merge(original: list[str], parsed: ParsedEdit, merged: list[str]
                       ) -> MergeOutcome:
    """A merge of `parsed` that another path wrote (the model's rewrite), through the same
    guards as the alignment's: its shape check lets a piece replace any run of original
    lines, so the model could delete code the sketch never shows (pyjwt 300348f7bc: a new
    test spliced in, then the file resumed at a later copy of its last context line); and
    it may not keep a line the sketch moves (`moved_and_kept`)."""
    if parsed.sketch is None:
        return MergeOutcome(merged)
    sketch, _ = unjoin(original, parsed.sketch)
    problem = moved_and_kept(original, sketch, merged)
    if problem:
        return MergeOutcome(None, reasons=[f"wrong-merge guard: {problem}"])
    return _guarded(original, sketch, MergeOutcome(merged))


def _guarded(original: list[str], sketch: Sketch, outcome: MergeOutcome) -> MergeOutcome:
    """The wrong-merge guard, then the layout guard (context keeps the file's layout)."""
    if outcome.merged is None:
        return outcome
    problem = check(original, sketch, outcome.merged)
    if problem:
        return MergeOutcome(None, reasons=[f"wrong-merge guard: {problem}"])
    outcome.merged, restored, ambiguous = restore_layout(original, outcome.merged)
    if ambiguous:
        return MergeOutcome(None, reasons=[f"layout guard: {ambiguous}"])
    if restored:
        outcome.notes.append(f"layout guard: {restored} layout-only change(s) outside "
                             f"the edit's changes (blank lines, whitespace) were given "
                             f"the file's layout back")
    return outcome


def _merge_any_sketch(original: list[str], sketch: Sketch, breaks: Breaks | None
                      ) -> MergeOutcome:
    """A sketch with markers, a whole file, or a marker-free fragment."""
    if not sketch.segments:
        return MergeOutcome(None, reasons=[("the edit has no content (an empty file is not "
                                            "written by a sketch)")])
    if sketch.marker_free and len(sketch.segments[0]) * 2 >= len(original):
        if _same_ends(sketch.segments[0], original):
            return MergeOutcome(sketch.segments[0])
        # A long marker-free edit that does not start and end like the file may be a whole
        # new file or a large fragment: align it, with the edge policy (nothing beyond its
        # ends is deleted by accident).
        outcome = _merge_sketch(original, Sketch(sketch.segments, False, False), breaks)
        outcome.notes.append("edit has no elision markers and does not start and end like "
                             "the file: aligned as a partial file")
        return outcome
    if sketch.marker_free:
        sketch = Sketch(sketch.segments, True, True)
        note = "edit has no elision markers and is much shorter than the file: treated as a " \
               "fragment, code above and below it kept"
        outcome = _merge_sketch(original, sketch, breaks)
        outcome.notes.append(note)
        return outcome
    return _merge_sketch(original, sketch, breaks)


# -- sketches --------------------------------------------------------------------------------

def _same_ends(edit: list[str], original: list[str]) -> bool:
    """A marker-free edit is a whole file when its first and last lines are the file's."""
    ours = [norm(line) for line in edit if line.strip()]
    theirs = [norm(line) for line in original if line.strip()]
    return not theirs or bool(ours) and ours[0] == theirs[0] and ours[-1] == theirs[-1]


def _merge_sketch(original: list[str], sketch: Sketch, breaks: Breaks | None = None
                  ) -> MergeOutcome:
    """Merge; when that declines, a segment's edge is a short line like `]` or `pass` that
    the file has, and the declined reading does not even parse (`breaks`), merge again
    reading such lines as context too. The first reading lets them be new (they are too
    common to place a segment by), which can leave the edit's own deletion unexplained:
    `]` shown above new code is the file's `]`, and the lines between are deleted, while a
    new `]` there would be a syntax error. The second reading must pass every check and
    parse; a second reading that merely parses is not enough (new code that resembles old
    code then reads as a rewrite of it)."""
    outcome = _merge_both_ways(original, sketch, trivial_edges=False)
    if outcome.merged is not None or breaks is None \
            or not _has_trivial_edges(original, sketch):
        return outcome
    first = _align_and_build(original, sketch, checked=False)
    if first.merged is None or not breaks(first.merged):
        return outcome
    second = _merge_both_ways(original, sketch, trivial_edges=True)
    if second.merged is None or breaks(second.merged):
        return outcome  # the first reading's reason is the one to show
    second.notes.append("short edge lines (like ']' or 'pass') read as context, as a "
                        "segment's other edge lines are: read as new, they break the syntax")
    return second


def _has_trivial_edges(original: list[str], sketch: Sketch) -> bool:
    known = {norm(line) for line in original}
    return any(line.strip() and trivial(norm(line)) and norm(line) in known
               for segment in sketch.segments if segment for line in (segment[0], segment[-1]))


def _merge_both_ways(original: list[str], sketch: Sketch, trivial_edges: bool
                     ) -> MergeOutcome:
    outcome = _align_and_build(original, sketch, trivial_edges=trivial_edges)
    if outcome.merged is None:
        return outcome
    # Ties: the alignment breaks them toward one end of the file. Aligning the mirrored
    # problem breaks them toward the other end; when the two results differ, the sketch
    # fits two ways equally well (typically blank lines or repeated lines around an insert).
    mirrored = Sketch([segment[::-1] for segment in reversed(sketch.segments)],
                      sketch.gap_after, sketch.gap_before,
                      blank_edges=[(b, a) for a, b in reversed(sketch.blank_edges)],
                      marker_indents=sketch.marker_indents[::-1])
    reverse = _align_and_build(original[::-1], mirrored, sketch.segments[::-1],
                               trivial_edges=trivial_edges, mirrored=True)
    if reverse.merged is None:  # the checks are one-sided (a segment's end): mirror them too
        return MergeOutcome(None, reasons=[
            _unmirror(r, len(original), len(sketch.segments)) for r in reverse.reasons],
            readings=[reading[::-1] for reading in reverse.readings])
    other = reverse.merged
    if other[::-1] != outcome.merged:
        at = next(i for i, (a, b) in enumerate(zip(outcome.merged, other[::-1])) if a != b) \
            if len(other) == len(outcome.merged) else None
        where = f" (from line {at + 1})" if at is not None else ""
        reason = (f"the sketch fits the file in two equally good ways that give different "
                  f"results{where}: ambiguous")
        return MergeOutcome(None, reasons=[reason], readings=[outcome.merged, other[::-1]])
    if outcome.merged == original:
        # Read with its context in the file's layout (models redraw it), the edit changes
        # nothing; an edit is meant to change something, so its layout is the change (a
        # commit that strips trailing whitespace, or adds blank lines between functions).
        literal = _align_and_build(original, sketch, keep_layout=False,
                                   trivial_edges=trivial_edges)
        if literal.merged is not None and literal.merged != original:
            literal.notes.append("the edit differs from the file only in layout "
                                 "(whitespace, blank lines): taken as written")
            return literal
        repeated = _repeated_line(original, sketch)
        if repeated:
            # Matched to another copy of that line, the lines between would be deleted:
            # the no-op reading is the one an edit is least likely to mean.
            reason = (f"read as it fits best the edit changes nothing, but it shows "
                      f"{repeated[:60]!r}, which the file has several times: context for "
                      f"deleting the lines up to another copy? ambiguous")
            return MergeOutcome(None, reasons=[reason])
    return outcome


def _repeated_line(original: list[str], sketch: Sketch) -> str | None:
    """A line with code the sketch shows that the file has more than once."""
    counts = Counter(norm(line) for line in original if line.strip())
    return next((line.strip() for segment in sketch.segments for line in segment
                 if line.strip() and counts[norm(line)] > 1), None)


def _unmirror(reason: str, lines: int, segments: int) -> str:
    """A reason found on the mirrored sketch, in the sketch's own terms: line and segment
    numbers counted from the other end, "ends" read as "starts"."""
    reason = re.sub(r"(?<=line )\d+|(?<=lines )\d+|(?<=and )\d+",
                    lambda m: str(lines - int(m[0]) + 1), reason)
    reason = re.sub(r"(?<=segment )\d+", lambda m: str(segments - int(m[0]) + 1), reason)
    return reason.replace("ends with new lines", "starts with new lines") \
        .replace("ends without context", "starts without context") \
        .replace("shows a blank line before", "shows a blank line after") \
        .replace("the file continues inside the same block", "the code above it is in the "
                 "same block")


def _align_and_build(original: list[str], sketch: Sketch,
                     shown: list[list[str]] | None = None,
                     keep_layout: bool = True, trivial_edges: bool = False,
                     checked: bool = True, mirrored: bool = False) -> MergeOutcome:
    """Align, check and build; `shown` are the segments as the user wrote them, for the
    reasons (the mirrored sketch's segments are reversed). `keep_layout`: context keeps
    the file's layout (`_context_layout`); else it is taken as written."""
    shown = shown or sketch.segments
    items: list[str | None] = [None]
    owner: list[int] = [-1]  # segment number of each item, -1 for markers
    optional: set[int] = set()
    edges = sketch.blank_edges or [(0, 0)] * len(sketch.segments)
    for number, (segment, (before, after)) in enumerate(zip(sketch.segments, edges)):
        if number:
            items.append(None)
            owner.append(-1)
        optional.update(range(len(items), len(items) + before))
        optional.update(range(len(items) + before + len(segment),
                              len(items) + before + len(segment) + after))
        items.extend([""] * before + segment + [""] * after)
        owner.extend([number] * (before + len(segment) + after))
    items.append(None)
    owner.append(-1)
    markers = [k for k, item in enumerate(items) if item is None]
    widths = {k: width for k, width in zip(markers, sketch.marker_indents) if width is not None}
    aligner = Aligner(original, items, frozenset(optional), trivial_edges, widths, mirrored)
    best = aligner.align()
    if best is None and aligner.bounds:
        aligner.bounds = {}  # no place closes the block a marker stands for: read it freely
        best = aligner.align()
    if best is None:
        return MergeOutcome(None, reasons=["sketch cannot be aligned with the file"])
    if not (sketch.gap_before and sketch.gap_after):
        # No marker at an end: the sketch may show the file's start (end), or a marker was
        # forgotten. Read it as reaching the file's edge (where its last line need not be
        # context) when that deletes no line the free alignment keeps, other than lines the
        # sketch shows elsewhere (moved: an import moved to the top), and it fits at least
        # as well or every segment's edge lines still fit as context (a forgotten marker
        # would delete the code beyond, or leave its first line unplaced).
        aligner.anchor(not sketch.gap_before, not sketch.gap_after)
        anchored = aligner.align()
        if anchored is not None and _moved_only(original, sketch,
                                                anchored.deleted - best.deleted) and (
                anchored.cost <= best.cost or not aligner.unplaced_context(anchored)):
            best = anchored
        else:
            aligner.anchor(False, False)
    best = _keep_what_markers_stand_for(aligner, best, owner)
    last = len(sketch.segments) - 1
    best = _pair_as_context(aligner, best, owner, lambda number, step: bool(
        number or sketch.gap_before) if step == 1 else bool(number < last or sketch.gap_after))
    regions = _check_all(original, sketch, aligner, best, items, owner, shown) if checked \
        else {}
    if isinstance(regions, _Tie):
        return MergeOutcome(None, reasons=[regions.reason], readings=_readings(
            original, sketch, aligner, items, owner, shown, best, regions, keep_layout))
    if isinstance(regions, str):
        return MergeOutcome(None, reasons=[regions])
    return _finish(original, sketch, items, owner, best, regions, keep_layout)


def _keep_what_markers_stand_for(aligner: Aligner, best: Alignment, owner: list[int]
                                 ) -> Alignment:
    """A segment that opens with new lines right after a marker indented as a deeper block
    (`    # ... rest of the function unchanged ...`, then a new top-level `def`), which the
    alignment reads as deleting lines there: the marker says the rest of that block stays,
    so the new lines are new, up to the segment's last line the file does not have, and
    the alignment is made again with them read so (the code after them is the segment's
    closing context). Without this the new function's lines, many of them copies of a
    similar neighbour's, were aligned onto that neighbour, deleting what the marker stands
    for (declined as an open end: the remaining `body`/`header` declines, click
    a17b544788). Mirrored: new lines before a marker deeper than them. The merge's checks
    then judge the new reading like any other."""
    items = aligner.items
    fresh: set[int] = set()
    layout: list[int] = []  # blank lines shown at such a marker
    for k, (start, end) in aligner.bounds.items():
        for bound, step in ((end, 1), (start, -1)):
            if bound is None or not 0 <= k + step < len(items) or items[k + step] is None:
                continue
            rows = [j for j, seg in enumerate(owner) if seg == owner[k + step]][::step]
            if _open_deletion(aligner, best, rows, best.ops[k][2 if step == 1 else 1], step):
                new = [i for i, j in enumerate(rows) if _new_only(aligner, j)]
                fresh.update(rows[:new[-1] + 1] if new else [])
                layout += itertools.takewhile(lambda j: j in aligner.optional, rows)
    if not fresh:
        return best
    aligner.fresh = frozenset(fresh)
    again = aligner.align()
    if again is None:
        aligner.fresh = frozenset()
        return best
    for j in layout:  # between the elided block and the new code: keep them, as shown
        if again.ops[j][0] == "drop":
            again.ops[j] = ("insert", again.ops[j][1])
    return again


def _new_only(aligner: Aligner, k: int) -> bool:
    return aligner.icode[k] < 0 and bool((aligner.items[k] or "").strip())


def _open_deletion(aligner: Aligner, best: Alignment, rows: list[int], at: int,
                   step: int = 1) -> bool:
    """The alignment deletes code lines between a marker's edge (`at`) and the segment's
    first matched line going from the marker (`rows` in that order, `step` 1 forward)."""
    first = next((best.ops[j][1] for j in rows if best.ops[j][0] == "match"
                  and (aligner.items[j] or "").strip()), None)
    if first is None:
        return False
    span = range(at, first) if step == 1 else range(first + 1, at)
    return any(o in best.deleted and aligner.original[o].strip() for o in span)


def _moved_only(original: list[str], sketch: Sketch, lines: set[int]) -> bool:
    """No lines, or lines with code that the sketch shows elsewhere (and blank lines
    between them): a moved line, which deleting here does not lose."""
    if not lines:
        return True
    code = [norm(original[o]) for o in lines if original[o].strip()]
    shown = {norm(line) for segment in sketch.segments for line in segment}
    return bool(code) and all(line in shown for line in code)


def _finish(original: list[str], sketch: Sketch, items: list[str | None], owner: list[int],
            best: Alignment, regions: dict[int, tuple[int, int]], keep_layout: bool
            ) -> MergeOutcome:
    for number in range(len(sketch.segments)):
        for step in (-1, 1):
            split = _new_lines_before_blank_run(original, items, owner, best, number, step)
            if split:
                return MergeOutcome(None, reasons=[f"segment {number + 1}: {split}"])
    return _build(original, sketch, items, owner, best, regions, keep_layout)


def _readings(original: list[str], sketch: Sketch, aligner: Aligner, items: list[str | None],
              owner: list[int], shown: list[list[str]], best: Alignment, tie: _Tie,
              keep_layout: bool) -> list[list[str]]:
    """The tie's two files, when they differ only in where the tied segment goes (every
    other segment is placed alike), each passes every other check and builds, and no third
    place ties too (a model would then choose between two of three or more)."""
    rows = [k for k, seg in enumerate(owner) if seg == tie.number]
    others = [k for k, seg in enumerate(owner) if seg not in (-1, tie.number)]
    if any(best.ops[k] != tie.rival.ops[k] for k in others):
        return []
    taken = [a.ops[k][1] for a in (best, tie.rival) for k in rows if a.ops[k][0] == "match"]
    if _rival(aligner, best, rows, taken) is not None:
        return []
    out = []
    for alignment in (best, tie.rival):
        regions = _check_all(original, sketch, aligner, alignment, items, owner, shown,
                             tie_ok=tie.number)
        if not isinstance(regions, dict):
            return []
        built = _finish(original, sketch, items, owner, alignment, regions, keep_layout)
        if built.merged is None:
            return []
        out.append(built.merged)
    return out if out[0] != out[1] else []


def _check_all(original: list[str], sketch: Sketch, aligner: Aligner, best: Alignment,
               items: list[str | None], owner: list[int], shown: list[list[str]],
               tie_ok: int | None = None) -> dict[int, tuple[int, int]] | str | _Tie:
    """Every segment's checks: the narrowed regions it replaces, or why the merge declines.
    `tie_ok`: a segment whose tie is known (its readings are being built)."""
    for number in range(len(sketch.segments)):
        label = f"segment {number + 1} ({_quote(shown[number])})"
        problem = _check_segment(aligner, best, owner, number, label, len(original),
                                 _at_file_edge(original, sketch, best, number),
                                 tie_ok=number == tie_ok)
        if not problem and (number or sketch.gap_before):  # its first line is at a marker
            split = _split_context(aligner, best, [k for k, seg in enumerate(owner)
                                                   if seg == number])
            problem = f"{label}: {split}" if split else None
        if problem:
            return problem
    regions: dict[int, tuple[int, int]] = {}
    for number in range(len(sketch.segments)):
        label = f"segment {number + 1} ({_quote(shown[number])})"
        problem = _open_end(original, items, owner, best, number,
                            number + 1 < len(sketch.segments) or sketch.gap_after,
                            sketch.marker_indent(number + 1)) \
            or _missing_blank(original, items, owner, best, number) \
            or _open_rewrite(original, items, owner, best, number,
                             number + 1 < len(sketch.segments) or sketch.gap_after) \
            or _blank_context_only(original, items, owner, best, number, aligner.optional)
        if problem:
            return f"{label} {problem}"
        region = _narrowest(aligner.onorm, items, owner, best, number)
        if isinstance(region, str):
            return f"{label} {region}: ambiguous"
        if region is not None:
            regions[number] = region  # the reading that keeps the most code
        elif (number or sketch.gap_before) \
                and (number + 1 < len(sketch.segments) or sketch.gap_after):
            problem = _insertion_elsewhere(aligner, items, owner, best, number)
            if problem:
                return f"{label} {problem}"
    return regions


def _insertion_elsewhere(aligner: Aligner, items: list[str | None], owner: list[int],
                         best: Alignment, number: int) -> str | None:
    """A segment between two markers that the alignment reads as rewriting or deleting
    code, while it also reads as pure insertion, which loses nothing: every code line of
    the file from a line equal to its first to a line equal to its last (within the
    stretch its markers leave it) is shown, in order, with only new lines between. The
    alignment's reading is cheaper (an edit costs less than a new line), but it changes
    code the sketch may never show; the other keeps it. Two readings, two files: declined,
    never guessed (a new option block after the last one, read as rewriting that one;
    pyjwt 5de3023c4c in the fourth slice). An insertion reading that would add a second
    copy of a line the file has once, which the alignment matched outside that reading's
    run, is no rival (loguru 3d4578cd8f: the `elif` of the branch the edit rewrites)."""
    keys = aligner.onorm  # the file's lines, whitespace collapsed
    rows = [k for k, seg in enumerate(owner) if seg == number]
    start, end = best.ops[rows[0] - 1][2], best.ops[rows[-1] + 1][1]
    lines = [line for k in rows if (line := items[k]) and line.strip()]
    shown = [norm(line) for line in lines]
    if not any(best.ops[k][0] == "sub" for k in rows) and not any(
            keys[o] for o in best.deleted if start <= o < end):
        return None  # it only adds lines: nothing to lose
    lo, hi = best.ops[rows[0] - 1][1], best.ops[rows[-1] + 1][2]
    code = [o for o in range(lo, hi) if keys[o]]
    if len(shown) < 2:
        return None

    def same(o: int, line: str) -> bool:
        """The file's line `o` is the sketch's `line`; a common line (`)`) only at its
        indentation, which is all that says which one it is."""
        return keys[o] == norm(line) and (not trivial(keys[o]) or
                                          _indent(aligner.original[o]) == _indent(line))

    # A line the file has once, which the alignment matched away from the insertion
    # reading's run, would be a second copy in that reading: the alignment's is the one.
    anchored = {best.ops[k][1] for k in rows if best.ops[k][0] == "match"
                and keys[best.ops[k][1]] and not trivial(keys[best.ops[k][1]])}
    unique = {o for o in anchored if keys.count(keys[o]) == 1}
    for i, o in enumerate(code):
        if not same(o, lines[0]):
            continue
        matched, j = 0, i + 1  # the file's code lines after `o` shown in order (greedy)
        for line in shown[1:-1]:
            if j + matched < len(code) and keys[code[j + matched]] == line:
                matched += 1
        for t in range(j, min(j + matched + 1, len(code))):
            run = code[i:t + 1]
            if same(code[t], lines[-1]) and not all(trivial(keys[p]) for p in run) \
                    and unique <= set(run):
                return (f"reads as new lines after line {o + 1} up to line {code[t] + 1} "
                        f"({keys[code[t]][:50]!r}), or as changing code it does not show: "
                        f"ambiguous")
    return None


def _new_lines_before_blank_run(original: list[str], items: list[str | None],
                                owner: list[int], best: Alignment, number: int,
                                step: int) -> str | None:
    """A segment that ends (step -1; starts: +1) with new lines and then blank lines before
    its marker, placed inside a run of the file's blank lines: the cheapest alignment
    splits the run (some of it before the new lines, some after), so the code after the
    marker loses part of its separation. The new lines go to the run's edge instead and the
    run stays whole next to the elided code: the blank lines shown between the context and
    the new lines are new, and those at the marker are the run's (the sketch's last line
    is the file's line after the insertion, as in a diff). Rewrites `best.ops` in place.
    When the sketch's blank lines on both sides of the new lines are each a line of the run
    and together the whole run (the marker elides none of it, none is new), the sketch
    reads as much as the run split as it does as new blank lines next to a whole run, so
    the reason it is ambiguous is returned instead (funcy c2777b8050, fourth slice: a run
    of three split one and two by the commit, written as one and three)."""
    rows = [k for k, seg in enumerate(owner) if seg == number]
    seq = rows[::-1] if step == -1 else rows  # from the marker inward
    blank = [not items[k].strip() for k in seq]  # type: ignore[union-attr]
    i = next((j for j, b in enumerate(blank) if not b), len(seq))
    edge = seq[:i]
    new_end = next((j for j in range(i, len(seq)) if best.ops[seq[j]][0] != "insert"), len(seq))
    inner_end = next((j for j in range(new_end, len(seq))
                      if not blank[j] or best.ops[seq[j]][0] != "match"), len(seq))
    new, inner = seq[i:new_end], seq[new_end:inner_end]
    if not edge or not inner or all(blank[j] for j in range(i, new_end)) \
            or any(best.ops[k][0] not in ("match", "drop") for k in edge):
        return None
    lines = [best.ops[k][1] for k in inner]  # from the new lines outward into the run
    if lines != [lines[0] + step * j for j in range(len(lines))]:
        return None
    shown = sorted(best.ops[k][1] for k in edge if best.ops[k][0] == "match")
    near = lines[0]  # the run's line next to the new lines
    if shown != list(range(near + 1, near + 1 + len(shown)) if step == -1
                     else range(near - len(shown), near)):
        return None
    far = lines[-1]  # where the new lines go: before (after) the whole run
    if best.deleted & set(range(min(far, near), max(far, near) + 1)):
        return None
    if _whole_run(original, [*lines, *shown]) and _blank_shown_all_matched(
            items, best, edge, new, seq[inner_end:]):
        first, last = min(lines + shown) + 1, max(lines + shown) + 1
        return (f"new lines go inside the run of blank lines between lines {first} and "
                f"{last}, which it shows whole: the run split around them, or new blank "
                f"lines with the run kept whole next to the marker? ambiguous")
    order = edge[::-1]  # the edge rows, from the new lines toward the marker
    at, taken = far, 0
    for k in order:
        if 0 <= at < len(original) and not original[at].strip():
            best.ops[k] = ("match", at)
            at, taken = at - step, taken + 1
        else:
            best.ops[k] = ("drop", at)
    slot = far if step == -1 else far + 1
    for k in inner + new:
        best.ops[k] = ("insert", slot)
    marker = seq[0] - step  # the marker row next to the segment's edge
    op = best.ops[marker]
    best.ops[marker] = ("marker", far + taken, op[2]) if step == -1 else \
        ("marker", op[1], far + 1 - taken)
    return None


def _blank_shown_all_matched(items: list[str | None], best: Alignment, edge: list[int],
                             new: list[int], beyond: list[int]) -> bool:
    """Every blank line the sketch shows next to the new lines, on either side, is matched
    to a line of the file: none of them is read as new (`beyond`: the rows past the matched
    blank lines on the context side)."""
    return all(best.ops[k][0] == "match" for k in edge) and \
        bool(items[new[-1]].strip()) and (not beyond or bool(items[beyond[0]].strip()))  # type: ignore[union-attr]


def _whole_run(original: list[str], lines: list[int]) -> bool:
    """`lines` (blank lines of the file) are a whole run of them: no blank line next to it."""
    lo, hi = min(lines), max(lines)
    return (lo == 0 or bool(original[lo - 1].strip())) and \
        (hi == len(original) - 1 or bool(original[hi + 1].strip()))


def _narrowest(keys: list[str], items: list[str | None], owner: list[int],
               best: Alignment, number: int) -> tuple[int, int] | str | None:
    """The smallest original region the segment can replace with the same opening and
    closing lines, when that is smaller than the alignment's: an alignment can save cost
    by rewriting an existing function into a new, similar one where the sketch adds the new
    one next to it, and keeping the most code is the safer reading. When the smaller reading
    would cut through lines the edit itself uses as context, neither is trusted (a string
    says why), unless the segment adds no line, or the smaller reading would keep a line
    the segment shows as context that the file has once (`_kept_twice`): then the
    alignment's reading stands. `keys`: the original's lines with whitespace collapsed."""
    rows = [k for k, seg in enumerate(owner) if seg == number]
    start, end = best.ops[rows[0] - 1][2], best.ops[rows[-1] + 1][1]
    rows = [k for k in rows if best.ops[k][0] != "drop"]
    head = _anchored_run(items, best, rows, start, 1, longest=True)
    tail = _anchored_run(items, best, rows[::-1], end - 1, -1, longest=True)
    head_min = _anchored_run(items, best, rows, start, 1, longest=False)
    tail_min = _anchored_run(items, best, rows[::-1], end - 1, -1, longest=False)
    interior = {best.ops[k][1] for k in rows[head:len(rows) - tail] if best.ops[k][0] == "match"}
    # A segment that adds no line (it only edits and deletes) cannot be a new block next to
    # a similar one; the smaller reading would take its own context lines as new copies.
    edits_only = all(best.ops[k][0] != "insert" for k in rows)
    new_start, new_end = start, end
    if head:
        want = keys[start:start + head]
        for p in range(end - tail_min - head, start, -1):
            if keys[p:p + head] == want:
                if not interior.isdisjoint(range(p, p + head)):
                    if edits_only or _kept_twice(keys, interior, range(start, p)):
                        break
                    return (f"opens like lines {start + 1} and {p + 1}, and the second "
                            f"reading would keep code the first replaces")
                new_start = p
                break
    if tail:
        want = keys[end - tail:end]
        for q in range(new_start + head_min + tail, end):
            if keys[q - tail:q] == want:
                if not interior.isdisjoint(range(q - tail, q)):
                    if edits_only or _kept_twice(keys, interior, range(q, end - tail)):
                        break
                    return (f"closes like lines {q} and {end}, and the first reading would "
                            f"keep code the second replaces")
                new_end = q
                break
    return None if (new_start, new_end) == (start, end) else (new_start, new_end)


def _kept_twice(keys: list[str], interior: set[int], kept: range) -> bool:
    """Whether a smaller reading, which keeps the file's lines `kept` as they are, would
    also write a second copy of one of them: a distinctive line the file has once that the
    segment shows as context there (`interior`: the original lines its inner rows match).
    That reading defines a test twice, say, and is no rival to the alignment's (deepdiff
    61e76b325e in the fifth slice: three tests rewritten, closing like the first of them,
    where the file has the second and third once each)."""
    return any(o in interior and keys[o] and not trivial(keys[o]) and keys.count(keys[o]) == 1
               for o in kept)


def _missing_blank(original: list[str], items: list[str | None], owner: list[int],
                   best: Alignment, number: int) -> str | None:
    """The sketch shows a blank line between a marker and the segment, but the line before
    the segment's first line is code: that code may have been deleted (the blank
    line was the only context) or the blank line may be layout. Not guessed, unless the
    first line is context, and reading the blank line as context is impossible (no blank
    line in the marker's stretch) or contradicts the segment's own context width: it
    opens on three context lines in a row, or closes on two. A sketch whose only context
    before a deletion is one blank line is a one-line-context diff, whose other end has one
    line of context too (a diff's context is as wide at both ends); models add such blank
    lines next to markers, and the merge keeps the file's."""
    rows = [k for k, seg in enumerate(owner) if seg == number]
    content = [k for k in rows if items[k].strip()]  # type: ignore[union-attr]
    lead = rows[:rows.index(content[0])] if content else []
    first = best.ops[content[0]] if content else None
    if not lead or any(best.ops[k][0] != "drop" for k in lead) \
            or first[1] == 0 or not original[first[1] - 1].strip():
        return None
    if first[0] != "match":
        return _blank_before(items, content[0], original, first)
    marker = best.ops[rows[0] - 1]
    blank = max((o for o in range(marker[1], first[1]) if not original[o].strip()),
                default=None)
    if blank is None:
        return None  # no blank line it could be: the model's layout, nothing deleted
    if _context_run(original, items, best, rows, 1) >= 3 \
            or _context_run(original, items, best, rows, -1) >= 2:
        return None  # the segment's context is wider than one line: the blank is layout
    return _blank_before(items, content[0], original, first)


def _context_run(original: list[str], items: list[str | None], best: Alignment,
                 rows: list[int], step: int) -> int:
    """How many lines of context the segment opens (`step` 1) or closes (-1) on, counted in
    the file, its blank lines included (as a diff counts them): from its first (last) row
    with code, matched to a file line, the rows whose text is the file's next lines with
    code, in order. Blank lines the sketch adds or leaves out between them are layout
    (optional blank lines left out at the marker aside). By text, not by the alignment's
    matches: where a later new line repeats a context line, the alignment may match that
    one and take the context's copy as new, the same file either way (cachetools
    083ee5ffdf in the third slice: a new test appended after three lines of context)."""
    edge: int | None = None  # the file line of the run's row next to the marker
    inner: int | None = None  # and of its innermost row so far
    for k in rows[::step]:
        op, text = best.ops[k], norm(items[k] or "")
        if edge is None or inner is None:
            if op[0] == "drop" or op[0] == "insert" and not text:
                continue
            if op[0] != "match":
                break
            edge = inner = op[1]
        elif not text:  # a blank line of the file next to the run counts, as in a diff
            if op[0] == "match" and (op[1] - inner) * step > 0 and not any(
                    line.strip() for line in original[min(op[1], inner) + 1:max(op[1], inner)]):
                inner = op[1]
        else:
            after = range(inner + step, len(original) if step == 1 else -1, step)
            nxt = next((o for o in after if original[o].strip()), None)
            if nxt is None or norm(original[nxt]) != text:
                break
            inner = nxt
    return 0 if edge is None or inner is None else abs(inner - edge) + 1


def _blank_before(items: list[str | None], k: int, original: list[str], first: tuple) -> str:
    shown = (items[k] or "").strip()[:60]
    return (f"shows a blank line before {shown!r}, where the file has "
            f"{original[first[1] - 1].strip()[:60]!r}: deleted or kept? ambiguous")


def _blank_context_only(original: list[str], items: list[str | None], owner: list[int],
                        best: Alignment, number: int, optional: frozenset[int]) -> str | None:
    """A segment that changes nothing, with a blank line as its context next to a marker
    (that blank line is the file's): it may mean to delete the lines between that blank
    line and the blank line before (after) the next code it shows, as a diff with one
    line of context does. Declined rather than read as a no-op."""
    rows = [k for k, seg in enumerate(owner) if seg == number]
    if any(best.ops[k][0] not in ("match", "drop") for k in rows):
        return None
    lines = [best.ops[k][1] for k in rows if best.ops[k][0] == "match"]
    if lines != list(range(lines[0], lines[0] + len(lines))) if lines else True:
        return None
    if any(items[k].lstrip() != original[best.ops[k][1]].lstrip()  # type: ignore[union-attr]
           for k in rows if best.ops[k][0] == "match"):
        return None  # it changes trailing whitespace
    if not any(k in optional and best.ops[k][0] == "match" for k in (rows[0], rows[-1])):
        return None
    return ("changes nothing, and its only context next to a marker is a blank line: "
            "are lines after it deleted? ambiguous")


def _open_end(original: list[str], items: list[str | None], owner: list[int],
              best: Alignment, number: int, marker_after: bool,
              marker_indent: int | None = None) -> str | None:
    """A segment that ends in new lines right before a marker has no closing context, so
    it does not say how far its edit reaches. Two readings are then guesses, and declined:
    deleting original lines (they may be kept), and keeping the block the segment was
    editing when the file goes on inside it (deeper than its last context line, or as deep
    with no blank line between: typically a rewritten body whose closing context line was
    blank)."""
    rows = [k for k, seg in enumerate(owner) if seg == number]
    content = [k for k in rows if items[k].strip()]  # type: ignore[union-attr]
    marker = best.ops[rows[-1] + 1]
    if not content or best.ops[content[-1]][0] == "match" or not marker_after:
        return None
    # Lines deleted between two context lines the sketch shows next to each other (only
    # blank lines between) are shown deleted, not left unsaid by the open end (a line
    # dropped from a list of assignments, then a new method below it: tinydb 63fcad66a5 in
    # the fourth slice). With new lines between them it may be a rewrite of code the
    # sketch never shows (new code repeating lines of the next test, matched there, its
    # header deleted: click 7ed114f89a, `tight`), and a common line (`pass`) pins nothing.
    start = best.ops[rows[0] - 1][2]
    shown = set()
    for a, b in itertools.pairwise(content):
        if all(best.ops[k][0] == "match" and not trivial(norm(items[k]))  # type: ignore[arg-type]
               for k in (a, b)):
            shown.update(range(best.ops[a][1] + 1, best.ops[b][1]))
    gone = sorted(o for o in best.deleted if start <= o < marker[1] and original[o].strip()
                  and o not in shown)
    if gone:
        return (f"ends without context and would delete line {gone[0] + 1} "
                f"({original[gone[0]].strip()[:60]!r}): replaced or kept? ambiguous")
    matched = [best.ops[k][1] for k in content if best.ops[k][0] == "match"]
    op = best.ops[content[-1]]
    after = op[1] + (op[0] != "insert")  # the original line right after the segment's text
    follow = next((o for o in range(after, marker[2]) if original[o].strip()), None)
    if not matched or follow is None:
        return None
    base, indent = _indent(original[matched[-1]]), _indent(original[follow])
    # The block is the shallower of the last context line's and the last new line's (a
    # new statement that closes a deeper context line, like `)` after an argument).
    last_match = [k for k in content if best.ops[k][0] == "match"][-1]
    out = len(_indent(items[last_match]))  # type: ignore[arg-type]
    out -= len(_indent(items[content[-1]]))  # type: ignore[arg-type]
    base = base[:max(0, len(base) - out)] if out > 0 else base
    touching = follow == after  # no blank line between
    if marker_indent is not None and len(indent) >= marker_indent \
            > len(_indent(items[content[-1]])):  # type: ignore[arg-type]
        return None  # the marker is indented as that block: it stands for the rest, kept
    if indent.startswith(base) and (len(indent) > len(base) or touching):
        return (f"ends with new lines, and the file continues inside the same block "
                f"({original[follow].strip()[:60]!r}): replaced or kept? ambiguous")
    return None


def _open_rewrite(original: list[str], items: list[str | None], owner: list[int],
                  best: Alignment, number: int, marker_after: bool) -> str | None:
    """A segment that ends with an edited line followed by new lines, with no context after
    them: unless it is clearly the same line (OPEN_SUB_MIN), the new lines may as well come
    before the original line, unedited (a new block whose first line resembles it)."""
    rows = [k for k, seg in enumerate(owner) if seg == number]
    content = [k for k in rows if items[k].strip()]  # type: ignore[union-attr]
    if not content or best.ops[content[-1]][0] == "match" or not marker_after:
        return None
    tail = content[max((i + 1 for i, k in enumerate(content) if best.ops[k][0] == "match"),
                       default=0):]
    kinds = [best.ops[k][0] for k in tail]
    if "sub" in kinds and "insert" in kinds[kinds.index("sub"):] and token_similarity(
            norm(items[tail[kinds.index("sub")]]),  # type: ignore[arg-type]
            norm(original[best.ops[tail[kinds.index("sub")]][1]])) < OPEN_SUB_MIN:
        o = best.ops[tail[kinds.index("sub")]][1]
        return (f"ends without context and would rewrite line {o + 1} "
                f"({original[o].strip()[:60]!r}) before its new lines: replaced or kept? "
                f"ambiguous")
    return None


def _anchored_run(items: list[str | None], best: Alignment, rows: list[int], at: int,
                  step: int, longest: bool) -> int:
    """How many of the segment's rows, from one end, match consecutive original lines from
    `at`: all of them (`longest`) or just enough to include a distinctive line; 0 when the
    run has no distinctive line."""
    count, distinctive = 0, False
    for k in rows:
        if best.ops[k] != ("match", at + step * count):
            break
        count += 1
        distinctive = distinctive or not trivial(norm(items[k]))  # type: ignore[arg-type]
        if distinctive and not longest:
            break
    return count if distinctive else 0


def _at_file_edge(original: list[str], sketch: Sketch, best: Alignment, number: int) -> bool:
    """The segment is the sketch's first (last) with no marker before (after) it and is
    placed at the file's start (end), blank lines aside: the file's edge anchors it."""
    if number == 0 and not sketch.gap_before:
        first = best.ops[0]
        if not any(line.strip() for line in original[first[1]:first[2]]):
            return True
    if number == len(sketch.segments) - 1 and not sketch.gap_after:
        last = best.ops[-1]
        return not any(line.strip() for line in original[last[1]:last[2]])
    return False


def _copy_beyond(aligner: Aligner, best: Alignment, k: int, step: int) -> bool:
    """Whether the file has a copy of edge row `k`'s line, taken as new, where it could
    still be the segment's context: past the segment's end (`step` 1; before its start:
    -1) within the stretch the marker there skips. Without one, the line can only be a
    new copy (a new method that ends like a neighbour above it, tinydb 63fcad66a5 in the
    fourth slice): reading it as context would put it out of order."""
    marker = next(j for j in itertools.count(k + step, step) if aligner.items[j] is None)
    at, (_, start, end) = best.ops[k][1], best.ops[marker]
    lo, hi = (at, end) if step == 1 else (start, at)
    return bool(np.any(aligner.ocode[lo:hi] == aligner.icode[k]))


def _same_as_new_copy(aligner: Aligner, best: Alignment, k: int, outward: int) -> bool:
    """Whether reading edge row `k` (a line the file has several times) as a new copy, with
    the blank row `outward` next to it as the context instead, merges the same file as
    reading it as context: the two readings then are one (a renamed function whose
    `return thing.go()` ends the segment: as context the old `def` line is deleted, as a
    new copy that line and the old `return` are; tenacity daaaebe80c in the third
    slice)."""
    saved = list(aligner.icost)
    aligner.icost[k] = aligner.plain_cost(k)
    aligner.icost[outward] = INF  # a blank line matched, never left out
    try:
        other = aligner.align({k: np.ones(len(aligner.original), dtype=bool)})
    finally:
        aligner.icost = saved
    return other is not None and _text(aligner, other) == _text(aligner, best)


def _text(aligner: Aligner, alignment: Alignment) -> list[str]:
    """The file an alignment merges, whitespace collapsed (layout is the guard's)."""
    out: list[str] = []
    for item, op in zip(aligner.items, alignment.ops):
        if op[0] == "marker":
            out += aligner.onorm[op[1]:op[2]]
        elif op[0] == "match":
            out.append(aligner.onorm[op[1]])
        elif op[0] in ("sub", "insert"):
            out.append(norm(item or ""))
    return out


def _check_segment(aligner: Aligner, best: Alignment, owner: list[int], number: int,
                   label: str, n: int, at_edge: bool = False, tie_ok: bool = False
                   ) -> str | _Tie | None:
    """Decline a segment that anchors on nothing distinctive (unless the file's start or
    end anchors it) or fits elsewhere equally well (a `_Tie`, unless `tie_ok`)."""
    rows = [k for k, seg in enumerate(owner) if seg == number]
    matched = [best.ops[k][1] for k in rows if best.ops[k][0] == "match"]
    if not at_edge and not any(
            not trivial(norm(aligner.items[k]))  # type: ignore[arg-type]
            for k in rows if best.ops[k][0] == "match"):
        return (f"{label} shares no distinctive line with the original: cannot tell where it "
                f"goes")
    edges = [k for k in aligner.edges() if owner[k] == number]
    for k in edges:  # a segment's edge lines are its context: see align.py
        which = "first" if k == edges[0] else "last"
        if best.ops[k][0] == "insert" and aligner.icost[k] == INSERT_EDGE \
                and _copy_beyond(aligner, best, k, -1 if which == "first" else 1):
            return (f"{label}: its {which} line {aligner.items[k].strip()[:60]!r} is in the "
                    f"file but does not fit as context anywhere the rest of the segment does")
        # Forced to be context, a line the file has several times may be a new copy when
        # the segment shows blank lines before it at the marker (those may be the context):
        # when taking it as context means deleting the lines next to it, it is not trusted.
        # Blank lines deleted there are the model's layout (the file keeps its own).
        step = 1 if which == "first" else -1
        outward = k - step
        gone = next((o for o in itertools.takewhile(
            lambda o: o in best.deleted, itertools.count(best.ops[k][1] + step, step))
            if aligner.original[o].strip()), None)
        if best.ops[k][0] == "match" and aligner.icost[k] == INSERT_EDGE \
                and outward in aligner.optional and gone is not None and len(edges) > 1 \
                and np.count_nonzero(aligner.ocode == aligner.icode[k]) > 1 \
                and not _same_as_new_copy(aligner, best, k, outward):
            return (f"{label}: its {which} line {aligner.items[k].strip()[:60]!r} occurs "
                    f"several times in the file, and as context here it would delete line "
                    f"{gone + 1} ({aligner.original[gone].strip()[:60]!r}): ambiguous")
    if not matched:
        return None  # at the file's edge, by its edited lines alone (nothing to forbid)
    rival = _rival(aligner, best, rows, matched)
    if rival is not None and not tie_ok:
        elsewhere = [rival.ops[k][1] for k in rows if rival.ops[k][0] == "match"]
        where = f"lines {matched[0] + 1} and {elsewhere[0] + 1}" if elsewhere else \
            f"line {matched[0] + 1} or as new code"
        return _Tie(f"{label} fits the original equally well at {where}: ambiguous", number,
                    rival)
    other = _deletes_elsewhere(aligner, best, rows, matched) if rival is None else None
    return f"{label} {other}" if other else None


def _deletes_elsewhere(aligner: Aligner, best: Alignment, rows: list[int], taken: list[int]
                       ) -> str | None:
    """A segment that only deletes (each of its lines context), which fits elsewhere too,
    every line context there as well, deleting other code: two readings, two files. The
    cost prefers the one that deletes less, which says nothing about which code the edit
    removes (pint 4ff5a28d97 in `sixth`: `def __hash__`, `return self._hash`, `def __eq__`
    read as deleting three lines inside one class's `__hash__`, where the commit deleted
    two methods after another class's). Declined, never guessed."""
    here = _code_deleted(aligner, best, rows)
    if not here:
        return None
    mask = np.zeros(len(aligner.original), dtype=bool)
    mask[taken] = True
    other = aligner.align({k: mask for k in rows})
    there = _code_deleted(aligner, other, rows) if other is not None else []
    if not there:
        return None
    return (f"deletes line {here[0] + 1} ({aligner.original[here[0]].strip()[:50]!r}) here, "
            f"or, with the same lines as context, line {there[0] + 1} "
            f"({aligner.original[there[0]].strip()[:50]!r}): two readings, ambiguous")


def _code_deleted(aligner: Aligner, alignment: Alignment, rows: list[int]) -> list[int]:
    """The file's lines with code that `alignment` deletes between the segment's `rows`,
    when every one of those rows is context (matched, or a blank line dropped); else
    nothing."""
    if any(alignment.ops[k][0] not in ("match", "drop") for k in rows):
        return []
    lines = [alignment.ops[k][1] for k in rows if alignment.ops[k][0] == "match"]
    if not lines:
        return []
    return sorted(o for o in alignment.deleted
                  if lines[0] < o < lines[-1] and aligner.original[o].strip())


def _split_context(aligner: Aligner, best: Alignment, rows: list[int]) -> str | None:
    """A segment that opens on a common line (closing quotes, `try:`, `)`) followed by a line the
    file has, where the file has the two together, but the alignment takes the second as
    new: the pair may be the segment's two lines of context there (the common line places
    nothing by itself, so the alignment was free to match it elsewhere and keep the lines
    between). Read the other way, an insertion that copies a line elsewhere in the file
    lands next to another copy of the common line, and the code between is kept or lost
    by chance (more-itertools 61a2d7be70: the closing quotes and `return` above a deleted
    function matched that function's own quotes, its `return` replaced, the rest kept).
    Declined rather than guessed (unless `_pair_as_context` settled it). Only at a
    marker: at the file's edge without one the edge places the segment (new code appended
    at the end of a file that copies the file's last lines is new). The mirrored sketch
    checks the segment's end."""
    pairs = _split_pairs(aligner, best, rows, 1)
    if not pairs:
        return None
    first, second, o, after = pairs[0]
    return (f"its first lines {aligner.items[first].strip()[:40]!r} and "  # type: ignore[union-attr]
            f"{aligner.items[second].strip()[:60]!r} are the file's lines {o + 1} "  # type: ignore[union-attr]
            f"and {after + 1}, but the best reading takes the second as new: "
            f"context or a new copy? ambiguous")


def _split_pairs(aligner: Aligner, best: Alignment, rows: list[int], step: int
                 ) -> list[tuple[int, int, int, int]]:
    """The places of `_split_context`'s pair at the segment's start (`step` 1) or end (-1):
    (edge row, next row, the file's line of each), where the file has the edge row's
    common line and, as its next line with code in that direction, the next row's line,
    which the alignment takes as new."""
    code = [k for k in rows if k not in aligner.optional
            and aligner.items[k].strip()][::step]  # type: ignore[union-attr]
    if len(code) < 2 or best.ops[code[1]][0] == "match":
        return []
    first, second = code[0], code[1]
    if aligner.icode[first] < 0 or aligner.icode[second] < 0 \
            or not trivial(norm(aligner.items[first])) \
            or trivial(norm(aligner.items[second])):  # type: ignore[arg-type]
        return []
    codes = aligner.ocode
    out = []
    for o in np.flatnonzero(codes == aligner.icode[first]):
        beyond = range(o + 1, len(codes)) if step == 1 else range(o - 1, -1, -1)
        nxt = next((p for p in beyond if aligner.original[p].strip()), None)
        if nxt is not None and codes[nxt] == aligner.icode[second]:
            out.append((first, second, int(o), nxt))
    return out


def _pair_as_context(aligner: Aligner, best: Alignment, owner: list[int],
                     at_marker: Callable[[int, int], bool]) -> Alignment:
    """`_split_context`'s pair settled: where the file has it once, and the alignment's
    reading (the second line new) writes a second copy of a distinctive line the file has
    once and keeps as it is (`_copies_kept_line`), that reading is not one an edit means;
    the segment is aligned again with the pair as its context there, and the merge's
    checks judge that reading like any other (loguru 1d11396329 in the fourth slice:
    `return`, `if self._enqueue:`, `self._queue.put(...)` opening a segment that unwraps a
    `try:`, read as new lines below the file's own copies of them). `at_marker(number,
    step)`: the segment's start (end) is at a marker, not at the file's edge."""
    for number in range(max(owner) + 1):
        rows = [k for k, seg in enumerate(owner) if seg == number]
        for step in (1, -1):
            pairs = _split_pairs(aligner, best, rows, step) if at_marker(number, step) else []
            if len(pairs) != 1 or not _copies_kept_line(aligner, best, rows):
                continue
            first, second, o, nxt = pairs[0]
            saved = list(aligner.icost)
            aligner.icost[first] = aligner.icost[second] = INF  # matched there, never new
            try:
                pinned = aligner.align({k: np.arange(len(aligner.original)) != at
                                        for k, at in ((first, o), (second, nxt))})
            finally:
                aligner.icost = saved
            if pinned is not None and not _orphans_body(aligner, pinned,
                                                        pinned.deleted - best.deleted):
                best = pinned
    return best


def _orphans_body(aligner: Aligner, alignment: Alignment, deleted: set[int]) -> bool:
    """Whether the alignment deletes a block's header (a line ending in `:`) among `deleted`
    and keeps code of its block: the first line with code after the header that it does
    not delete is deeper than the header and stays as deep, kept by a marker or shown so by
    the sketch. That body then belongs to whatever is above it (the next class's header
    and docstring deleted, its `Args:` lines matched as a new docstring's of the class
    above: rich ae12e09065 in bench/apply.py, `tight`). A header whose body the sketch shows
    less deep is unwrapped on purpose (a `try:` removed). The mirrored problem reads the
    file upwards, so the lines after the header are above it there."""
    kept = {op[1]: k for k, op in enumerate(alignment.ops) if op[0] in ("match", "sub")}
    original = aligner.original
    for o in sorted(deleted):
        if not original[o].rstrip().endswith(":"):
            continue
        below = range(o - 1, -1, -1) if aligner.mirrored else range(o + 1, len(original))
        body = next((p for p in below if original[p].strip() and p not in alignment.deleted),
                    None)
        if body is None or indent_width(original[body]) <= indent_width(original[o]):
            continue
        if body not in kept or indent_width(aligner.items[kept[body]] or "") == \
                indent_width(original[body]):
            return True
    return False


def _copies_kept_line(aligner: Aligner, best: Alignment, rows: list[int]) -> bool:
    """Whether the alignment reads one of `rows` as a new line that is a distinctive line
    the file has once, which no row matches and nothing deletes: a second copy of it."""
    counts = Counter(aligner.onorm)
    used = {op[1] for op in best.ops if op[0] in ("match", "sub")}
    for k in rows:
        text = norm(aligner.items[k] or "")
        if best.ops[k][0] == "insert" and text and not trivial(text) and counts[text] == 1:
            o = aligner.onorm.index(text)
            if o not in used and o not in best.deleted:
                return True
    return False


def _rival(aligner: Aligner, best: Alignment, rows: list[int], taken: list[int]
           ) -> Alignment | None:
    """The best alignment whose `rows` match none of the `taken` lines, when it is about as
    good as `best` (a tie), else None."""
    mask = np.zeros(len(aligner.original), dtype=bool)
    mask[taken] = True
    rival = aligner.align({k: mask for k in rows})
    # How similar an edited line is to the line it replaces is weak evidence for where a
    # segment goes: a rival place is as good if it is with the edits counted as barely
    # similar (a changed message that resembles a neighbouring copy more than its own).
    slack = sum(SUB_WEAKEST - int(aligner.subcost[k][best.ops[k][1]])  # type: ignore[index]
                for k in rows if best.ops[k][0] == "sub")
    # And a rival within one deleted line's cost is a tie: deleting two comment lines in
    # one block vs editing a line in its near-copy is not something costs can settle.
    return rival if rival is not None and rival.cost <= best.cost + slack + DELETE_EXTEND \
        else None


def _build(original: list[str], sketch: Sketch, items: list[str | None], owner: list[int],
           best: Alignment, regions: dict[int, tuple[int, int]],
           keep_layout: bool = True) -> MergeOutcome:
    """Kept original ranges between the segments; `regions` narrows what a segment replaces."""
    out: list[str] = []
    notes: list[str] = []
    last = len(items) - 1
    for k, op in enumerate(best.ops):
        if op[0] != "marker":
            continue
        start = regions[owner[k - 1]][1] if k and owner[k - 1] in regions else op[1]
        end = regions[owner[k + 1]][0] if k < last and owner[k + 1] in regions else op[2]
        kept = original[start:end]
        edge = "start" if k == 0 else "end" if k == last else None
        if edge and kept and not (sketch.gap_before if k == 0 else sketch.gap_after):
            problem = _edge_problem(kept, edge)
            if problem:
                return MergeOutcome(None, reasons=[problem])
            if not any(line.strip() for line in kept):
                kept = []  # only blank lines: the sketch shows the file's very start or end
            else:
                notes.append(f"no marker at the edit's {edge}: the {len(kept)} line(s) "
                             f"{'above' if k == 0 else 'below'} it were kept")
        out.extend(kept)
        if k < last:
            out.extend(_segment_lines(original, items, owner, best, owner[k + 1],
                                      keep_layout))
    return MergeOutcome(out, notes=notes)


def _edge_problem(kept: list[str], edge: str) -> str | None:
    """Policy for original lines beyond a sketch edge that has no marker: keep them, because
    models often leave the marker out and dropping code by accident is the worst outcome.
    Only when those lines touch the sketch's edge with no blank line between (so they read
    as part of the block the sketch shows, and leaving them out may mean deleting them) is
    it declined instead of guessed."""
    touching = kept[-1] if edge == "start" else kept[0]
    if not touching.strip():
        return None
    where = "above" if edge == "start" else "below"
    return (f"the edit has no elision marker at its {edge}, and the file continues right "
            f"{where} it ({touching.strip()[:60]!r}, {len(kept)} line(s)): either they are "
            f"deleted or the marker was forgotten")


def _segment_lines(original: list[str], items: list[str | None], owner: list[int],
                   best: Alignment, number: int, keep_layout: bool = True) -> list[str]:
    """The segment's lines as merged: shifted back to the file's indentation, and with
    `keep_layout` its context in the file's bytes (`_context_layout`)."""
    rows = [k for k, seg in enumerate(owner) if seg == number and best.ops[k][0] != "drop"]
    lines = [items[k] or "" for k in rows]
    matched = [(i, best.ops[k][1]) for i, k in enumerate(rows) if best.ops[k][0] == "match"]
    pairs = [(i, o) for i, o in matched if lines[i].strip()]
    lines = _shift(lines, _indent_delta(pairs, lines, original))
    return _context_layout(original, lines, dict(matched)) if keep_layout else lines


def _context_layout(original: list[str], lines: list[str], matched: dict[int, int]
                    ) -> list[str]:
    """Context keeps the file's bytes: models redraw its whitespace at will (trailing
    whitespace dropped or added, spaces doubled). A matched line as indented as the file's
    copy is that copy; indentation changed on purpose is the edit's. (Blank lines redrawn
    between context lines are put back by `guard.restore_layout`, which sees the whole
    merge.)"""
    return [original[matched[i]] if i in matched and (
        not line.strip() or _indent(line) == _indent(original[matched[i]])) else line
        for i, line in enumerate(lines)]


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _indent_delta(pairs: list[tuple[int, int]], have: list[str], want: list[str]
                  ) -> tuple[str, str] | None:
    """The indentation prefix to add ("add") or remove ("cut") that maps the paired `have`
    lines onto their `want` lines, or None when there is no shift. The first and last pair
    (a segment's context lines) decide when they agree; otherwise most pairs must agree.
    Not all: a sketch that wraps old lines in a new block, or renames the call a hanging
    indent aligns with, re-indents exactly those lines on purpose."""
    deltas = [_delta(_indent(have[j]), _indent(want[i])) for j, i in pairs]
    if not deltas:
        return None
    if deltas[0] is not None and deltas[0] == deltas[-1]:
        return deltas[0] if deltas[0][1] else None
    votes: dict[tuple[str, str], int] = {}
    for delta in deltas:
        if delta is not None:
            votes[delta] = votes.get(delta, 0) + 1
    if not votes:
        return None
    ranked = sorted(votes.items(), key=lambda kv: -kv[1])
    if len(ranked) > 1 and ranked[1][1] * 2 > ranked[0][1]:
        return None  # no clear majority: leave the lines as written
    delta = ranked[0][0]
    return delta if delta[1] else None


def _delta(ours: str, theirs: str) -> tuple[str, str] | None:
    if theirs.endswith(ours):
        return ("add", theirs[: len(theirs) - len(ours)])
    if ours.endswith(theirs):
        return ("cut", ours[: len(ours) - len(theirs)])
    return None


def _shift(lines: list[str], delta: tuple[str, str] | None) -> list[str]:
    if delta is None:
        return lines
    op, prefix = delta
    if op == "add":
        return [prefix + line if line.strip() else line for line in lines]
    return [line.removeprefix(prefix) for line in lines]


def _quote(segment: list[str]) -> str:
    first = next((line.strip() for line in segment if line.strip()), "")
    return repr(first[:60])


# -- search/replace blocks and diff hunks ----------------------------------------------------

def _merge_blocks(original: list[str], blocks: list[Block], ordered: bool) -> MergeOutcome:
    """Apply blocks one after another. Diff hunks are ordered and carry line hints; SEARCH
    blocks may come in any order and must match exactly one place, unless taking them in
    file order leaves each exactly one place (see `_in_file_order`)."""
    if not ordered and len(blocks) > 1:
        placed = _in_file_order(original, blocks)
        if placed is not None:
            lines = list(original)
            for start, end, new in reversed(placed):
                lines[start:end] = new
            return MergeOutcome(lines)
    lines = list(original)
    lo, shift = 0, 0
    for number, block in enumerate(blocks, start=1):
        hint = None if block.hint is None else block.hint + shift
        found = _find_block(lines, block, lo if ordered else 0, hint, number)
        if isinstance(found, str):
            return MergeOutcome(None, reasons=[found])
        start, end, new = found
        lines[start:end] = new
        shift += len(new) - (end - start)
        lo = start + len(new) if ordered else 0
    return MergeOutcome(lines)


def _in_file_order(original: list[str], blocks: list[Block]
                   ) -> list[tuple[int, int, list[str]]] | None:
    """Place SEARCH blocks that each match somewhere in the original, assuming they come in
    file order (models write them top to bottom): a block repeated elsewhere is then pinned
    by its neighbours. None when some block is not in the original, the order cannot hold,
    or a block still has two places: the block-by-block rules then decide (and explain)."""
    found = []
    for block in blocks:
        variant = next(((old, new, exact) for old, new, exact in _variants(block)
                        if _occurrences(original, old, 0, exact)), None)
        if variant is None or not any(line.strip() for line in block.old):
            return None
        found.append((variant, _occurrences(original, variant[0], 0, variant[2])))
    earliest, lo = [], 0
    for (old, _, _), hits in found:
        feasible = [h for h in hits if h >= lo]
        if not feasible:
            return None
        earliest.append(feasible[0])
        lo = feasible[0] + len(old)
    latest, hi = [], len(original)
    for (old, _, _), hits in reversed(found):
        feasible = [h for h in hits if h + len(old) <= hi]
        latest.insert(0, feasible[-1])
        hi = feasible[-1]
    placed = []
    for ((old, new, exact), hits), lo, hi in zip(found, earliest, latest):
        between = [h for h in hits if lo <= h <= hi]
        if len(between) != 1:
            return None
        at = between[0]
        if not exact:
            pairs = [(k, k) for k in range(len(old)) if old[k].strip()]
            new = _shift(new, _indent_delta(pairs, old, original[at:at + len(old)]))
        placed.append((at, at + len(old), new))
    return placed


def _find_block(lines: list[str], block: Block, lo: int, hint: int | None, number: int
                ) -> tuple[int, int, list[str]] | str:
    if not any(line.strip() for line in block.old):
        if hint is not None:
            at = max(lo, min(hint, len(lines)))
            return at, at, block.new
        if not any(line.strip() for line in lines):
            return 0, len(lines), block.new
        return f"block {number} has an empty SEARCH part: nowhere to put it in a non-empty file"
    for old, new, exact in _variants(block):
        hits = _occurrences(lines, old, lo, exact)
        if not hits:
            continue
        if hint is None and len(hits) > 1:
            return (f"block {number} ({_quote(old)}) matches {len(hits)} places (lines "
                    f"{', '.join(str(h + 1) for h in hits[:5])}): ambiguous")
        at = min(hits, key=lambda h: abs(h - hint)) if hint is not None else hits[0]
        if hint is not None:
            tied = [h for h in hits if abs(h - hint) == abs(at - hint) and h != at]
            if tied:
                return (f"hunk {number} matches lines {at + 1} and {tied[0] + 1} equally far "
                        f"from its stated position: ambiguous")
        if not exact:  # matched with whitespace collapsed: carry a uniform indent shift over
            found = lines[at:at + len(old)]
            pairs = [(k, k) for k in range(len(old)) if old[k].strip()]
            new = _shift(new, _indent_delta(pairs, old, found))
        return at, at + len(old), new
    return (f"block {number} ({_quote(block.old)}) does not match the file, even ignoring "
            f"whitespace and blank lines at its edges")


def _variants(block: Block):
    """Ways to match a block, strictest first: as written, then with whitespace collapsed,
    then without the blank lines at its edges (dropped from both sides alike)."""
    yield block.old, block.new, True
    yield block.old, block.new, False
    old, new = list(block.old), list(block.new)
    while old and new and not old[0].strip() and not new[0].strip():
        old, new = old[1:], new[1:]
    while old and new and not old[-1].strip() and not new[-1].strip():
        old, new = old[:-1], new[:-1]
    if old != block.old and any(line.strip() for line in old):
        yield old, new, False


def _occurrences(lines: list[str], old: list[str], lo: int, exact: bool) -> list[int]:
    key = (lambda s: s) if exact else norm
    target = [key(line) for line in old]
    first = target[0]
    size = len(target)
    return [i for i in range(lo, len(lines) - size + 1)
            if key(lines[i]) == first and [key(x) for x in lines[i:i + size]] == target]
