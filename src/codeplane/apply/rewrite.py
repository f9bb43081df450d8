"""Model path: the local model rewrites only the windows of the file the edit touches.

Each edit piece (sketch segment, SEARCH block, diff hunk) is located by its distinctive lines;
the window is that place plus a few unchanged lines on each side. The model sees the window and
the pieces and writes the new window, decoded speculatively with the window as the draft. The
unchanged margin lines must come back unchanged: that catches truncated or wandering output.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from codeplane.apply.align import norm, trivial
from codeplane.apply.formats import ParsedEdit
from codeplane.apply.speculative import Decoded, decode
from codeplane.apply.validate import language_for
from codeplane.models.engine import LocalModel

MAX_OCCURRENCES = 6  # a line more frequent than this in the file locates nothing
MARGIN = 3  # unchanged lines kept on each side of a window
MAX_WINDOW_LINES = 300  # beyond this the model path declines (prompt + output must fit n_ctx)
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
        start = max(0, cluster[0] - MARGIN)
        end = min(len(original), cluster[-1] + 1 + MARGIN)
        windows.append(Window(start, end, cluster[0], cluster[-1] + 1, [piece]))
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


def rewrite(model: LocalModel, original: list[str], parsed: ParsedEdit, path: str,
            speculative: bool = True) -> Rewrite:
    planned = jobs(model, original, parsed, path)
    if isinstance(planned, str):
        return Rewrite(None, [planned])
    result = Rewrite(None)
    out: list[str] = []
    at = 0
    for job in planned:
        run = decode(model, job.prompt, job.sources, max_tokens=job.budget,
                     speculative=speculative)
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
    result.merged = out
    return result


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
    return new + region[end:]


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
