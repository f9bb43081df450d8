"""Apply benchmark, wild styles: sketches written the way chat models write them.

The same real commits as `bench/apply.py` (tune part: its `tune` set) plus a held-out part of
other repositories (the `held-out` set: pallets/itsdangerous, pallets/markupsafe,
python-poetry/tomlkit), each edit derived from the real diff in styles seen from chat models;
every set is built from the projects' histories on first use (`bench/apply/sets.py`):

  wordings  markers in many wordings (`# ... rest of the function unchanged ...`,
            `# (unchanged)`, `# [previous implementation]`, a bare `...`, ...)
  body      markers indented as the block they stand for (inside function bodies)
  header    the enclosing `def`/`class` line kept as context above a body-level marker
  drift     context with trailing whitespace stripped and blank lines added next to
            markers (blank lines changed *between* two context lines are not generated: a
            sketch cannot tell them from a commit's own blank-line change, which 24 of the
            299 commits make, so such a case has no one right answer)
  joined    a bracketed multi-line statement in the context joined onto one line
  mixed     all of the above, chosen per hunk
  layout    context whose layout drifted as chat models write it (issue #33): blank lines
            collapsed, removed or inserted between two context lines (between statements,
            never inside a string or brackets, never next to a changed line) and next to
            markers, trailing whitespace stripped, bracketed statements joined

A style that changes nothing in a case (no header to show, nothing to join) skips it. A
well-posedness check keeps only cases with one right answer (`well_posed`): every segment's
leading and trailing context occurs once in the original (whitespace ignored), no marker
wording occurs in the files, the commit does not delete or rewrite the file's first or last
lines (a sketch reaching the file's edge without a marker reads the same as one whose
marker was forgotten), nor its final newline (a sketch cannot say that), no hunk deletes
lines next to a marker with only blank lines as context (layout or context?), and for the
whitespace styles the commit itself changes no blank
line next to context only (a drifted blank line and a real one look alike).

Usage:
  python bench/apply/wild.py [--verbose]         # exact / wrong / declined per style
  python bench/apply/wild.py --set fresh         # the second held-out slice alone
  python bench/apply/wild.py --set third         # the third (session 7) held-out slice
  python bench/apply/wild.py --set fourth        # the fourth (issue #33) held-out slice
  python bench/apply/wild.py --set fifth         # the fifth (session apply5) held-out slice
  python bench/apply/wild.py --set sixth         # the sixth (session apply10) held-out slice
  python bench/apply/wild.py --set seventh       # the seventh (session apply12) held-out slice
  python bench/apply/sets.py select OWNER/NAME... --name NAME   # a new held-out slice
  python bench/apply/wild.py --model code-small  # declines also end to end (model path)
  python bench/apply/wild.py --set fifth --model code-small --model-cases 2   # capped
  python bench/apply/wild.py --set fifth --model code-small --resume fifth.jsonl  # in parts
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import io
import json
import random
import re
import sys
import tokenize
from collections import defaultdict
from pathlib import Path

from codeplane.apply.service import apply_edit

# Held-out slices (bench/apply/sets/NAME.txt), each built from repositories no earlier set
# used, before the session that measured on it changed any code, and never tuned on:
# fresh (pluggy, structlog, more-itertools), third (session 7: tenacity, cachetools,
# marshmallow), fourth (issue #33: pyjwt, tinydb, loguru, funcy), fifth (session apply5:
# jmespath.py, deepdiff, voluptuous, bidict), sixth (session apply10: cerberus, environs,
# wrapt, pint), seventh (session apply12: jsonpickle, simplejson, python-json-logger,
# wcwidth).
SLICES = ("fresh", "third", "fourth", "fifth", "sixth", "seventh")
STYLES = ("wordings", "body", "header", "drift", "joined", "mixed", "layout")
WORDINGS = (
    "# ... existing code ...", "# ... rest of the function unchanged ...", "# (unchanged)",
    "# existing code here", "# [previous implementation]", "...", "# ...",
    "# rest of the code unchanged", "# ... (unchanged) ...", "# … existing methods …",
    "# [rest of file unchanged]", "# unchanged code", "# (rest of the class omitted)",
    "# ... other methods ...", "# keep existing code", "# remaining code unchanged",
    "# ...existing code...", "# (previous code)",
)
_DEF = re.compile(r"^\s*(async\s+def|def|class)\s")


def bench_apply():
    """bench/apply.py (data set, case building, outcome kinds), imported by path."""
    spec = importlib.util.spec_from_file_location(
        "bench_apply", Path(__file__).parents[1] / "apply.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


BA = bench_apply()


def load_all(which: str = "main") -> list[dict]:
    """The tune part and the first held-out part ("main"), or one later held-out slice
    alone (`SLICES`)."""
    if which in SLICES:
        return [dict(c, part="held-out") for c in BA.SETS.load(which)]
    return [dict(c, part="tune") for c in BA.load()] + \
        [dict(c, part="held-out") for c in BA.SETS.load("held-out")]


# -- deriving wild sketches ------------------------------------------------------------------

def indent_of(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def squash(text: str) -> str:
    return "".join(text.split())


def joinable(old: list[str]) -> dict[int, int]:
    """Start row -> end row (exclusive) of multi-line bracketed statements with no comment,
    multi-line string or backslash in them (the ones a model joins onto one line)."""
    spans: dict[int, int] = {}
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO("\n".join(old) + "\n").readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return spans
    start, clean = None, True
    for tok in tokens:
        if tok.type in (tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT) \
                and start is None:
            continue
        if start is None:
            start, clean = tok.start[0] - 1, True
        if tok.type == tokenize.COMMENT or tok.type == tokenize.STRING and \
                tok.start[0] != tok.end[0]:
            clean = False
        if tok.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
            end = tok.end[0]
            if clean and end - start > 1 and end - start <= 8 and not any(
                    line.rstrip().endswith("\\") for line in old[start:end]):
                spans[start] = end
            start = None
    return spans


def statements(old: list[str]) -> tuple[set[int], set[int]]:
    """Rows where a statement starts (outside brackets and strings), and blank rows outside
    strings: where a model may add or remove a blank line without changing the code."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO("\n".join(old) + "\n").readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return set(), set()
    starts: set[int] = set()
    inside: set[int] = set()  # rows within a multi-line string
    fresh = True
    for tok in tokens:
        if tok.type == tokenize.STRING and tok.end[0] > tok.start[0]:
            inside.update(range(tok.start[0], tok.end[0] - 1))
        if tok.type in (tokenize.NEWLINE, tokenize.NL, tokenize.COMMENT, tokenize.INDENT,
                        tokenize.DEDENT, tokenize.ENDMARKER):
            fresh = fresh or tok.type == tokenize.NEWLINE
            continue
        if fresh:
            starts.add(tok.start[0] - 1)
            fresh = False
    loose = {i for i, line in enumerate(old) if not line.strip() and i not in inside}
    return starts, loose


def join(lines: list[str]) -> str:
    out = lines[0].rstrip()
    for line in lines[1:]:
        part = line.strip()
        glue = "" if out.endswith(("(", "[", "{")) or part.startswith((")", "]", "}")) else " "
        out += glue + part
    return re.sub(r",\s*([)\]}])", r"\1", out)


def headers(old: list[str]) -> list[int | None]:
    """For each line, the nearest `def`/`class` line above it that encloses it."""
    out: list[int | None] = []
    stack: list[int] = []
    for i, line in enumerate(old):
        if line.strip():
            while stack and len(indent_of(old[stack[-1]])) >= len(indent_of(line)):
                stack.pop()
        out.append(stack[-1] if stack else None)
        if _DEF.match(line) and line.rstrip().endswith(":"):
            stack.append(i)
    return out


class Maker:
    """Builds one case's sketch in one style (randomness seeded by case and style)."""

    def __init__(self, case: dict, style: str, seed: int) -> None:
        self.old, self.new = BA.lines_of(case["original"]), BA.lines_of(case["expected"])
        self.style = style
        self.rng = random.Random(seed)
        self.changed = False  # the style did something beyond the plain markers style
        self.groups = BA.hunks(self.old, self.new, 3 if style in ("wordings", "drift",
                                                                   "joined", "layout") else 2)
        self.spans = joinable(self.old) if style in ("joined", "mixed", "layout") else {}
        self.starts, self.loose = statements(self.old) if style == "layout" else (set(), set())
        self.enclosing = headers(self.old) if style in ("header", "mixed") else []
        self.used_wordings: set[str] = set()
        self.segments: list[tuple[int, int]] = []  # (old start, old end) each segment shows

    def wants(self, trait: str) -> bool:
        if self.style == "layout":  # whitespace drift everywhere, some statements joined
            return trait == "drift" or trait == "joined" and self.rng.random() < 0.5
        return self.style == trait or self.style == "mixed" and self.rng.random() < 0.5

    def marker(self, indent: str) -> str:
        wording = self.rng.choice(WORDINGS) if self.style not in ("drift", "layout") \
            else WORDINGS[0]
        self.used_wordings.add(wording)
        return indent + wording

    def body_indent(self, near: int, step: int, fallback: str) -> str:
        """Indentation of the elided lines next to old line `near` (going `step`)."""
        i = near
        while 0 <= i < len(self.old) and not self.old[i].strip():
            i += step
        return indent_of(self.old[i]) if 0 <= i < len(self.old) else fallback

    def build(self) -> str:
        out: list[str] = []
        last_header = None
        for k, group in enumerate(self.groups):
            i1, i2 = group[0][1], group[-1][2]
            segment = self.segment_lines(group)
            first = next((x for x in segment if x.strip()), "")
            body = self.wants("body")
            header = self.enclosing[i1] if self.enclosing and i1 < len(self.old) else None
            use_header = header is not None and header != last_header and self.wants("header") \
                and (k == 0 or header >= self.groups[k - 1][-1][2]) and header < i1 - 1
            if use_header:
                if header > 0 or k > 0:
                    out.append(self.marker(indent_of(self.old[header])))
                out.append(self.old[header])
                out.append(self.marker(self.body_indent(header + 1, 1, "    ")))
                self.segments.append((header, header + 1))
                last_header, self.changed = header, True
            elif i1 > 0 or k > 0:
                indent = self.body_indent(i1 - 1, -1, indent_of(first)) if body \
                    else indent_of(first)
                self.changed |= body and indent != indent_of(first)
                out.append(self.marker(indent))
            if self.wants("drift") and out and segment and segment[0].strip() \
                    and self.rng.random() < 0.5:
                out.append("")  # a blank line the model added under the marker
                self.changed = True
            out.extend(segment)
            self.segments.append((i1, i2))
            if k == len(self.groups) - 1 and i2 < len(self.old):
                last = next((x for x in reversed(segment) if x.strip()), "")
                indent = self.body_indent(i2, 1, indent_of(last)) if self.wants("body") \
                    else indent_of(last)
                if self.wants("drift") and segment and segment[-1].strip() \
                        and self.rng.random() < 0.5:
                    out.append("")
                    self.changed = True
                out.append(self.marker(indent))
        return "\n".join(out) + "\n"

    def segment_lines(self, group) -> list[str]:
        """The new file's lines of one hunk, with drift and joins applied to context only
        (equal lines whose neighbours are equal too)."""
        lines: list[str] = []
        for number, (tag, a1, a2, b1, b2) in enumerate(group):
            if tag != "equal":
                lines.extend(self.new[b1:b2])
                continue
            gone, extra = self.blank_drift(a1, a2, number > 0, number < len(group) - 1) \
                if self.style == "layout" else (set(), set())
            lines.extend(self.context(a1, a2, gone, extra))
        return lines

    def blank_drift(self, a1: int, a2: int, change_above: bool, change_below: bool
                    ) -> tuple[set[int], set[int]]:
        """How a chat model redraws the blank lines of context old[a1:a2]: which blank
        lines it leaves out (a run collapsed to one, a single one removed, the run next to
        a marker dropped) and before which lines it adds one (between two statements).
        Never inside a string, never next to a changed line (whether such a blank line is
        the edit's or layout, a sketch cannot say)."""
        gone: set[int] = set()
        i = a1
        while i < a2:
            if self.old[i].strip():
                i += 1
                continue
            end = next((j for j in range(i, a2) if self.old[j].strip()), a2)
            run = range(i, end)
            at_marker = i == a1 and not change_above or end == a2 and not change_below
            touches_change = i == a1 and change_above or end == a2 and change_below
            if touches_change or not all(j in self.loose for j in run):
                pass
            elif at_marker and self.rng.random() < 0.5:
                gone.update(run)
            elif len(run) > 1 and self.rng.random() < 0.6:
                gone.update(run[1:])
            elif len(run) == 1 and not at_marker and self.rng.random() < 0.3:
                gone.add(i)
            i = end
        extra = {j for j in range(a1 + 1, a2) if j in self.starts and self.old[j - 1].strip()
                 and self.old[j].strip() and self.rng.random() < 0.12}
        return gone, extra

    def context(self, a1: int, a2: int, gone: set[int], extra: set[int]) -> list[str]:
        """Context lines old[a1:a2] as the style redraws them: `gone` blank lines left out,
        a blank line added before each line in `extra`, trailing whitespace stripped,
        statements joined."""
        out: list[str] = []
        drift, joins = self.wants("drift"), self.wants("joined")
        self.changed |= bool(gone or extra)
        i = a1
        while i < a2:
            out += [""] if i in extra else []
            end = self.spans.get(i)
            if joins and end is not None and end <= a2:
                out.append(join(self.old[i:end]))
                self.changed, i = True, end
                continue
            line = self.old[i]
            if drift and line != line.rstrip():
                line, self.changed = line.rstrip(), True
            if i not in gone:
                out.append(line)
            i += 1
        return out


def well_posed(case: dict, sketch: str, maker: Maker) -> bool:
    """One right answer: each segment's first and last context lines (whitespace ignored,
    blank lines aside) occur once in the original; no marker wording occurs in either file;
    no change of layout only in the commit (`BA.layout_changes`), and none at all where the
    style drifts whitespace."""
    old, new = maker.old, maker.new
    if BA.final_newline_changes(case) or BA.layout_changes(case):
        return False  # a sketch cannot say it: the merge keeps the file's final newline
        # and the layout of lines the sketch shows as context
    texts = {line.strip() for line in old + new}
    if any(w in texts or w.strip("# ") in texts for w in maker.used_wordings):
        return False
    # Without a marker at an end the sketch reaches the file's edge, and the merge keeps
    # what lies beyond it (models forget the closing marker): a commit that deletes the
    # file's last (first) lines reads the same as one with the marker forgotten.
    ops = [op for g in BA.hunks(old, new, 0) for op in g if op[0] != "equal"]
    if ops and ops[-1][2] == len(old) and ops[-1][4] == len(new) and ops[-1][1] < ops[-1][2] \
            or ops and ops[0][1] == 0 and ops[0][3] == 0 and ops[0][1] < ops[0][2]:
        return False
    if any(_blank_context_deletion(maker, k) for k in range(len(maker.groups))):
        return False
    keys = [squash(line) for line in old]
    nonblank = [i for i, k in enumerate(keys) if k]
    flat = [keys[i] for i in nonblank]
    for start, end in maker.segments:
        shown = [keys[i] for i in range(start, end) if keys[i]]
        for run in (shown[:2], shown[-2:]):
            if run and sum(flat[j:j + len(run)] == run for j in range(len(flat))) != 1:
                return False
    if maker.style in ("drift", "mixed", "layout"):
        for group in BA.hunks(old, new, 0):
            for tag, i1, i2, j1, j2 in group:
                if tag == "equal":
                    continue
                if not any(x.strip() for x in old[i1:i2] + new[j1:j2]) \
                        or squash("".join(old[i1:i2])) == squash("".join(new[j1:j2])):
                    return False
    return True


def _blank_context_deletion(maker: Maker, k: int) -> bool:
    """Hunk k deletes or rewrites lines next to a marker with only blank lines as context
    between them: models write blank lines next to markers as layout, so the sketch says
    as much that those lines are kept as that they go (two right answers)."""
    group, old = maker.groups[k], maker.old
    for ops, marker in ((group, group[0][1] > 0 or k > 0),
                        (group[::-1], k < len(maker.groups) - 1 or group[-1][2] < len(old))):
        edge = ops[0]
        change = next((op for op in ops if op[0] != "equal"), None)
        if marker and change is not None and change[0] in ("replace", "delete") and \
                (edge[0] != "equal" or not any(x.strip() for x in old[edge[1]:edge[2]])):
            return True
    return False


def sketches(case: dict, index: int) -> dict[str, str]:
    """Style -> sketch, for the styles that change something and are well posed here."""
    out = {}
    for number, style in enumerate(STYLES):
        maker = Maker(case, style, seed=index * 101 + number)
        text = maker.build()
        if (maker.changed or style == "wordings") and well_posed(case, text, maker):
            out[style] = text
    return out


# -- running ---------------------------------------------------------------------------------

# Why a sketch declined, from the merge's reason (first match wins): one name per check that
# declines (docs/apply.md, "Deterministic path").
CATEGORIES = (
    ("blank line next to a marker", ("shows a blank line",)),
    ("blank run split", ("run of blank lines",)),
    ("open end deletes", ("without context and would delete",)),
    ("open end rewrites", ("without context and would rewrite",)),
    ("open end inside a block", ("with new lines", "in the same block")),
    ("repeated edge line", ("occurs several times",)),
    ("edge line does not fit", ("does not fit as context",)),
    ("common line split from context", ("are the file's lines",)),
    ("least code: context repeats", ("opens like", "closes like")),
    ("tie: two places", ("equally well", "two equally good")),
    ("insertion or rewrite", ("reads as new lines after",)),
    ("no distinctive line", ("no distinctive line",)),
    ("no-op through a repeated line", ("read as it fits best",)),
    ("no-op with blank context", ("changes nothing",)),
    ("deletion fits two places", ("with the same lines as context",)),
    ("guard: defines a name twice", ("times in one scope", "would define")),
    ("guard: unshown change", ("wrong-merge guard",)),
    ("layout guard: two pairings", ("layout guard",)),
    ("marker-less edge", ("no elision marker at its",)),
    ("does not parse", ("no longer parses",)),
)


def category(reason: str) -> str:
    return next((name for name, keys in CATEGORIES if any(k in reason for k in keys)),
                "other")


def run(cases: list[dict], verbose: bool, model: str | None = None,
        per_style: int | None = None, log: Path | None = None) -> None:
    """Every case in every style, deterministic path only; with `model`, every declined
    one again through the product's whole pipeline (`apply_edit` with the engine: the
    deterministic merge, else the model path), which is what a user gets."""
    kinds: dict[tuple[str, str], list[str]] = defaultdict(list)
    declines: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    misses = []
    declined: list[tuple[str, dict, str]] = []
    for index, case in enumerate(cases):
        for style, text in sketches(case, index).items():
            result = apply_edit(case["original"], text, case["path"])
            kind = BA.kind_of(result, case)
            kinds[style, case["part"]].append(kind)
            if kind == "declined":
                declines[style][category(result.diagnostics[-1])] += 1
                declined.append((style, case, text))
            if kind != "exact":
                misses.append((kind, style, case["repo"], case["commit"][:10], case["path"],
                               "" if result.ok else result.diagnostics[-1][:120]))
    print(f"wild styles: {len(cases)} real edits ({sum(c['part'] == 'tune' for c in cases)} "
          f"tune, {sum(c['part'] == 'held-out' for c in cases)} held-out)")
    print(f"  {'style':9s} {'n':>4s} {'exact':>6s} {'wrong':>6s} {'declined':>8s}   "
          f"held-out exact / wrong (n)")
    for style in STYLES:
        every = kinds[style, "tune"] + kinds[style, "held-out"]
        held = kinds[style, "held-out"]
        print(f"  {style:9s} {len(every):4d} {BA._pct(every, 'exact'):5.1f}% "
              f"{BA._pct(every, 'wrong'):5.1f}% {BA._pct(every, 'declined'):7.1f}%   "
              f"{BA._pct(held, 'exact'):5.1f}% / {BA._pct(held, 'wrong'):4.1f}% ({len(held)})")
    every = [k for v in kinds.values() for k in v]
    print(f"  all {len(every)} applies: {BA._shares(every)}")
    print("  declines by reason:")
    for style in STYLES:
        ranked = sorted(declines[style].items(), key=lambda kv: -kv[1])
        print(f"    {style:9s} " + ", ".join(f"{name} {count}" for name, count in ranked))
    for miss in sorted(misses, key=lambda m: m[0] != "wrong"):
        if miss[0] == "wrong" or verbose:
            print("  ", *miss)
    if model:
        end_to_end(declined, kinds, model, per_style, log)


def capped(declined: list[tuple[str, dict, str]], per_style: int | None
           ) -> list[tuple[str, dict, str]]:
    """At most `per_style` declines of each style, smallest file first (the model path's
    time grows with the window it rewrites); all of them, in order, without a cap."""
    if per_style is None:
        return declined
    chosen: dict[str, list[tuple[str, dict, str]]] = defaultdict(list)
    for item in sorted(declined, key=lambda d: len(d[1]["original"])):
        if len(chosen[item[0]]) < per_style:
            chosen[item[0]].append(item)
    return [item for style in STYLES for item in chosen[style]]


def case_key(style: str, case: dict, text: str) -> str:
    """One end-to-end apply's name in a `--resume` log: the style, the case and a hash of
    the sketch (so a log written for other sketches matches nothing)."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    return f"{style} {case['repo']} {case['commit']} {case['path']} {digest}"


def recorded(log: Path | None) -> dict[str, str]:
    """Key -> outcome (exact / wrong / rejected) of the applies an earlier run wrote to
    `log`: a long end-to-end run split over several short holds of the CPU lock."""
    if log is None or not log.exists():
        return {}
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return {row["key"]: row["kind"] for row in rows}


def end_to_end(declined: list[tuple[str, dict, str]], kinds: dict[tuple[str, str], list[str]],
               model: str, per_style: int | None = None, log: Path | None = None) -> None:
    """The declined sketches through `apply_edit` with the engine, and per style what a
    user gets in the end: exact / wrong / not applied, over all of the style's cases (a
    decline left out by `per_style` counts as not applied). With `log`, each outcome is
    appended there and applies already in it are not run again (`--resume`)."""
    from codeplane.config import load_settings
    from codeplane.models.engine import Engine

    rescued: dict[str, list[str]] = defaultdict(list)
    chosen = capped(declined, per_style)
    if len(chosen) < len(declined):
        print(f"  end to end: {len(chosen)} of {len(declined)} declines, at most {per_style} "
              f"per style, smallest file first")
    done = recorded(log)
    engine = None
    try:
        for style, case, text in chosen:
            key = case_key(style, case, text)
            if key in done:
                rescued[style].append(done[key])
                print(f"   model {style:8s} {done[key]:8s} {key} (recorded)", flush=True)
                continue
            engine = engine or Engine(load_settings())
            result = apply_edit(case["original"], text, case["path"], engine, model)
            kind = BA.kind_of(result, case, failed="rejected")
            rescued[style].append(kind)
            route = "ranking" if "ranking" in result.stats else "rewrite"
            why = "" if result.ok else result.diagnostics[-1][:90]
            print(f"   model {style:8s} {kind:8s} {case['repo']} {case['commit'][:10]} "
                  f"{case['path']} {result.seconds:5.1f}s {route} {why}", flush=True)
            if log is not None:
                with log.open("a") as out:
                    out.write(json.dumps({"key": key, "kind": kind, "route": route,
                                          "seconds": round(result.seconds, 1),
                                          "why": why}) + "\n")
    finally:
        if engine is not None:
            engine.close()
    print(f"  end to end with {model} on the declines (exact / wrong / rejected), and the "
          f"style's final exact / wrong / not applied:")
    for style in STYLES:
        got = rescued.get(style, [])
        every = kinds[style, "tune"] + kinds[style, "held-out"]
        if not every:
            continue
        exact = every.count("exact") + got.count("exact")
        wrong = every.count("wrong") + got.count("wrong")
        print(f"    {style:9s} {got.count('exact'):3d} / {got.count('wrong'):3d} / "
              f"{got.count('rejected'):3d}   final {100 * exact / len(every):5.1f}% / "
              f"{100 * wrong / len(every):4.1f}% / "
              f"{100 * (len(every) - exact - wrong) / len(every):4.1f}%"
              f"   ({sum(d[0] == style for d in declined) - len(got)} declines not run)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--verbose", action="store_true", help="also list every decline")
    parser.add_argument("--set", choices=("main", *SLICES), default="main",
                        help="main: tune + first held-out part; fresh, third, fourth, fifth, "
                             "sixth, seventh: one later held-out slice alone")
    parser.add_argument("--style", choices=STYLES, help="print one case's sketch in a style")
    parser.add_argument("--case", type=int, default=0)
    parser.add_argument("--model", help="also run the declines end to end with this model "
                        "(the product's model path, e.g. code-small)")
    parser.add_argument("--model-cases", type=int, metavar="N",
                        help="with --model: at most N declines per style, smallest file first")
    parser.add_argument("--resume", type=Path, metavar="FILE",
                        help="with --model: append each end-to-end outcome to FILE and skip "
                             "the applies already in it (a long run in several short holds)")
    args = parser.parse_args()
    try:
        cases = load_all(args.set)
    except BA.SETS.SetError as exc:
        parser.exit(2, f"error: {exc}\n")
    if args.style:
        print(sketches(cases[args.case], args.case).get(args.style, "(not well posed)"))
        return
    if args.model_cases is not None and (args.model_cases < 1 or not args.model):
        parser.exit(2, "error: --model-cases needs --model and N >= 1\n")
    if args.resume is not None and not args.model:
        parser.exit(2, "error: --resume needs --model\n")
    run(cases, args.verbose, args.model, args.model_cases, args.resume)


if __name__ == "__main__":
    main()
