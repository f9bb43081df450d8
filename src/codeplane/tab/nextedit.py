"""Next-edit Tab: from the user's recent edits, propose the next one - a rewrite of lines near
the cursor, and optionally a jump to where the same change is due next.

FIM Tab (`service.py`) inserts text at the cursor; this module rewrites a window of the file
around it (Zeta / Sweep style: the model reads the recent edits as before/after snippets and
the current window, and writes the window as it should be next). The base model has no
training for this yet (issue 34 item 4), so the prompt is built from what Qwen2.5-Coder saw
in pre-training: `<|file_sep|>` between files, and diffs. Three formats (docs/tab.md, "Next
edit", has their numbers):

* `window`: history as `original:`/`updated:` blocks, then `current/PATH` (the window) and
  `updated/PATH`, after which the model writes the whole updated window;
* `cursor`: the same, but the prompt's `updated/PATH` already holds the window's lines above
  the cursor's line, so the model writes from the cursor's line on: every output token
  costs a forward pass row, and the lines above the cursor were a copy (or, prefilled on a
  pause, cost nothing at request time). It cannot change a line above the cursor;
* `diff`: history as `-`/`+` lines, then the window and `PATH.diff`, after which the model
  writes only the lines it removes (`-`), adds (`+`) and keeps as context (` `).

Either way the answer is the smallest line range of the window that changed, and its new
text. The rewrite mostly copies the window, so it is decoded speculatively with the window as
the draft (the prompt-lookup decoder apply also uses, `models/speculative.py`). Before the
model, the kinds of change that need none (`tab/kinds.py`: the newest edit's change again
near the cursor) answer when they fire. A jump is the next place,
outside the suggestion, where the last edit's one-word change is still due: in this file,
else in the editor's other open files (`open_files`, which serve the jump only).
"""

from __future__ import annotations

import math
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from difflib import SequenceMatcher
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from codeplane.config import TabSettings
from codeplane.models.engine import JobDropped, LocalModel
from codeplane.models.jobs import JobContext
from codeplane.tab import decision, kinds, words
from codeplane.tab.backend import Prefilled
from codeplane.tab.kinds import Suggestion
from codeplane.tab.service import Snippet, TabService, local_tab, worker_slots
from codeplane.tab.words import occurrences

WINDOW_BEFORE, WINDOW_AFTER = 10, 10  # a 21-line window around the cursor, as Sweep's
MAX_HISTORY_CHARS = 6000  # edits beyond this (oldest first) are left out of the prompt
MAX_OPEN_FILES = 8  # the editor's other open files a request may carry (for jumps only)
MAX_OPEN_FILE_CHARS = 100_000
DIFF_MAX_TOKENS = 160
WINDOW_SLACK_TOKENS = 48  # the updated window may be this much longer than the current one
JOIN_LINES = 2  # a `window` rewrite that copies this many lines after a change is done
Format = Literal["window", "cursor", "diff"]
DEFAULT_FORMAT: Format = "cursor"  # the route's and the adapter's (docs/tab.md, "Next edit")


class EditIn(BaseModel):
    """One recent edit: lines starting at `line` (0-based, after the edit) were `before`
    and are now `after` (`tab/history.py` makes them)."""

    path: str = Field(max_length=4096)
    line: int = Field(ge=0, le=10_000_000)
    before: str = Field(max_length=8000)
    after: str = Field(max_length=8000)


class Position(BaseModel):
    line: int = Field(ge=0)
    character: int = Field(ge=0)


class OpenFile(BaseModel):
    """Another document open in the editor, where a jump may lead. `path` is a label the
    answer's jump names, never opened on the host; a control character in it is refused
    as no editor's path."""

    model_config = {"extra": "forbid"}
    path: str = Field(min_length=1, max_length=4096, pattern=r"^[^\x00-\x1f\x7f]+$")
    text: str = Field(max_length=MAX_OPEN_FILE_CHARS)


class NextRequest(BaseModel):
    model_config = {"extra": "forbid"}
    path: str = Field(max_length=4096)
    text: str = Field(max_length=400_000)
    cursor: Position
    edits: list[EditIn] = Field(default_factory=list, max_length=32)
    context: list[Snippet] = Field(default_factory=list, max_length=16)
    # where a jump may go when the current file has no occurrence left, in the order to
    # look (most recently edited first); used for this request only, not in the prompt
    open_files: list[OpenFile] = Field(default_factory=list, max_length=MAX_OPEN_FILES)
    format: Format = DEFAULT_FORMAT
    cursor_id: str = Field("default", max_length=200)
    request_id: str | None = Field(None, max_length=200)
    model: str | None = Field(None, max_length=200)
    max_tokens: int | None = Field(None, ge=1, le=1024)

    @model_validator(mode="after")
    def _cursor_in_text(self) -> NextRequest:
        lines = self.text.split("\n")
        if self.cursor.line >= len(lines) or self.cursor.character > len(lines[self.cursor.line]):
            raise ValueError(f"cursor {self.cursor.line}:{self.cursor.character} is outside "
                             f"the text ({len(lines)} lines)")
        return self

    @model_validator(mode="after")
    def _other_files(self) -> NextRequest:
        """A jump names one file: each open file once, none of them the current one."""
        paths = [f.path for f in self.open_files]
        if self.path in paths or len(set(paths)) != len(paths):
            raise ValueError("open_files must be other files than `path`, each named once")
        return self

    def for_model(self) -> NextRequest:
        """The request the engine job gets: the open files serve the jump, found on the
        server, so their text does not travel to the model's worker."""
        return self.model_copy(update={"open_files": []}) if self.open_files else self


@dataclass
class Prediction:
    """What the engine job returns (picklable: it leaves the worker)."""

    suggestion: Suggestion | None
    raw: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    drafted: int
    accepted: int
    model_ms: float
    prompt_ms: float = 0.0  # evaluating the prompt tokens the KV cache did not hold
    decode_ms: float = 0.0  # writing the answer (forward passes over drafts)
    min_logprob: float = 0.0  # over the output tokens the model chose
    sum_logprob: float = 0.0  # log P(the whole output): copied tokens add almost nothing
    passes: int = 0  # the decode's forward passes (each verifies a draft or writes a token)


# -- show or hide (tab/decision.py's mechanism, next edit's signals) ---------------------------


@dataclass(frozen=True)
class NextSignals:
    """What the show/hide rule reads about a next-edit suggestion; known when it is made."""

    min_logprob: float  # the least likely output token (0 for the baseline's suggestion)
    sum_logprob: float  # log P(output): the surprise of the changed part
    changed_lines: int  # lines the suggestion removes plus lines it writes
    distance: int  # lines between the cursor and the suggestion's first line
    agrees: bool  # the model's suggestion is the repeat-the-last-edit baseline's
    repeat: bool  # the suggestion is the baseline's (the model proposed nothing)

    def to_json(self) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}


NEXT_FEATURES = ("min_logprob", "sum_logprob", "log_changed_lines", "log_distance", "agrees",
                 "repeat")
# To be fitted by `bench/nextedit.py --fit` on the tuning repositories' `window` rows
# (docs/tab.md, "Next edit", "Show or hide"); a suggestion is shown when P(exact) >=
# NEXT_MIN_PROBABILITY. Not fitted yet: every suggestion scores 0.5 and is shown.
NEXT_COEFFICIENTS = {"intercept": 0.0, "min_logprob": 0.0, "sum_logprob": 0.0,
                     "log_changed_lines": 0.0, "log_distance": 0.0, "agrees": 0.0,
                     "repeat": 0.0}
NEXT_MIN_PROBABILITY = 0.0


def next_features(s: NextSignals) -> dict[str, float]:
    return {"min_logprob": s.min_logprob, "sum_logprob": max(s.sum_logprob, -50.0),
            "log_changed_lines": math.log1p(s.changed_lines),
            "log_distance": math.log1p(s.distance), "agrees": float(s.agrees),
            "repeat": float(s.repeat)}


def next_signals(req: NextRequest, got: Prediction | None, suggestion: Suggestion,
                 source: str) -> NextSignals:
    """The signals of the suggestion served for `req` (`source`: "model", "repeat" or a
    kind of `tab/kinds.py`)."""
    baseline = repeat_last_edit(req)
    model = source == "model" and got is not None
    removed = suggestion.end_line - suggestion.start_line
    return NextSignals(
        min_logprob=got.min_logprob if model else 0.0,
        sum_logprob=got.sum_logprob if model else 0.0,
        changed_lines=removed + suggestion.text.count("\n"),
        distance=abs(suggestion.start_line - req.cursor.line),
        agrees=baseline is not None and baseline.apply(req.text) == suggestion.apply(req.text),
        repeat=source == "repeat")


def next_probability(s: NextSignals,
                     coefficients: dict[str, float] = NEXT_COEFFICIENTS) -> float:
    """P(the suggestion is exactly the next edit | signals) under the fitted rule."""
    return decision.logistic(next_features(s), coefficients)


# -- prompt and answer (pure) ----------------------------------------------------------------


def window_of(text: str, line: int) -> tuple[int, list[str]]:
    """(first line, lines with their newlines) of the window around the cursor line."""
    lines = text.splitlines(keepends=True)
    start = max(0, min(line, len(lines)) - WINDOW_BEFORE)
    return start, lines[start:line + WINDOW_AFTER + 1]


def prompt_parts(req: NextRequest, fmt: Format) -> tuple[list[tuple[str, bool]], str, str]:
    """The prompt as (text, is_control) pieces - user text is never tokenized as control
    tokens -, the window's text (the draft) and the start of the answer the prompt already
    holds. Left free, the base model ends the file at once (a control token), so the answer
    is begun for it: the window's first line (`window`), its lines above the cursor's line
    (`cursor`, at least the first), a hunk header (`diff`)."""
    start, window = window_of(req.text, req.cursor.line)
    current = "".join(window)
    sep = ("<|file_sep|>", True)
    parts: list[tuple[str, bool]] = [("<|repo_name|>", True), ("workspace\n", False)]
    for s in req.context:
        parts += [sep, (f"{s.path}\n{s.text.rstrip()}\n", False)]
    for e in _recent(req.edits):
        parts += [sep, (_history_block(e, fmt), False)]
    if fmt != "diff":
        above = max(1, req.cursor.line - start) if fmt == "cursor" else 1
        lead = "".join(window[:above]) if len(window) > above else ""
        parts += [sep, (f"current/{req.path}\n{current}", False),
                  sep, (f"updated/{req.path}\n{lead}", False)]
    else:
        lead = f"@@ line {req.cursor.line + 1} @@\n"
        parts += [sep, (f"{req.path}\n{current}", False), sep, (f"{req.path}.diff\n{lead}", False)]
    return parts, current, lead


def target(req: NextRequest, updated: list[str]) -> str | None:
    """What the decode after `req`'s prompt should write when the window is to become
    `updated` (its lines): the next-edit adapter's training answer (`rl/nextedit.py`), the
    end token not included. `window`: the whole updated window after the prompt's lead;
    `cursor`: from the cursor's line to JOIN_LINES lines after the last change, where the
    decode's guide stops anyway - and nothing at all when nothing changes, a one-token
    answer. None when the prompt's lead is not the start of `updated` (a change above the
    cursor for `cursor`, on the first line for `window`); `diff` has no such answer."""
    if req.format == "diff":
        return None
    _, _, lead = prompt_parts(req, req.format)
    text = "".join(updated)
    if not text.startswith(lead):
        return None
    if req.format == "cursor":
        _, window = window_of(req.text, req.cursor.line)
        ops = [op for op in SequenceMatcher(None, window, updated, autojunk=False).get_opcodes()
               if op[0] != "equal"]
        cut = "".join(updated[:ops[-1][4] + JOIN_LINES]) if ops else lead
        text = cut if cut.startswith(lead) else text
    return text[len(lead):]


def answer_budget(req: NextRequest, tokenize: Callable[[str], list[int]]) -> int:
    """The decode's token budget for a `window` or `cursor` answer: the window's text after
    the prompt's lead (the lines the answer rewrites), WINDOW_SLACK_TOKENS more for what
    it adds. The trainer drops an example whose answer would not fit (`rl/nextedit.py`)."""
    _, current, lead = prompt_parts(req, req.format)
    return len(tokenize(current[len(lead):])) + WINDOW_SLACK_TOKENS


def rewrite_of(req: NextRequest, output: str) -> str:
    """The text `predict` parses when the decode wrote `output` and ended (`window` and
    `cursor`): the guide's splice when the rewrite re-joined the window on the way (the
    decode stops there), else the prompt's lead and the output. Training answers are
    checked through it (`rl/nextedit.py`): they are read as the product reads them."""
    _, window = window_of(req.text, req.cursor.line)
    _, current, lead = prompt_parts(req, req.format)
    watch = _Watch(threading.Event(), current.count("\n") + 8, window, lead, JOIN_LINES)
    for line in (output + "\n").split("\n")[:-1]:  # the decode's last line too, at its end
        if not watch.feed(line):
            break
    return watch.spliced if watch.spliced is not None else lead + output


def _recent(edits: list[EditIn]) -> list[EditIn]:
    """The newest edits that fit MAX_HISTORY_CHARS, oldest first."""
    kept: list[EditIn] = []
    size = 0
    for e in reversed(edits):
        size += len(e.before) + len(e.after)
        if size > MAX_HISTORY_CHARS:
            break
        kept.append(e)
    return kept[::-1]


def _history_block(e: EditIn, fmt: Format) -> str:
    if fmt != "diff":
        return f"{e.path}.diff\noriginal:\n{_nl(e.before)}updated:\n{_nl(e.after)}"
    minus = "".join(f"-{x}\n" for x in e.before.splitlines())
    plus = "".join(f"+{x}\n" for x in e.after.splitlines())
    return f"{e.path}.diff\n@@ line {e.line + 1} @@\n{minus}{plus}"


def _nl(text: str) -> str:
    return text if not text or text.endswith("\n") else text + "\n"


def parse(raw: str, fmt: Format, req: NextRequest) -> Suggestion | None:
    """The model's output as the smallest changed line range of the window, or None when it
    changes nothing or cannot be used."""
    start, window = window_of(req.text, req.cursor.line)
    if fmt == "diff":
        return _apply_hunk(raw, start, window, req.cursor.line)
    new = raw.splitlines(keepends=True)
    if window and not window[-1].endswith("\n") and new and new[-1].endswith("\n"):
        new[-1] = new[-1][:-1]
    if new and new[-1] in window and len(new) < len(window):
        # the base model often stops before the window's end: a rewrite that ends on one of
        # the window's lines leaves the rest of the window as it is
        spots = [i for i, line in enumerate(window) if line == new[-1]]
        cut = min(spots, key=lambda i: abs(i - len(new) + 1)) + 1
        return _changed(start, window[:cut], new)
    return _changed(start, window, new)


def _apply_hunk(raw: str, start: int, window: list[str], cursor: int) -> Suggestion | None:
    """Apply a `-`/`+`/` ` hunk to the window at the place of its old lines nearest the
    cursor; output after the hunk's lines (a new header, prose) is ignored."""
    old: list[str] = []
    new: list[str] = []
    for line in raw.splitlines(keepends=True):
        if line.startswith("@@") and not old and not new:
            continue
        if not line or line[0] not in "-+ ":
            break
        if line[0] in "- ":
            old.append(_nl(line[1:]))
        if line[0] in "+ ":
            new.append(_nl(line[1:]))
    plain = [_nl(x) for x in window]
    if not old:
        return None
    spots = [i for i in range(len(plain) - len(old) + 1) if plain[i:i + len(old)] == old]
    if not spots:
        return None
    at = min(spots, key=lambda i: abs(start + i - cursor))
    merged = window[:at] + new + window[at + len(old):]
    if window and not window[-1].endswith("\n") and merged and merged[-1].endswith("\n"):
        merged[-1] = merged[-1][:-1]
    return _changed(start, window, merged)


def _changed(start: int, old: list[str], new: list[str]) -> Suggestion | None:
    """The one block spanning every change between window lines and their rewrite (None:
    nothing changed)."""
    ops = [op for op in SequenceMatcher(None, old, new, autojunk=False).get_opcodes()
           if op[0] != "equal"]
    if not ops:
        return None
    first, last = ops[0], ops[-1]
    return Suggestion(start + first[1], start + last[2], "".join(new[first[3]:last[4]]))


def word_change(edits: list[EditIn]) -> tuple[str, str] | None:
    """(old word, new word) when the newest edit replaced exactly one identifier."""
    return words.word_change(edits[-1].before, edits[-1].after) if edits else None


def repeat_last_edit(req: NextRequest) -> Suggestion | None:
    """The baseline: the newest edit's one-word change, made again at the occurrence of the
    old word nearest the cursor (after it first)."""
    change = word_change(req.edits)
    if change is None:
        return None
    old, new = change
    lines = req.text.splitlines(keepends=True)
    spots = occurrences(req.text, old)
    spots = [n for n in spots if n < len(lines)]
    if not spots:
        return None
    line = kinds.nearest(spots, req.cursor.line)
    pattern = re.compile(rf"(?<!\w){re.escape(old)}(?!\w)")
    return Suggestion(line, line + 1, pattern.sub(new, lines[line], count=1))


def near_repeat(req: NextRequest) -> Suggestion | None:
    """When the model proposes nothing: the baseline's suggestion if it lies in the window
    (farther away it is a jump, not a rewrite near the cursor)."""
    found = repeat_last_edit(req)
    start, window = window_of(req.text, req.cursor.line)
    return found if found and start <= found.start_line < start + len(window) else None


def jump_for(req: NextRequest, suggestion: Suggestion | None) -> dict | None:
    """Where the newest edit's one-word change is due next: {path, line}, or None. In the
    current file (as it will be) outside what `suggestion` rewrites, the next occurrence
    after it, else the last before; when there is none, the first occurrence in the first
    of the other open files that has one (the rename's next call site elsewhere)."""
    change = word_change(req.edits)
    if change is None:
        return None
    text = suggestion.apply(req.text) if suggestion else req.text
    lo, hi = (suggestion.start_line, suggestion.start_line + suggestion.text.count("\n")) \
        if suggestion else (req.cursor.line, req.cursor.line)
    spots = [n for n in occurrences(text, change[0]) if not lo <= n <= hi]
    if spots:
        after = [n for n in spots if n > hi]
        return {"path": req.path, "line": after[0] if after else spots[-1]}
    for other in req.open_files:
        if found := occurrences(other.text, change[0]):
            return {"path": other.path, "line": found[0]}
    return None


# -- the model path (the engine job `tab.next`, in the model's worker) -----------------------


class _Watch:
    """`models.speculative.Guide` for a next-edit decode: stops it when the request is
    superseded (checked at each output line) or the output has outgrown the window, and,
    for `window`, once the rewrite has re-joined the window for `join_lines` lines after its
    last change: the rest would be a copy of the window, so it is spliced in (`spliced`)
    instead of decoded. That is a guess that no second change follows; `parse` takes one
    block spanning every change anyway (docs/tab.md, "Next edit", has what it saves)."""

    def __init__(self, cancel: threading.Event, max_lines: int, window: list[str] | None = None,
                 lead: str = "", join_lines: int | None = None) -> None:
        self.cancel, self.max_lines, self.lines = cancel, max_lines, 0
        self.blanks: list[str] = []
        self.window, self.join_lines = window or [], join_lines
        self.old = [line.removesuffix("\n") for line in self.window]
        self.new = lead.split("\n")[:-1]  # the rewrite's lines the prompt already holds
        self.spliced: str | None = None  # the whole rewrite, when it stopped on a re-join

    def feed(self, line: str) -> bool:
        self.lines += 1
        self.new.append(line)
        if self.join_lines and self._rejoined():
            return False
        return not self.cancel.is_set() and self.lines <= self.max_lines

    def _rejoined(self) -> bool:
        """True (and `spliced` set) when the rewrite so far changed the window and its last
        `join_lines` lines are, by difflib's alignment, the window's again."""
        ops = SequenceMatcher(None, self.old, self.new, autojunk=False).get_opcodes()
        while ops and ops[-1][0] == "delete":  # the window's lines still to come
            ops.pop()
        tag, _, i2, j1, j2 = ops[-1]
        if tag != "equal" or j2 != len(self.new) or j2 - j1 < self.join_lines or len(ops) < 2:
            return False
        self.spliced = "".join(f"{line}\n" for line in self.new) + "".join(self.window[i2:])
        return True

    def force(self, stopping: bool) -> str | None:
        return None

    def repair(self, line: str) -> str | None:
        return None


def predict(ctx: JobContext, settings: TabSettings, req: NextRequest, tenant: str,
            speculative: bool = True, join_lines: int | None = JOIN_LINES) -> Prediction:
    """The engine job `tab.next`: prompt, decode with the window as the draft, parse. The
    prompt's KV is kept in the tenant's slot for the document (`slots.py`, FIM's slots), so
    the document's next request evaluates only what changed since: the newest edit and
    the window, when a FIM request or another document used the model in between."""
    from codeplane.models.speculative import decode  # the worker's import, not the server's

    start = time.perf_counter()
    model = ctx.model
    parts, current, lead = prompt_parts(req, req.format)
    prompt = _tokens(model, parts)
    draft = model.tokenize(current)
    if req.format != "diff":
        budget = answer_budget(req, model.tokenize)
        max_lines = current.count("\n") + 8
    else:
        budget, max_lines = DIFF_MAX_TOKENS, 2 * (current.count("\n") + 1)
    slots = worker_slots(ctx, settings)
    slots.prepare(model, prompt, tenant)
    window = window_of(req.text, req.cursor.line)[1] if req.format != "diff" else []
    watch = _Watch(ctx.cancel, max_lines, window, lead, join_lines if window else None)
    run = decode(model, prompt, [draft], req.max_tokens or budget, speculative, watch,
                 logprobs=True)
    slots.finished(model, tenant, slot_key(model.name, req.path))
    raw = watch.spliced if watch.spliced is not None else lead + run.text
    usable = run.finish_reason != "length" or req.format == "diff" or watch.spliced is not None
    suggestion = parse(raw, req.format, req) if usable else None
    return Prediction(suggestion, raw, run.prompt_tokens, run.cached_tokens,
                      run.output_tokens, run.drafted, run.accepted,
                      round((time.perf_counter() - start) * 1000, 2),
                      round(run.prompt_seconds * 1000, 2), round(run.decode_seconds * 1000, 2),
                      min(run.logprobs, default=0.0), sum(run.logprobs), run.forward_passes)


def prefill(ctx: JobContext, settings: TabSettings, req: NextRequest, tenant: str
            ) -> Prefilled:
    """The engine job `tab.next_prefill`: the prompt `predict` would build for `req`,
    evaluated into the tenant's slot for the document without decoding (the editor paused
    after an edit: the request that follows pays for its decode only). It yields to any
    completion as FIM's prefill does (`TabService.prefill`)."""
    parts, _, _ = prompt_parts(req, req.format)
    return local_tab(ctx, settings, tenant).prefill(_tokens(ctx.model, parts), ctx.cancel,
                                                    slot_key(ctx.model.name, req.path))


def _tokens(model: LocalModel, parts: list[tuple[str, bool]]) -> list[int]:
    return [t for text, control in parts for t in model.tokenize(text, special=control)]


def slot_key(model: str, path: str) -> str:
    """Next edit's KV slot of a document: its own, beside FIM's slot of the same file."""
    return f"next\0{model}\0{path}"


# -- the server side ------------------------------------------------------------------------


@dataclass
class NextResult:
    suggestion: Suggestion | None
    jump: dict | None
    source: str  # "same" | "parallel" (a kind of change, tab/kinds.py: no model) | "model" |
    # "repeat" (the baseline, the model proposed nothing) | "none" | "hidden" (the show/hide
    # rule said no) | "cancelled"
    latency_ms: float
    request_id: str | None = None
    id: str | None = None  # a shown suggestion's, for `POST /v1/tab/feedback`
    probability: float | None = None  # the show/hide rule's P(exact)
    signals: dict | None = None  # what the rule read (NextSignals)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    model_ms: float = 0.0
    prompt_ms: float = 0.0
    decode_ms: float = 0.0

    def to_json(self) -> dict:
        out = dict(self.__dict__)
        out["suggestion"] = self.suggestion.__dict__ if self.suggestion else None
        return out


async def next_edit(tab: TabService, req: NextRequest, tenant: str) -> NextResult:
    """One next-edit suggestion. A kind of change that needs no model (`tab/kinds.py`)
    answers first, without the model: on the held-out cases it is right where the base
    model is not (docs/tab.md). Else the engine: it shares Tab's cursor sessions, so a newer
    request (FIM or next edit) of the same tenant and `cursor_id` cancels this one between
    two output lines, or drops it while it still waits for the model."""
    start = time.perf_counter()
    session, seq, cancel = tab.begin(req, tenant)
    got: Prediction | None = None
    if found := kinds.propose(req.text, req.cursor.line, req.edits):
        source, suggestion = found
    else:
        try:
            got, _ = await tab.engine.run(tab.next_model(req.model), "tab.next", tab.settings,
                                          req.for_model(), tenant, cancel=cancel)
        except JobDropped:
            got = None
        if got is None or session.seq != seq:
            return NextResult(None, None, "cancelled", _ms(start), req.request_id)
        _count(tab, got)
        suggestion, source = got.suggestion, "model"
        if suggestion is None:
            suggestion, source = near_repeat(req), "repeat"
    signals = next_signals(req, got, suggestion, source) if suggestion else None
    probability = next_probability(signals) if signals else None
    shown = probability is not None and probability >= NEXT_MIN_PROBABILITY
    if signals and not shown:  # the rule's no hides the jump too: nothing is shown
        suggestion, source = None, "hidden"
    elif suggestion is None:
        source = "none"
    jump = jump_for(req, suggestion) if source != "hidden" else None  # or a jump alone
    spent = got or Prediction(None, "", 0, 0, 0, 0, 0, 0.0)
    return NextResult(suggestion, jump, source,
                      _ms(start), req.request_id, f"n{secrets.token_hex(8)}" if shown else None,
                      round(probability, 4) if probability is not None else None,
                      signals.to_json() if signals else None, spent.prompt_tokens,
                      spent.cached_tokens, spent.completion_tokens, spent.drafted,
                      spent.accepted, spent.model_ms, spent.prompt_ms, spent.decode_ms)


def _count(tab: TabService, got: Prediction) -> None:
    tab.stats["next_calls"] += 1
    tab.stats["next_prompt_tokens"] += got.prompt_tokens
    tab.stats["next_cached_tokens"] += got.cached_tokens


def _ms(start: float) -> float:
    return round((time.perf_counter() - start) * 1000, 2)
