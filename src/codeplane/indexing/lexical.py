"""Query understanding for hybrid search, on the client (it holds the text; the server sees only
vectors): which words of a request are worth matching lexically, what shape the request has,
and two code-aware signals that need the source - a path that names a query word, and a chunk
that defines an identifier the query names.

BM25 itself runs in SQLite FTS5 over identifier-split tokens (`state.lexical_tokens`:
`getHTTPResponse` -> get, http, response, gethttpresponse); this module only decides what to ask
it. A request like "Fix `Request.hooks` typing" names code; "pass bytes unstyled from secho to
echo" mixes words and identifiers; a docstring sentence is prose. The fusion weights differ per
shape (`indexing.rank`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from codeplane.indexing.state import lexical_tokens

# English function words and change-request verbs: frequent in requests, carry no location.
# Hand-listed (not nltk's list) because commit verbs like "fix"/"add" matter as much as "the".
STOPWORDS = frozenset(["a", "an", "and", "are", "as", "at", "be", "been", "being", "but", "by", "can", "could", "did", "do", "does", "done", "for", "from", "had", "has", "have", "how", "if", "in", "into", "is", "it", "its", "it's", "may", "might", "must", "no", "not", "of", "on", "or", "our", "should", "so", "such", "than", "that", "the", "their", "them", "then", "there", "these", "this", "those", "to", "too", "was", "we", "were", "what", "when", "where", "which", "while", "who", "why", "will", "with", "would", "you", "your", "fix", "fixed", "fixes", "fixing", "add", "added", "adds", "adding", "allow", "allows", "remove", "removed", "removes", "use", "used", "uses", "using", "make", "makes", "made", "now", "also", "instead", "when", "new", "support", "supports", "properly", "correctly", "issue", "bug", "change", "changed", "changes", "update", "updated", "updates", "don", "doesn", "isn", "won"])
CODEISH = re.compile(r"`[^`]+`|\b\w+\.\w+\b|\b\w*[A-Za-z0-9]_\w+|\b_\w+|\b[a-z]+[A-Z]\w*"
                     r"|\b[A-Z][a-z]+[A-Z]\w*|\w+\(\)|--[a-z][\w-]+")
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# A request that says one of these asks for tests ("the tests of the retry logic",
# `test_retry_after`): ranking must not demote them for it (`indexing.rank`).
TEST_WORDS = frozenset(["test", "tests", "testing", "spec", "specs", "conftest", "fixture",
                        "fixtures"])


class Shape(StrEnum):
    """Prose (a docstring, a description), mixed (words naming code), identifier (just a name)."""

    PROSE = "prose"
    MIXED = "mixed"
    IDENTIFIER = "identifier"


@dataclass(frozen=True)
class Query:
    text: str
    shape: Shape
    terms: tuple[str, ...]  # lower-case lexical tokens, function words dropped
    names: frozenset[str]  # identifiers as written (case kept), for definition matching

    @property
    def lexical_text(self) -> str:
        """What to hand to the BM25 index: the informative tokens only."""
        return " ".join(self.terms)

    @property
    def asks_for_tests(self) -> bool:
        return not TEST_WORDS.isdisjoint(self.terms)


def analyse(text: str) -> Query:
    words = text.split()
    code = CODEISH.findall(text)
    if len(words) <= 2 and all(IDENTIFIER.fullmatch(w.strip("`()")) for w in words):
        shape = Shape.IDENTIFIER
    elif code:
        shape = Shape.MIXED
    else:
        shape = Shape.PROSE
    terms = tuple(dict.fromkeys(t for t in lexical_tokens(text) if t not in STOPWORDS))
    names = {n for n in IDENTIFIER.findall(" ".join(code) if shape != Shape.IDENTIFIER else text)
             if len(n) > 2}
    return Query(text, shape, terms, frozenset(names))


def path_match(query: Query, path: str) -> float:
    """1.0 when the file's name names a query term (`config.py` for "config loading"), 0.5 when
    a directory does, else 0. File names are the strongest lexical hint a request gives."""
    *dirs, name = path.split("/")
    stem = name.rsplit(".", 1)[0]
    terms = set(query.terms)
    if any(t in terms for t in lexical_tokens(stem) if len(t) > 2):
        return 1.0
    if any(t in terms for d in dirs for t in lexical_tokens(d) if len(t) > 2):
        return 0.5
    return 0.0


def defines(query: Query, text: str) -> float:
    """1.0 when the chunk defines (def/class/assignment at line start) an identifier the query
    names: "where is `make_context`" wants the definition, not its forty call sites."""
    if not query.names:
        return 0.0
    names = "|".join(re.escape(n) for n in sorted(query.names))
    pattern = rf"^\s*(?:async\s+def|def|class)\s+(?:{names})\b|^\s*(?:{names})\s*[:=]"
    return 1.0 if re.search(pattern, text, re.MULTILINE) else 0.0
