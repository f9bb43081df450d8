"""Model path: the local model rewrites only the windows of the file the edit touches.

Each edit piece (sketch segment, SEARCH block, diff hunk) is located by its distinctive lines;
the window is that place plus a few unchanged lines on each side. The model sees the window and
the pieces and writes the new window, decoded speculatively with the window as the draft. The
unchanged margin lines must come back unchanged: that catches truncated or wandering output.
The output must also have a merge's only possible shape (`Shape`: original lines in order
with each piece spliced in whole), which `Watch` enforces line by line while decoding.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from difflib import SequenceMatcher

from codeplane.apply.align import norm, trivial
from codeplane.apply.formats import ParsedEdit, is_marker
from codeplane.core.languages import language_for
from codeplane.models.engine import LocalModel
from codeplane.models.jobs import JobContext
from codeplane.models.speculative import Decoded, decode

MAX_OCCURRENCES = 6  # a line more frequent than this in the file locates nothing
MARGIN = 3  # unchanged lines kept on each side of a window
MAX_WINDOW_LINES = 300  # beyond this the model path declines (prompt + output must fit n_ctx)
MAX_REPAIRS = 4  # refused lines replaced per window before the output is given up
_HASH_COMMENT = {"python", "ruby", "bash", "yaml", "toml"}

SYSTEM = ("You merge code edits. You get a piece of original code and an edit for it. Lines "
          "like `... existing code ...` in the edit stand for unchanged original lines. Reply "
          "with the complete updated code in one code block: every original line the edit "
          "does not change, exactly as it was, with the edit applied. No explanations.")


@dataclass
class Window:
    start: int
    end: int
    inner_start: int  # [inner_start, inner_end) holds the anchors; the rest is margin
    inner_end: int
    pieces: list[list[str]] = field(default_factory=list)


@dataclass
class Rewrite:
    merged: list[str] | None
    reasons: list[str] = field(default_factory=list)
    runs: list[Decoded] = field(default_factory=list)


def pieces_of(parsed: ParsedEdit) -> list[list[str]]:
    if parsed.sketch is not None:
        return parsed.sketch.segments
    return [["<<<<<<< SEARCH", *b.old, "=======", *b.new, ">>>>>>> REPLACE"]
            for b in parsed.blocks]


def plan_windows(original: list[str], pieces: list[list[str]]) -> list[Window] | str:
    """One window per place the edit touches (overlapping ones merged), or why not."""
    where: dict[str, list[int]] = defaultdict(list)
    for i, line in enumerate(original):
        if not trivial(norm(line)):
            where[norm(line)].append(i)
    windows: list[Window] = []
    for number, piece in enumerate(pieces, start=1):
        hits = sorted({i for x in piece for i in where.get(norm(x), ())
                       if len(where[norm(x)]) <= MAX_OCCURRENCES})
        cluster = _densest(hits, len(piece))
        if not cluster:
            return f"edit piece {number} shares no distinctive line with the file"
        # The piece reaches as far before its first anchor and after its last one as its
        # own lines do: lines it changes there must be inside the window, not in the
        # margin that is pre-filled as unchanged.
        at = {norm(x): k for k, x in reversed(list(enumerate(piece)))}
        first = max(0, cluster[0] - at[norm(original[cluster[0]])])
        last = cluster[-1] + len(piece) - at[norm(original[cluster[-1]])]
        start = max(0, first - MARGIN)
        end = min(len(original), max(cluster[-1] + 1, last) + MARGIN)
        windows.append(Window(start, end, first, cluster[-1] + 1, [piece]))
    windows.sort(key=lambda w: w.start)
    merged: list[Window] = []
    for window in windows:
        if merged and window.start <= merged[-1].end:
            last = merged[-1]
            last.end = max(last.end, window.end)
            last.inner_end = max(last.inner_end, window.inner_end)
            last.pieces.extend(window.pieces)
        else:
            merged.append(window)
    too_big = [w for w in merged if w.end - w.start > MAX_WINDOW_LINES]
    if too_big:
        return (f"edit touches {too_big[0].end - too_big[0].start} lines in one place (lines "
                f"{too_big[0].start + 1}-{too_big[0].end}); the model path handles at most "
                f"{MAX_WINDOW_LINES}")
    return merged


def _densest(hits: list[int], size: int) -> list[int]:
    """The run of anchor lines closest together (gaps up to the piece size plus slack)."""
    best: list[int] = []
    run: list[int] = []
    for i in hits:
        if run and i - run[-1] > size + MAX_OCCURRENCES * 4:
            run = []
        run.append(i)
        if len(run) > len(best):
            best = list(run)
    return best


@dataclass
class Job:
    """One window's decoding task: the prompt, the drafts and the token budget."""
    window: Window
    region: list[str]
    head: list[str]  # the window's unchanged first lines, pre-filled in the answer
    prompt: list[int]
    sources: list[list[int]]
    budget: int


def jobs(model: LocalModel, original: list[str], parsed: ParsedEdit, path: str
         ) -> list[Job] | str:
    """The decoding tasks for every window the edit touches, or why there are none."""
    edge = open_edge(original, parsed)
    if edge:
        return edge
    planned = plan_windows(original, pieces_of(parsed))
    if isinstance(planned, str):
        return planned
    out = []
    for window in planned:
        region = original[window.start:window.end]
        head = _head(region, window.inner_start - window.start, window.pieces[0])
        # Drafts: the original window (the model closes its answer with a fence right after
        # it), then each edit piece, which is what the output follows through changed lines.
        sources = [model.tokenize("\n".join(region) + "\n```"),
                   *(model.tokenize("\n".join(piece) + "\n") for piece in window.pieces)]
        out.append(Job(window, region, head, _prompt(model, region, head, window.pieces, path),
                       sources, _budget(model, region, window.pieces)))
    return out


def open_edge(original: list[str], parsed: ParsedEdit) -> str | None:
    """A sketch without a marker before its first line (or after its last) says the file
    starts (ends) there; if the file does not, the lines beyond are either deleted or the
    marker was forgotten. Nobody can tell, the model neither (its window's margin would
    keep them): decline, as the deterministic path does."""
    sketch = parsed.sketch
    if sketch is None or sketch.marker_free or not sketch.segments:
        return None
    content = [x for x in original if x.strip()]
    first = [x for x in sketch.segments[0] if x.strip()]
    last = [x for x in sketch.segments[-1] if x.strip()]
    if not content or not first or not last:
        return None
    if not sketch.gap_before and norm(first[0]) != norm(content[0]):
        return ("the edit starts without a marker, but not like the file: are the lines "
                "before it deleted or was the marker forgotten?")
    if not sketch.gap_after and norm(last[-1]) != norm(content[-1]):
        return ("the edit ends without a marker, but not like the file: are the lines after "
                "it deleted or was the marker forgotten?")
    return None


def _head(region: list[str], before: int, piece: list[str]) -> list[str]:
    """The window's first lines that are certain: the margin before the first anchor, and
    beyond it the edit's leading context where it repeats the window verbatim. They are
    pre-filled in the answer, so the model starts right where the edit changes something
    (a small model otherwise tends to echo the edit, markers and all, before the original)."""
    best = (0, before)
    for at in range(len(region)):
        same = 0
        while same < min(len(piece) - 1, len(region) - at) and region[at + same] == piece[same]:
            same += 1
        if same and any(not trivial(norm(x)) for x in piece[:same]) and same > best[0]:
            best = (same, at + same)
    return region[:max(before, best[1])]


def rewrite(ctx: JobContext, original: list[str], parsed: ParsedEdit, path: str,
            speculative: bool = True) -> Rewrite:
    """The engine job `apply.rewrite`: every window decoded in the model's worker."""
    model = ctx.model
    planned = jobs(model, original, parsed, path)
    if isinstance(planned, str):
        return Rewrite(None, [planned])
    result = Rewrite(None)
    out: list[str] = []
    at = 0
    for job in planned:
        watch = Watch(job.region, [_shown(p) for p in job.window.pieces], job.head)
        run = decode(model, job.prompt, job.sources, max_tokens=job.budget,
                     speculative=speculative, guide=watch)
        result.runs.append(run)
        new = job.head + (run.text.rstrip("\n").split("\n") if run.text.strip() else [])
        new = _finish(job.region, new, run, job.window)
        if isinstance(new, str):
            result.reasons.append(new)
            return result
        out.extend(original[at:job.window.start])
        out.extend(new)
        at = job.window.end
    out.extend(original[at:])
    result.merged = _sketch_edges(out, parsed)
    return result


def _sketch_edges(lines: list[str], parsed: ParsedEdit) -> list[str]:
    """A sketch without a marker at its start (end) shows the file's very start (end): the
    blank lines there are the sketch's, as the deterministic path has it (`open_edge`
    already declined when the code there differs)."""
    sketch = parsed.sketch
    if sketch is None or sketch.marker_free or not sketch.segments:
        return lines
    if not sketch.gap_after:
        ends = sketch.segments[-1]
        tail = len(ends) - len(_strip_blank_end(ends))
        lines = _strip_blank_end(lines) + ends[len(ends) - tail:]
    if not sketch.gap_before:
        starts = sketch.segments[0]
        head = len(starts) - len(_strip_blank_end(starts[::-1]))
        lines = starts[:head] + _strip_blank_end(lines[::-1])[::-1]
    return lines


def _strip_blank_end(lines: list[str]) -> list[str]:
    end = len(lines)
    while end and not lines[end - 1].strip():
        end -= 1
    return lines[:end]


def _prompt(model: LocalModel, region: list[str], head: list[str], pieces: list[list[str]],
            path: str) -> list[int]:
    """Chat prompt whose answer is already started with the window's unchanged first lines,
    so even a small model starts copying the original instead of echoing the edit."""
    language = language_for(path) or ""
    marker = ("# " if language in _HASH_COMMENT else "// ") + "... existing code ..."
    edit = f"\n{marker}\n".join("\n".join(p) for p in pieces)
    user = (f"Original code from {path}:\n```{language}\n" + "\n".join(region) + "\n```\n\n"
            f"Edit:\n```{language}\n{marker}\n{edit}\n{marker}\n```\n\n"
            "Write the updated original code.")
    text = model.render_chat([{"role": "system", "content": SYSTEM},
                              {"role": "user", "content": user}])
    started = "".join(line + "\n" for line in head)
    return model.tokenize(text + f"```{language}\n{started}", special=True)


def _budget(model: LocalModel, region: list[str], pieces: list[list[str]]) -> int:
    """Enough tokens for the whole region plus every edit line, with slack."""
    chars = sum(len(x) + 1 for x in region) + sum(len(x) + 1 for p in pieces for x in p)
    return 64 + chars // 2


def _finish(region: list[str], new: list[str], run: Decoded, window: Window
            ) -> list[str] | str:
    """The new window, or why the model's output cannot be trusted. The output must reach at
    least the last anchor line (unchanged context after the edit) and must contain every line
    the edit shows; where it stops in the trailing margin, the rest of the window (blank lines
    included) is re-attached from the original."""
    where = f"lines {window.start + 1}-{window.end}"
    if run.finish_reason == "rejected":
        return (f"model output for {where} left the merge's shape at {new[-1].strip()!r} "
                "(a line in neither the original nor the edit, or a piece not kept whole "
                "and in order); decoding stopped there")
    if run.finish_reason != "stop":
        return f"model output for {where} hit the token limit (truncated)"
    while new and not new[-1].strip():
        new = new[:-1]
    written = {norm(x) for x in new}
    missing = [x for piece in window.pieces for x in _shown(piece)
               if not trivial(norm(x)) and norm(x) not in written]
    if missing:
        return f"model output for {where} lacks the edit's line {missing[0].strip()!r}"
    end = _stop_line(region, new, window.inner_end - 1 - window.start)
    if end is None:
        return (f"model output for {where} does not end with the unchanged lines after the "
                "edit (truncated or rewritten beyond the edit)")
    shaped = reshape(region, new + region[end:], [_shown(p) for p in window.pieces])
    if shaped is None:
        return (f"model output for {where} is not the original with the edit's pieces "
                "spliced in (a line that is in neither, or a piece not kept whole and in "
                "order)")
    return shaped


def reshape(region: list[str], out: list[str], pieces: list[list[str]]) -> list[str] | None:
    """`out` read as the only shape a merge can have (see `Shape`): the merged lines with
    the original's bytes for original lines and the piece's bytes (shifted to the
    indentation the model gave them) for piece lines, or None when `out` has another shape
    (a line in neither, a piece cut or out of order): such an output is wrong whatever the
    model meant, and nothing is merged."""
    shape = Shape(region, pieces)
    if not all(shape.feed(line) for line in out):
        return None
    path = shape.end()
    return None if path is None else _render(region, out, pieces, path)


class Shape:
    """The merge's only possible shape: original lines in order, with each piece spliced in
    whole, in order, in place of some (possibly no) original lines:
    region[:a1] + piece1 + region[b1:a2] + piece2 + ... + region[bk:]. Lines compare with
    whitespace collapsed. Fed line by line, so a decode can stop at the first line that
    breaks it.

    A nondeterministic scan: a state is (pieces done, region position, may skip region
    lines, position in the current piece or -1), its value the path so far (per output line
    (piece number, index), or (-1, region index)). A state that may skip original lines
    keeps only its lowest position, which dominates the others, so the state sets stay
    small."""

    def __init__(self, region: list[str], pieces: list[list[str]]) -> None:
        self.keys = [norm(x) for x in region]
        self.occurs: dict[str, list[int]] = defaultdict(list)
        for i, key in enumerate(self.keys):
            self.occurs[key].append(i)
        self.shown = [[norm(x) for x in p] for p in pieces]
        self.states = self._close({(0, 0, False, -1): ()})

    def feed(self, line: str) -> bool:
        """Read one output line; False once no reading is left."""
        key, shown = norm(line), self.shown
        step: dict[tuple[int, int, bool, int], tuple] = {}
        for (done, i, skip, j), path in self.states.items():
            if j >= 0:  # inside piece `done`
                if shown[done][j] == key:
                    after = (done + 1, i, True, -1) if j + 1 == len(shown[done]) else \
                        (done, i, skip, j + 1)
                    step.setdefault(after, path + ((done, j),))
                continue
            for b in ([b for b in self.occurs.get(key, ()) if b >= i] if skip
                      else [i] if i < len(self.keys) and self.keys[i] == key else []):
                step.setdefault((done, b + 1, False, -1), path + ((-1, b),))
            if done < len(shown) and shown[done] and shown[done][0] == key:
                after = (done + 1, i, True, -1) if len(shown[done]) == 1 else \
                    (done, i, True, 1)
                step.setdefault(after, path + ((done, 0),))
        self.states = self._close(step)
        return bool(self.states)

    def end(self) -> tuple | None:
        """The path of a complete reading (every piece placed, the region used up or
        skipped to its end), or None."""
        return next((path for (done, i, skip, j), path in self.states.items()
                     if done == len(self.shown) and j < 0
                     and (skip or i == len(self.keys))), None)

    def _close(self, states: dict) -> dict:
        """Add the states reached without reading a line (an empty piece spliced in), and
        drop skipping states dominated by one at a lower region position."""
        todo = list(states.items())
        while todo:
            (done, i, skip, j), path = todo.pop()
            if j < 0 and done < len(self.shown) and not self.shown[done]:
                state = (done + 1, i, True, -1)
                if state not in states:
                    states[state] = path
                    todo.append((state, path))
        low: dict[tuple[int, int], int] = {}
        for done, i, skip, j in states:
            if skip:
                low[done, j] = min(low.get((done, j), i), i)
        return {s: p for s, p in states.items() if not s[2] or low[s[0], s[3]] == s[1]}


class Watch:
    """The decode's guide: `Shape` fed while the model decodes (after the pre-filled head),
    so a decode stops at its first impossible line. Blank lines wait for the next non-blank
    one (a blank line the model adds at the very end is dropped later, not an error).

    It also forces what is certain: once the model has started a piece and every reading
    left is inside that piece, the rest of the piece comes next, and when the model wants
    to stop in the middle of a piece (it took the piece's context for the end of the
    code), the rest of the piece comes before the end. The model decides where pieces go;
    it does not get to drop or rewrite their lines (the 0.5B model often did)."""

    def __init__(self, region: list[str], pieces: list[list[str]], head: list[str]) -> None:
        self.shape = Shape(region, pieces)
        self.region, self.pieces, self.repairs = region, pieces, 0
        self.lines: list[str] = []  # fed to the shape
        self.blanks: list[str] = []
        for line in head:  # original lines: always a valid start
            self.feed(line)

    def feed(self, line: str) -> bool:
        """Read one line; a line that breaks the shape is not taken (see `repair`)."""
        if not line.strip():
            self.blanks.append(line)
            return True
        saved, lines = self.shape.states, [*self.blanks, line]
        if all(self.shape.feed(x) for x in lines):
            self.lines += lines
            self.blanks = []
            return True
        self.shape.states = saved
        return False

    def repair(self, line: str) -> str | None:
        """What replaces a refused `line` (and the blank lines before it): the rest of the
        piece the output is in, or the original's next lines where the output is a plain
        copy, whichever the refused line resembles more (the 0.5B model writes
        `# ... existing code ...` where it means "the original goes on", or drifts inside
        a piece). None (reject) when neither is certain or after a few repairs."""
        self.repairs += 1
        states = self.shape.states
        inside = {(done, j) for done, _, _, j in states if j >= 0}
        copying = {i for _, i, skip, j in states if j < 0 and not skip}
        after = {(done, i) for done, i, skip, j in states if j < 0 and skip}
        options = []
        if is_marker(line) and not inside and not copying and len(after) == 1:
            resumed = self._resume(*after.pop())
            options += [(line, resumed)] if resumed else []
        if len(inside) == 1:
            done, j = next(iter(inside))
            options.append((self.pieces[done][j], self.force(False, anyway=True)))
        if len(copying) == 1 and (i := copying.pop()) < len(self.shape.keys):
            k = next((k for k in range(i, len(self.region)) if self.region[k].strip()), i)
            if is_marker(line):  # "unchanged up to the next piece": copy up to its start
                options = []
                done = min(done for done, _, _, j in states if j < 0)
                starts = self.shape.occurs.get(self.shape.shown[done][0], []) \
                    if done < len(self.pieces) and self.pieces[done] else []
                k = max(k, next((b - 1 for b in starts if b > i), k))
            options.append((self.region[k], "".join(x + "\n" for x in self.region[i:k + 1])))
        if self.repairs > MAX_REPAIRS or not options:
            return None
        self.blanks = []
        return max(options, key=lambda o: SequenceMatcher(None, norm(o[0]),
                                                          norm(line)).ratio())[1]

    def _resume(self, done: int, start: int) -> str | None:
        """A marker right after piece `done - 1` (which began at region line `start`): the
        original goes on right after the piece's last line (its first copy from `start`
        on: a later copy would delete code the marker stands for) up to the next piece's
        first line, or to the window's end. None where the piece's last line is new or
        the next piece's first line does not follow."""
        last = next((norm(x) for x in reversed(self.pieces[done - 1]) if x.strip()), None) \
            if done else None
        at = next((b for b in self.shape.occurs.get(last, []) if b >= start), None) \
            if last else None
        if at is None:
            return None
        end: int | None = len(self.region)
        if done < len(self.pieces) and self.shape.shown[done]:
            end = next((b for b in self.shape.occurs.get(self.shape.shown[done][0], [])
                        if b > at), None)
        if end is None or end <= at + 1:
            return None
        return "".join(x + "\n" for x in self.region[at + 1:end])

    def force(self, stopping: bool, anyway: bool = False) -> str | None:
        states = self.shape.states
        inside = {(done, j) for done, _, _, j in states if j >= 0}
        if not anyway and (self.blanks or len(inside) != 1 or (
                self.shape.end() is not None if stopping else len(inside) != len(states))):
            return None
        done, j = inside.pop()
        path = next(p for (d, _, _, k), p in states.items() if (d, k) == (done, j))
        piece = self.pieces[done]
        delta, prefix = _shift_of(self.lines, piece,
                                  [(k, i) for k, (q, i) in enumerate(path) if q == done])
        return "".join(_shifted(line, delta, prefix) + "\n" for line in piece[j:])


def _render(region: list[str], out: list[str], pieces: list[list[str]], path: tuple
            ) -> list[str]:
    """Original lines as the original has them; piece lines as the piece has them, shifted
    by the indentation most of the piece's lines got from the model (a piece written at
    column 0 is put back at its place; a line the model alone re-indented keeps the piece's
    relative indentation)."""
    shifts = [_shift_of(out, pieces[p], [(k, j) for k, (q, j) in enumerate(path) if q == p])
              for p in range(len(pieces))]
    result: list[str] = []
    last = (-1, -1)
    for p, j in path:
        if p < 0:
            if last[0] >= 0 and last[1] == len(pieces[last[0]]) - 1:
                result.extend(_blanks_between(region, pieces[last[0]][-1], j, -1))
            result.append(region[j])
        else:
            if j == 0 and last[0] < 0 <= last[1]:
                result.extend(_blanks_between(region, pieces[p][0], last[1], 1))
            result.append(_shifted(pieces[p][j], *shifts[p]))
        last = (p, j)
    return result


def _blanks_between(region: list[str], edge: str, at: int, step: int) -> list[str]:
    """The original's blank lines the model dropped where a piece meets the original: going
    from region line `at` by `step` over blank lines, is the next line the piece's edge
    line (its context)? Then those blank lines separate the two and stay (a sketch's
    segment does not show the blank lines next to its markers; the 0.5B model then often
    leaves them out)."""
    k = at + step
    while 0 <= k < len(region) and not region[k].strip():
        k += step
    if k == at + step or not 0 <= k < len(region) or norm(region[k]) != norm(edge):
        return []
    return region[min(k, at) + 1:max(k, at)]


def _shifted(line: str, delta: int, prefix: str) -> str:
    if line.strip() and delta > 0:
        return prefix + line
    if line.strip() and delta < 0:
        return line[min(-delta, len(_indent(line))):]
    return line


def _shift_of(out: list[str], piece: list[str], rows: list[tuple[int, int]]
              ) -> tuple[int, str]:
    """The indentation change (in characters, and the characters to add) most non-blank
    lines of the piece got in the output."""
    counts: dict[int, int] = defaultdict(int)
    prefix: dict[int, str] = {}
    for k, j in rows:
        if out[k].strip():
            delta = len(_indent(out[k])) - len(_indent(piece[j]))
            counts[delta] += 1
            prefix.setdefault(delta, _indent(out[k])[:max(0, delta)])
    if not counts:
        return 0, ""
    delta = max(counts, key=lambda d: (counts[d], d == 0))
    return delta, prefix[delta]


def _indent(line: str) -> str:
    return line[:len(line) - len(line.lstrip())]


def _stop_line(region: list[str], new: list[str], last_anchor: int) -> int | None:
    """Where in the region the output stopped (index after its last line): the place at or
    after the last anchor whose preceding lines agree longest with the output's end."""
    best, where = 0, None
    for end in range(last_anchor + 1, len(region) + 1):
        same = 0
        while same < min(len(new), end) and norm(new[-1 - same]) == norm(region[end - 1 - same]):
            same += 1
        if same > best:
            best, where = same, end
    return where


def _shown(piece: list[str]) -> list[str]:
    """The lines an edit piece says the result contains (a SEARCH/REPLACE block: its
    replacement)."""
    if piece and piece[0] == "<<<<<<< SEARCH":
        return piece[piece.index("=======") + 1:-1]
    return piece
