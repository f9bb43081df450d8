"""Fuse the server's dense hits with the client's BM25 hits, per chunk and per file.

Why not reciprocal-rank fusion: it gives a weak lexical list as much say as a strong dense one,
and on docstring -> function queries it ranked worse than dense alone. Here each list's
scores are normalised by the query's best score and mixed with a few weights fitted per query
shape (`lexical.Shape`) on tuning repositories (`bench/search/evaluate.py --fit`), then checked
on held-out repositories. Files are ranked by their best chunk, plus their second-best chunk,
plus a path that names a query word: "where would this change go" is a question about files.
Documentation (changelogs, READMEs, prose docs) and tests are demoted, not dropped: a changelog
entry restates a change request and a test names the behaviour it checks, so either would
outrank the code the request is about (docs/search.md, "Documentation in file ranking" and
"The whole tree indexed: tests and docs demoted").
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from codeplane.core.languages import code_language
from codeplane.indexing.lexical import Query, Shape, defines, path_match

DOC_SUFFIXES = (".md", ".markdown", ".rst", ".adoc", ".txt")
DOC_NAMES = ("changes", "changelog", "history", "news", "readme", "authors", "contributing",
             "license", "notice")
# Not `testing/`: numpy.testing and pandas._testing are libraries other code imports.
TEST_DIRS = frozenset({"test", "tests", "__tests__", "spec", "specs", "testsuite"})
TEST_STEM = re.compile(r"test_.+|conftest|.+_test|.+_spec|.+\.(?:test|spec)|.+Tests?")

Key = tuple[str, int, int]  # (workspace-relative path, start line, end line)
DEMOTED = 0.3  # the fitted `docs` and `tests` factor (see the fit's comment below)


@dataclass(frozen=True)
class Weights:
    dense: float  # normalised cosine
    lexical: float  # normalised BM25
    define: float  # the chunk defines an identifier the query names
    second: float  # files: share of the second-best chunk's score
    path: float  # files: the file's path names a query word
    docs: float = DEMOTED  # multiplier of a documentation chunk's score (`is_documentation`)
    tests: float = DEMOTED  # multiplier of a test chunk's score (`is_test`)


# Fitted by `python bench/search/evaluate.py --fit` on the tuning repositories (click, flask,
# jinja, requests): a grid over these weights per shape, best mean MRR@10 + R@5. Chunks: from
# docstring -> function (prose, mixed) and identifier lookups; files: from commit-message
# localisation. No localisation request was a bare identifier, so files borrow the chunk fit
# there. Identifier `define` tied on tuning over a range; 1.0 is kept because a name called from
# many short places otherwise out-scores its definition lexically. The `docs` and `tests`
# factors (DEMOTED): tuning scores stop rising well above it, and a factor above zero keeps a
# changelog or a test reachable when no code matches. The scans and held-out numbers: docs/indexing.md
# ("Numbers behind the code's comments"), docs/search.md.
CHUNK_WEIGHTS = {
    Shape.PROSE: Weights(dense=0.8, lexical=0.2, define=0.0, second=0.0, path=0.0),
    Shape.MIXED: Weights(dense=0.7, lexical=0.3, define=0.0, second=0.0, path=0.0),
    Shape.IDENTIFIER: Weights(dense=0.0, lexical=1.0, define=1.0, second=0.0, path=0.0),
}
FILE_WEIGHTS = {
    Shape.PROSE: Weights(dense=0.3, lexical=0.7, define=0.0, second=0.0, path=0.0),
    Shape.MIXED: Weights(dense=0.1, lexical=0.9, define=0.5, second=0.2, path=0.0),
    Shape.IDENTIFIER: Weights(dense=0.0, lexical=1.0, define=1.0, second=0.0, path=0.0),
}

# `indexing.fusion = "dense"`: the server's ranking alone (files by their best chunk).
DENSE_ONLY = Weights(dense=1.0, lexical=0.0, define=0.0, second=0.0, path=0.0, docs=1.0,
                     tests=1.0)


def is_documentation(path: str) -> bool:
    """Prose about the project rather than the project: `*.md`, `*.rst`, `*.txt` (but not
    `requirements*.txt`), or a CHANGES / HISTORY / README / LICENSE ... file that is not
    source code (`history.py` is code)."""
    name = path.rsplit("/", 1)[-1].lower()
    if name.endswith(DOC_SUFFIXES):
        return not name.startswith("requirements")
    return name.split(".", 1)[0] in DOC_NAMES and code_language(name) is None


def is_test(path: str) -> bool:
    """A test: anything under a `tests/` (`test/`, `__tests__/`, `spec/` ...) directory, its
    fixtures too, or a source file named like one (`test_x.py`, `x_test.go`, `x.test.ts`,
    `x.spec.js`, `XTest.java`, `conftest.py`)."""
    *dirs, name = path.split("/")
    if TEST_DIRS.intersection(dirs):
        return True
    return code_language(name) is not None and bool(TEST_STEM.fullmatch(name.rsplit(".", 1)[0]))


def _normalised(hits: list[tuple[Key, float]]) -> dict[Key, float]:
    """Scores scaled into [0, 1] by the list's min and max: cosines of bge-small crowd into
    0.6-0.9 and BM25 is unbounded, so raw values are not comparable across lists or queries."""
    if not hits:
        return {}
    scores = [s for _, s in hits]
    low, high = min(scores), max(scores)
    span = high - low
    out: dict[Key, float] = {}
    for key, score in hits:
        out.setdefault(key, (score - low) / span if span > 0 else 1.0)
    return out


def fuse_chunks(query: Query, dense: list[tuple[Key, float]], lexical: list[tuple[Key, float]],
                text_of: Callable[[Key], str | None], weights: Weights | None = None,
                unembedded: frozenset[Key] = frozenset()) -> list[tuple[Key, float]]:
    """Chunks from either list, best first, scored by the shape's weights (documentation and
    tests scaled down). `unembedded` chunks (withheld for secrets, or not uploaded yet) have no
    dense score to lose: their lexical score stands in for it, so they compete on what is
    known."""
    w = weights or CHUNK_WEIGHTS[query.shape]
    d, lex = _normalised(dense), _normalised(lexical)
    scored = []
    for key in dict.fromkeys([*d, *lex]):
        semantic = lex.get(key, 0.0) if key in unembedded else d.get(key, 0.0)
        score = w.dense * semantic + w.lexical * lex.get(key, 0.0)
        if w.define and query.names:
            text = text_of(key)
            score += w.define * (defines(query, text) if text else 0.0)
        scored.append((key, score * _kind_factor(key[0], w, query)))
    return sorted(scored, key=lambda kv: -kv[1])


def rank_files(query: Query, chunks: list[tuple[Key, float]], weights: Weights | None = None
               ) -> list[tuple[str, float, Key]]:
    """(path, score, best chunk) best first, from fused chunk scores (`fuse_chunks` with the
    same weights: documentation and tests are scaled there, and their path bonus here)."""
    w = weights or FILE_WEIGHTS[query.shape]
    best: dict[str, list[tuple[float, Key]]] = {}
    for key, score in chunks:
        top = best.setdefault(key[0], [])
        if len(top) < 2:
            top.append((score, key))  # `chunks` is sorted: the first two are the best
    files = []
    for path, top in best.items():
        second = top[1][0] if len(top) > 1 else 0.0
        bonus = w.path * path_match(query, path) * _kind_factor(path, w, query)
        score = top[0][0] + w.second * second + bonus
        files.append((path, score, top[0][1]))
    return sorted(files, key=lambda f: -f[1])


def _kind_factor(path: str, w: Weights, query: Query) -> float:
    """The demotion of documentation and tests; none for tests the request asks for."""
    if is_documentation(path):
        return w.docs
    return w.tests if is_test(path) and not query.asks_for_tests else 1.0
