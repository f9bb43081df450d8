"""Variants of the text the embedder sees for a chunk (the *vector* input only: BM25 and the
snippets keep the source), for `evaluate.py --layout NAME`.

bge-small is a general-domain English model: `parse_http_date` is one rare wordpiece soup to it,
"parse http date" three words it knows. Each variant here is one idea about closing that gap;
`evaluate.py` measures them against today's layout (`Chunk.embed_text`: a `# path` line, the
enclosing signatures, the source).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from codeplane.indexing.chunker import Chunk

IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
CAMEL = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|[0-9]+")
DEF = re.compile(r"^\s*(?:async\s+def|def|class)\s+(\w+)", re.MULTILINE)
COMMENT = re.compile(r"^\s*#.*\n?", re.MULTILINE)


def words(identifier: str) -> list[str]:
    """`getHTTPResponse` -> get, http, response; `_parse_date` -> parse, date."""
    return [p.lower() for piece in identifier.split("_") for p in CAMEL.findall(piece)]


def compound(identifier: str) -> bool:
    return len(words(identifier)) > 1


def spaced(text: str) -> str:
    """Every compound identifier replaced by its words (`parse_http_date` -> parse http date)."""
    return IDENT.sub(lambda m: " ".join(words(m.group(0))) if compound(m.group(0))
                     else m.group(0), text)


def word_line(text: str) -> str:
    """The chunk's compound identifiers as words, first occurrence order, each once."""
    seen = dict.fromkeys(" ".join(words(i)) for i in IDENT.findall(text) if compound(i))
    return " ".join(seen)


def path_words(rel: str) -> str:
    parts = re.split(r"[/.]", rel.rsplit(".", 1)[0])
    return " ".join(w for p in parts for w in words(p))


def def_line(chunk: Chunk) -> str:
    """What the chunk defines, in words: "class response / def iter content"."""
    names = DEF.findall(chunk.context + "\n" + chunk.text)
    return " / ".join(" ".join(words(n)) for n in dict.fromkeys(names))


def today(rel: str, chunk: Chunk) -> str:
    return chunk.embed_text(rel)


def words_appended(rel: str, chunk: Chunk) -> str:
    return f"{chunk.embed_text(rel)}\n{word_line(chunk.context + chr(10) + chunk.text)}"


def words_substituted(rel: str, chunk: Chunk) -> str:
    return spaced(chunk.embed_text(rel))


def header(rel: str, chunk: Chunk) -> str:
    """A first line in words: path words and what the chunk defines, then today's text."""
    return f"{path_words(rel)}: {def_line(chunk)}\n{chunk.embed_text(rel)}"


def header_words(rel: str, chunk: Chunk) -> str:
    return f"{path_words(rel)}: {def_line(chunk)}\n{spaced(chunk.embed_text(rel))}"


def defs_first(rel: str, chunk: Chunk) -> str:
    """Only the definition's name in words ahead of the source (no path words)."""
    return f"{def_line(chunk)}\n{chunk.embed_text(rel)}"


def no_comments(rel: str, chunk: Chunk) -> str:
    stripped = Chunk(chunk.start_line, chunk.end_line, COMMENT.sub("", chunk.text),
                     chunk.context)
    return stripped.embed_text(rel)


def no_path(rel: str, chunk: Chunk) -> str:
    return (f"{chunk.context}\n" if chunk.context else "") + chunk.text


LAYOUTS: dict[str, Callable[[str, Chunk], str]] = {
    "today": today, "words-appended": words_appended, "words-substituted": words_substituted,
    "header": header, "header-words": header_words, "defs-first": defs_first,
    "no-comments": no_comments, "no-path": no_path,
}
