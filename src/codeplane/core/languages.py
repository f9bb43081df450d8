"""The languages of source files, for every compartment that parses them with tree-sitter (the
chunker, Tab's definitions, apply's checks, the agent's lints): one suffix table, one parser
cache, one syntax-error walk.

`language_for` names the grammar that reads a file (data and markup included: apply checks
that a JSON file still parses); `code_language` names its programming language, None for
data and markup, which have no definitions to split at or look up (the chunker, Tab and the
search ranking treat those files as text).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

# File suffix (lower case, without the dot) -> tree-sitter-language-pack grammar name.
LANGUAGES = {
    "py": "python", "pyi": "python", "js": "javascript", "jsx": "javascript",
    "mjs": "javascript", "cjs": "javascript", "ts": "typescript", "tsx": "tsx", "go": "go",
    "rs": "rust", "java": "java", "c": "c", "h": "c", "cc": "cpp", "cpp": "cpp", "cxx": "cpp",
    "hpp": "cpp", "hh": "cpp", "cs": "csharp", "rb": "ruby", "php": "php", "kt": "kotlin",
    "swift": "swift", "scala": "scala", "sh": "bash", "bash": "bash", "lua": "lua",
    "json": "json", "toml": "toml", "yaml": "yaml", "yml": "yaml", "html": "html", "css": "css",
}
DATA = frozenset({"json", "toml", "yaml", "html", "css"})  # grammars of data and markup

# Node types that are definitions (functions, classes, methods, types, modules) across the
# grammars above: what the chunker keeps whole and Tab looks names up in.
DEF_TYPES = frozenset({
    "function_definition", "class_definition", "decorated_definition", "function_declaration",
    "generator_function_declaration", "method_definition", "method_declaration",
    "class_declaration", "interface_declaration", "constructor_declaration", "enum_declaration",
    "record_declaration", "function_item", "impl_item", "struct_item", "enum_item", "trait_item",
    "mod_item", "type_declaration", "method", "singleton_method", "class", "module",
    "function_signature", "abstract_class_declaration", "object_declaration",
    "namespace_definition", "struct_specifier", "class_specifier", "export_statement",
})


@lru_cache(maxsize=256)
def language_for(path: str) -> str | None:
    """The grammar for a file name or path, by its suffix; None without one."""
    name = path.rsplit("/", 1)[-1]
    return LANGUAGES.get(name.rsplit(".", 1)[-1].lower()) if "." in name else None


def code_language(path: str) -> str | None:
    """The programming language of a file; None for data, markup and unknown suffixes."""
    language = language_for(path)
    return None if language in DATA else language


_local = threading.local()  # a tree-sitter parser must not be used by two threads at once


def parser(language: str) -> Any:
    """This thread's parser for `language` (LookupError if the grammar pack lacks it)."""
    cache = _local.__dict__.setdefault("parsers", {})
    if language not in cache:
        from tree_sitter_language_pack import get_parser  # loads on first parse, not import

        cache[language] = get_parser(language)  # type: ignore[arg-type]
    return cache[language]


@dataclass(frozen=True)
class SyntaxIssue:
    line: int  # 1-based
    column: int  # 1-based
    missing: str | None = None  # the node tree-sitter assumed absent; None: unparsable text


def syntax_errors(text: str, language: str, limit: int = 20) -> list[SyntaxIssue]:
    """The first `limit` syntax errors in `text`, in source order: ERROR nodes and the
    MISSING ones tree-sitter inserted to recover. Only subtrees that contain an error are
    walked."""
    found: list[SyntaxIssue] = []
    stack = [parser(language).parse(text.encode()).root_node]
    while stack and len(found) < limit:
        node = stack.pop()
        row, column = node.start_point
        if node.is_missing:
            found.append(SyntaxIssue(row + 1, column + 1, node.type))
        elif node.is_error:
            found.append(SyntaxIssue(row + 1, column + 1))
        elif node.has_error:
            stack.extend(reversed(node.children))
    return found


def first_error_line(text: str, language: str) -> int | None:
    """1-based line of the first syntax error, or None when the text parses cleanly."""
    first = syntax_errors(text, language, limit=1)
    return first[0].line if first else None
