"""Global alignment of a sketch to the original file (dynamic programming, one row per sketch
line, vectorised over the original's lines with numpy).

Costs, in integer units so ties are exact:
- a sketch line equal to an original line (whitespace collapsed) matches for free;
- a sketch line kept as new costs INSERT, less if it is blank or punctuation, and more if the
  same line exists in the file: such a line is more likely context, and treating context as
  new must cost more than deleting the lines an edit replaces (else an elision marker would
  silently keep the old version next to the new one);
- deleting original lines inside a segment costs DELETE_OPEN plus DELETE_EXTEND per line;
  deleting only blank lines costs DELETE_BLANK per line: models collapse and drop the blank
  lines of the context they copy, which is layout, not an edit (issue #33; the merge keeps
  the file's blank lines there, `guard.restore_layout`);
- a sketch line that is an edited version of an original line (token-signature similarity
  at least SUB_MIN_SIMILARITY) may replace it for SUB_BASE plus up to SUB_SCALE, much less
  than delete + insert; this is the fuzzy part that tolerates small drift;
- an elision marker skips any number of original lines for free (the caller's markers at
  the sketch's ends skip only blank lines once the merge anchors that end: `anchor`).

The alignment is exact-optimal; a segment is *ambiguous* when forbidding every original line
it matched still yields the same optimal cost, i.e. an equally good placement exists elsewhere.
Why not difflib: `SequenceMatcher` has no notion of elision markers, breaks ties toward the
file's start, and cannot tell a unique placement from a coin toss.
"""

from __future__ import annotations

import difflib
import functools
import itertools
import re
import zlib
from collections import Counter
from dataclasses import dataclass

import numpy as np

INSERT, INSERT_KNOWN = 100, 120  # new line; "new" line that already exists in the file
INSERT_EDGE = 5000  # a segment's first/last line, next to a marker, taken as new though it exists
INSERT_TRIVIAL = 40  # blank/punctuation lines: cheap either way, so they never steer placement
# An optional item (a blank line next to a marker) left out instead of matched. Dearer than
# a new blank line: leaving out a blank line the sketch shows between new code and a marker
# glues the new code to the elided code, so it is done only where no blank line is there.
DROP = 100
# Per deleted line 40, not 20: at 20 a segment could reach over 100 lines of code to match
# lines it shows as new that also exist far below (a docstring copying another class's
# `Args:`), deleting all between. A deletion the sketch means is pinned by its context
# lines (INSERT_EDGE), which cost far more than any run. The benchmark gained exact merges
# and lost a wrong one (docs/apply.md, "Benchmark": the session 4 changes).
DELETE_OPEN, DELETE_EXTEND = 100, 40
# A run of blank lines only: nearly free (a blank line the model left out between two context
# lines would otherwise cost more than taking the next context line as a new copy), but not
# free, so that a blank line is matched rather than deleted when it can be.
DELETE_BLANK = 1
EDGE_TRIVIAL = DELETE_OPEN + DELETE_EXTEND + 1  # a common line at a segment's edge, taken as new
SUB_BASE, SUB_SCALE, SUB_MIN_SIMILARITY = 20, 120, 0.5  # an original line edited in place
SIG_WORDS = 8  # 512-bit token signature per line: a cheap filter for edited lines
SIG_CANDIDATE, MAX_CANDIDATES = 0.2, 48  # lines the exact token comparison then looks at
INF = 1 << 40
Bounds = tuple["np.ndarray | None", "np.ndarray | None"]  # a marker's allowed start, end columns
TRIVIAL = re.compile(r"^(\W*|pass|else:|try:|finally:|return|break|continue|\w{1,2}\W*)$")


def indent_width(line: str) -> int:
    """Indentation in columns, a tab counting 4."""
    return len(line.expandtabs(4)) - len(line.expandtabs(4).lstrip())


def norm(line: str) -> str:
    return " ".join(line.split())


def trivial(text: str) -> bool:
    return bool(TRIVIAL.match(text))


_TOKEN = re.compile(r"\w+|[^\w\s]")


def signatures(texts: list[str]) -> np.ndarray:
    """Bloom-style bit sets (one row of SIG_WORDS uint64 per text) of each line's tokens,
    token pairs, tokens by position from either end (so `a + b` and `a - b` still look
    alike) and byte trigrams. crc32 and a fixed multiplier, not hash(): str hashes change
    per process, and a merge must not depend on the run. Trigrams are hashed with numpy
    over all lines at once: they are most of the features."""
    index, packed = _signature_table(frozenset(texts))
    return packed[[index[t] for t in texts]].reshape(len(texts), SIG_WORDS)


def clear_cache() -> None:
    """Forget cached line signatures (the benchmark times every apply cold)."""
    _signature_table.cache_clear()


@functools.lru_cache(maxsize=4)  # the mirrored check and repeated applies ask again
def _signature_table(texts: frozenset[str]) -> tuple[dict[str, int], np.ndarray]:
    unique = sorted(texts)
    bits = np.zeros((len(unique), 64 * SIG_WORDS), dtype=bool)
    features: list[str] = []
    counts = []
    for text in unique:
        tokens = _TOKEN.findall(text)
        before = len(features)
        features += tokens
        features += map(" ".join, itertools.pairwise(tokens))
        features += (f"{i}\0{t}" for i, t in enumerate(tokens))
        features += (f"-{i}\0{t}" for i, t in enumerate(reversed(tokens)))
        counts.append(len(features) - before)
    hashes = np.fromiter(map(zlib.crc32, map(str.encode, features)), dtype=np.int64,
                         count=len(features))
    bits[np.repeat(np.arange(len(unique)), counts), hashes % (64 * SIG_WORDS)] = True
    encoded = [text.encode() for text in unique]
    data = np.frombuffer(b"".join(encoded), dtype=np.uint8).astype(np.uint64)
    line = np.repeat(np.arange(len(unique)), [len(e) for e in encoded])
    if len(data) > 2:
        same = line[:-2] == line[2:]
        codes = (data[:-2] << np.uint64(16)) | (data[1:-1] << np.uint64(8)) | data[2:]
        hashed = ((codes * np.uint64(2654435761)) >> np.uint64(13)) % np.uint64(64 * SIG_WORDS)
        bits[line[:-2][same], hashed[same].astype(np.int64)] = True
    packed = np.packbits(bits, axis=1, bitorder="little").view(np.uint64)
    packed.flags.writeable = False
    return {text: row for row, text in enumerate(unique)}, packed


DEFINES = re.compile(r"^(?:export\s+|pub\s+|async\s+)*(?:def|class|function|fn|func|struct|"
                      r"interface|enum|trait|impl|type|module)\s+(\w+)")


def token_similarity(a: str, b: str) -> float:
    """Share of tokens two lines have in common, in order (`return a + b` vs
    `return a - b`: 0.75). Short lines differ in few tokens, but each changed token
    breaks several trigrams and pairs, so the signature alone underrates their likeness.
    Lines that define different names are different definitions (a new test next to a
    similar old one), not an edit of one another: 0."""
    defines_a, defines_b = DEFINES.match(a), DEFINES.match(b)
    if defines_a and defines_b and defines_a.group(1) != defines_b.group(1):
        return 0.0
    return difflib.SequenceMatcher(None, _TOKEN.findall(a), _TOKEN.findall(b),
                                   autojunk=False).ratio()


@dataclass
class Segment:
    """The sketch items between two markers, and how far they are shifted against the
    file (`Aligner._runs_with_shift`)."""

    rows: list[int]
    strict: int | None
    usual: int | None


@dataclass
class Alignment:
    """ops[k] for sketch item k: ("match", o) | ("sub", o) | ("insert", o) | ("drop", o) |
    ("marker", o_from, o_to);
    `deleted` holds original lines removed inside segments."""

    cost: int
    ops: list[tuple]
    deleted: set[int]


class Aligner:
    def __init__(self, original: list[str], items: list[str | None],
                 optional: frozenset[int] = frozenset(), trivial_edges: bool = False,
                 marker_widths: dict[int, int] | None = None, mirrored: bool = False) -> None:
        """`items`: sketch lines, with None for an elision marker (the caller adds markers
        at both ends so a sketch may start and end anywhere). `optional` items (blank lines
        next to a marker: layout or context, nobody can tell) match a blank line or are
        dropped, never inserted. `trivial_edges`: a segment's `)`, `]`, `pass`... at a
        marker is its context like any other edge line (the merge's second reading).
        `marker_widths[k]`: the indentation of marker item k as written, which says what
        it stands for (`_block_bounds`); `mirrored`: the sketch and file are reversed (the
        merge's tie check), so a marker's block ends become starts."""
        self.original = original
        self.mirrored = mirrored
        self.items = items
        self.optional = optional
        onorm = [norm(x) for x in original]
        ids: dict[str, int] = {}
        self.ocode = np.array([ids.setdefault(t, len(ids)) for t in onorm], dtype=np.int64)
        self.icode = [None if it is None else ids.get(norm(it), -1) for it in items]
        self.icost = [0 if it is None else DROP if k in optional else
                      self._insert_cost(norm(it), ids) for k, it in enumerate(items)]
        self._plain_cost = list(self.icost)
        for k in self.edges():
            if self.icost[k] == INSERT_KNOWN:
                self.icost[k] = INSERT_EDGE  # it is the context that says where the edit goes
            elif self.icost[k] == INSERT_TRIVIAL and self.icode[k] >= 0 and items[k].strip():
                # `else:`, `pass`, `)` at a segment's edge: likely context too, but too common
                # to steer placement. Taken as new it costs a little more than deleting one
                # line, so the file's copy right there is its context (and a line between
                # them deleted) rather than a second copy added next to it.
                self.icost[k] = INSERT_EDGE if trivial_edges else EDGE_TRIVIAL
        self._edge_cost = list(self.icost)
        # Whether the first (last) marker, which the caller adds, may skip only blank lines:
        # the sketch shows the file's start (end). Set by the merge when it reads it so.
        self.anchored = (False, False)
        self.onorm = onorm
        self.osig = signatures(onorm)
        self.otrivial = np.array([trivial(t) for t in onorm], dtype=bool)
        self.subcost = [self._sub_cost(it, code) for it, code in zip(items, self.icode)]
        self.width = np.array([indent_width(line) for line in original], dtype=np.int64)
        # Columns (lines consumed) -> code lines among them: equal at two columns when only
        # blank lines lie between. Offsets that fall by more than any cost from one
        # stretch of blank lines to the next make a running minimum restart at each.
        self.code_count = np.concatenate(([0], np.cumsum([bool(x.strip()) for x in original])))
        self.stretch_offset = (int(self.code_count[-1]) - self.code_count) * (4 * INF)
        runs = self._runs_with_shift()
        self.shift_forbid = self._shift_forbid(runs)
        # Where each marker may start and end (columns 0..n; None: anywhere). Cleared by
        # the merge when no alignment fits them.
        self.bounds = self._block_bounds(runs, marker_widths or {})
        self.fresh: frozenset[int] = frozenset()  # items that may only be new lines

    def _runs_with_shift(self) -> list[Segment]:
        """Each run of items between markers, and how far it is shifted against the file
        (file indentation minus the sketch's), judged by its distinctive lines that the
        file has once: `strict` when they all agree and every distinctive line has a copy
        at that shift (a new line that copies one elsewhere in the file, at another
        depth, is no evidence), else None; `usual` when more than half agree (a new
        function copying lines of an old one at other depths still says where it is)."""
        counts = np.bincount(self.ocode, minlength=1) if len(self.ocode) else np.zeros(1)
        first = {int(c): o for o, c in reversed(list(enumerate(self.ocode)))}
        out: list[Segment] = []
        run: list[int] = []
        for k, item in enumerate([*self.items, None]):
            if item is not None:
                run.append(k)
                continue
            known = [j for j in run if self.icode[j] >= 0 and not trivial(norm(self.items[j]))]
            votes = Counter(int(self.width[first[self.icode[j]]]) - indent_width(self.items[j])
                            for j in known if counts[self.icode[j]] == 1)
            usual, most = votes.most_common(1)[0] if votes else (None, 0)
            strict = usual if len(votes) == 1 and all(
                np.any((self.ocode == self.icode[j])
                       & (self.width == indent_width(self.items[j]) + usual)) for j in known) \
                else None
            out.append(Segment(run, strict, usual if most * 2 > votes.total() else None))
            run = []
        return out

    def _block_bounds(self, runs: list[Segment],
                      marker_widths: dict[int, int]) -> dict[int, Bounds]:
        """A marker indented deeper than the code after it (`    # ... rest unchanged ...`
        above a new top-level `def`) stands for the rest of the block it is indented as: it
        ends where that block has closed, i.e. the file's indentation across its end drops
        from deeper than the segment's first line to no deeper (blank lines aside). Else a
        new function shown after it aligns onto a similar one inside that block, deleting
        what the marker stands for. In the mirrored problem the same marker follows the
        segment and starts where such a block opens. (Not the converse, a marker deeper
        than the code before it: models indent a marker as the last line it stands for,
        so its start says nothing; tried, it declined fresh-slice cases that merged before,
        imports followed by a marker at a method body's depth: structlog 03b514304e.)
        The depths are in the file's terms (the edge line's shift); an edge line with no
        known shift gets no bound. Indentation rather than a syntax tree: it is what the
        marker itself says, and the sketch does not parse."""
        widths = [int(w) if line.strip() else None for w, line in zip(self.width, self.original)]
        above: list[int | None] = [None]  # the last code line's width before each column
        for width in widths:
            above.append(width if width is not None else above[-1])
        below: list[int | None] = [None]  # the first code line's width from each column
        for width in reversed(widths):
            below.append(width if width is not None else below[-1])
        below.reverse()
        markers = [k for k, item in enumerate(self.items) if item is None]
        bounds: dict[int, Bounds] = {}
        for number, k in enumerate(markers):
            width = marker_widths.get(k)
            # runs[number] ends at marker `number`, runs[number + 1] starts after it
            edge = self._edge_width(runs[number], -1) if self.mirrored \
                else self._edge_width(runs[number + 1], 0)
            if width is None or edge is None or edge[1] is None or width <= edge[0]:
                continue
            depth = edge[0] + edge[1]
            # Code deeper than the segment's edge line on the marker's side of the column,
            # none on the segment's side (the mirrored problem reads the file upwards).
            inner, outer = (below, above) if self.mirrored else (above, below)
            mask = np.array([i is not None and i > depth and (o is None or o <= depth)
                             for i, o in zip(inner, outer)], dtype=bool)
            bounds[k] = (mask, None) if self.mirrored else (None, mask)
        return bounds

    def _edge_width(self, run: Segment, end: int) -> tuple[int, int | None] | None:
        """The sketch indentation of the run's first (`end` 0) or last (-1) line with code,
        and its shift: that of the file's copy when the file has the line once (a segment
        may re-indent its other lines on purpose), else the run's usual shift. None for a
        run without code (the file's edge)."""
        code = [k for k in run.rows if self.items[k].strip()]  # type: ignore[union-attr]
        if not code:
            return None
        k = code[end]
        width = indent_width(self.items[k])  # type: ignore[arg-type]
        copies = np.flatnonzero(self.ocode == self.icode[k]) if self.icode[k] >= 0 else []
        if len(copies) == 1:
            return width, int(self.width[copies[0]]) - width
        return width, run.usual

    def _shift_forbid(self, runs: list[Segment]) -> dict[int, np.ndarray]:
        """For each trivial line (`)`, `pass`, `else:`), the file lines it may not match.
        Such a line places nothing by itself, but its indentation says which copy it is:
        where a segment's distinctive lines that the file has once each agree on how far
        the segment is shifted, its trivial lines match only copies with that shift. (A
        `)` shown at a method body's depth after a body marker was matched to a top-level
        `)` further down, the code between kept, the file's `)` re-indented: attrs
        9b98a730bf.) Segments whose distinctive lines disagree (a block re-indented on
        purpose, a new line copying one at another depth) or that have none get no
        constraint."""
        forbid: dict[int, np.ndarray] = {}
        for run in runs:
            for j in run.rows if run.strict is not None else ():
                text = self.items[j]
                if self.icode[j] >= 0 and text.strip() and trivial(norm(text)):
                    forbid[j] = (self.ocode == self.icode[j]) & \
                        (self.width != indent_width(text) + run.strict)
        return forbid

    def _sub_cost(self, item: str | None, code: int | None) -> np.ndarray | None:
        """Cost of item replacing each original line (INF where it is not similar enough):
        the signature picks candidates, the token comparison decides."""
        # A line that exists verbatim in the file is context, never an edit of another line.
        if item is None or code != -1 or trivial(norm(item)) or not len(self.osig):
            return None
        text = norm(item)
        sig = signatures([text])[0]
        common = np.bitwise_count(self.osig & sig).sum(axis=1)
        union = np.maximum(np.bitwise_count(self.osig | sig).sum(axis=1), 1)
        similarity = np.where(self.otrivial, 0.0, common / union)
        candidates = np.flatnonzero(similarity >= SIG_CANDIDATE)
        if len(candidates) > MAX_CANDIDATES:
            candidates = candidates[np.argsort(-similarity[candidates])[:MAX_CANDIDATES]]
        similarity = np.zeros(len(self.osig))
        for o in candidates:
            similarity[o] = token_similarity(text, self.onorm[o])
        cost = (SUB_BASE + SUB_SCALE * (1 - similarity)).astype(np.int64)
        return np.where(similarity >= SUB_MIN_SIMILARITY, cost, INF)

    def edges(self) -> list[int]:
        """The first and last non-optional item of every run between markers."""
        out: list[int] = []
        run: list[int] = []
        for k, item in enumerate([*self.items, None]):
            if item is not None:
                if k not in self.optional:
                    run.append(k)
                continue
            out += sorted({run[0], run[-1]}) if run else []
            run = []
        return out

    @staticmethod
    def _insert_cost(text: str, known: dict[str, int]) -> int:
        if trivial(text):
            return INSERT_TRIVIAL
        return INSERT_KNOWN if text in known else INSERT

    def anchor(self, start: bool, end: bool) -> None:
        """Read the sketch as reaching the file's start (end). The first (last) line is
        then next to the file's edge, not to a marker, so it need not be context."""
        self.anchored = (start, end)
        edges = self.edges()
        for k, flag in ((edges[0], start), (edges[-1], end)) if edges else ():
            self.icost[k] = self._plain_cost[k] if flag else self._edge_cost[k]

    def plain_cost(self, k: int) -> int:
        """Item k's cost as a new line, were it not a segment's edge."""
        return self._plain_cost[k]

    def unplaced_context(self, alignment: Alignment) -> list[int]:
        """Run edge lines that exist in the file but were taken as new."""
        return [k for k in self.edges() if alignment.ops[k][0] == "insert"
                and self._edge_cost[k] == INSERT_EDGE]

    def _starts(self, prev: np.ndarray, k: int) -> np.ndarray:
        """The previous row where marker k may start (elsewhere INF)."""
        start = self.bounds.get(k, (None, None))[0]
        return prev if start is None else np.where(start, prev, INF)

    def _skip(self, prev: np.ndarray, k: int) -> np.ndarray:
        """An elision marker's row: any number of original lines skipped for free, except
        at an anchored edge, where only blank lines are, and within its `bounds`."""
        end = self.bounds.get(k, (None, None))[1]
        prev = self._starts(prev, k)
        row = self._free_skip(prev, k)
        return row if end is None else np.where(end, row, INF)

    def _free_skip(self, prev: np.ndarray, k: int) -> np.ndarray:
        row = np.minimum.accumulate(prev)
        blank = np.array([not line.strip() for line in self.original] + [True])
        if k == 0 and self.anchored[0]:
            lead = int(np.argmin(blank)) if not blank.all() else len(self.original)
            row = np.where(np.arange(len(prev)) <= lead, row, INF)
        elif k == len(self.items) - 1 and self.anchored[1]:
            tail = len(self.original) - int(np.argmin(blank[:-1][::-1])) \
                if not blank.all() else 0
            row = prev.copy()
            row[-1] = prev[tail:].min()
        return row

    def align(self, forbid: dict[int, np.ndarray] | None = None) -> Alignment | None:
        """Optimal alignment; `forbid[k]` masks original lines item k may not match (on top
        of `shift_forbid`)."""
        forbid = {k: self.shift_forbid.get(k, False) | (forbid or {}).get(k, False)
                  for k in {*self.shift_forbid, *(forbid or {})}}
        n = len(self.original)
        cols = np.arange(n + 1, dtype=np.int64)
        prev = np.full(n + 1, INF, dtype=np.int64)
        prev[0] = 0
        rows = [prev]
        bests = [prev]
        for k, item in enumerate(self.items):
            if item is None:
                row = self._skip(prev, k)
                best = row
            else:
                best = prev + self.icost[k]
                if self.subcost[k] is not None and k not in self.fresh:
                    best[1:] = np.minimum(best[1:], prev[:-1] + self.subcost[k])
                if self.icode[k] >= 0 and k not in self.fresh:
                    hit = np.zeros(n + 1, dtype=bool)
                    hit[1:] = self.ocode == self.icode[k]
                    if forbid and k in forbid:
                        hit[1:] &= ~forbid[k]
                    match = np.full(n + 1, INF, dtype=np.int64)
                    match[1:] = prev[:-1]
                    best = np.where(hit, np.minimum(best, match), best)
                # Affine deletion run ending at o: min_{j<o} best[j] + OPEN + EXTEND * (o - j).
                shifted = np.minimum.accumulate(best - DELETE_EXTEND * cols)
                run = np.full(n + 1, INF, dtype=np.int64)
                run[1:] = shifted[:-1] + DELETE_OPEN + DELETE_EXTEND * cols[1:]
                row = np.minimum(np.minimum(best, run), self._blank_run(best, cols))
            row = np.minimum(row, INF)
            rows.append(row)
            bests.append(best)
            prev = row
        cost = int(prev[n])
        if cost >= INF:
            return None
        return Alignment(cost, *self._trace(rows, bests, forbid))

    def _blank_run(self, best: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """Cost of a deletion of blank lines only ending at each column o:
        min over j < o with only blank lines between of best[j] + DELETE_BLANK * (o - j)
        (a running minimum restarted at every line with code, `stretch_offset`)."""
        keyed = np.minimum(best, INF) - DELETE_BLANK * cols + self.stretch_offset
        shifted = np.minimum.accumulate(keyed)
        run = np.full(len(best), INF, dtype=np.int64)
        run[1:] = shifted[:-1] - self.stretch_offset[1:] + DELETE_BLANK * cols[1:]
        return np.minimum(run, INF)

    def _trace(self, rows, bests, forbid) -> tuple[list[tuple], set[int]]:
        ops: list[tuple] = [()] * len(self.items)
        deleted: set[int] = set()
        o = len(self.original)
        for k in range(len(self.items), 0, -1):
            row, best, prev = rows[k], bests[k], rows[k - 1]
            item = self.items[k - 1]
            if item is None:
                # Skip back to the latest column the previous row reaches at this cost.
                start = int(np.flatnonzero(self._starts(prev, k - 1)[:o + 1] == row[o])[-1])
                ops[k - 1] = ("marker", start, o)
                o = start
                continue
            if row[o] != best[o]:  # a deletion run ends here
                cols = np.arange(o)
                blank = self.code_count[:o] == self.code_count[o]
                cost = np.where(blank, np.minimum(best[:o] + DELETE_BLANK * (o - cols), INF),
                                best[:o] + DELETE_OPEN + DELETE_EXTEND * (o - cols))
                j = int(np.flatnonzero(cost == row[o])[-1])
                deleted.update(range(j, o))
                o = j
            matchable = (o > 0 and self.icode[k - 1] == self.ocode[o - 1]
                         and k - 1 not in self.fresh
                         and not (forbid and k - 1 in forbid and forbid[k - 1][o - 1]))
            sub = self.subcost[k - 1]
            if matchable and prev[o - 1] == best[o]:
                ops[k - 1] = ("match", o - 1)
                o -= 1
            elif o > 0 and sub is not None and k - 1 not in self.fresh \
                    and prev[o - 1] + sub[o - 1] == best[o]:
                ops[k - 1] = ("sub", o - 1)
                o -= 1
            else:
                ops[k - 1] = ("drop" if k - 1 in self.optional else "insert", o)
        return ops, deleted
