"""Checks a merged file must pass before anyone writes it.

An apply that silently breaks or truncates a file is the failure users remember (see
docs/apply.md), so every result goes through: no elision marker survives, a file that parsed
before still parses (tree-sitter), and the size did not collapse for no visible reason.
"""

from __future__ import annotations

from functools import cache
from pathlib import PurePath

from codeplane.apply.formats import is_marker

# File suffix -> tree-sitter-language-pack grammar name.
LANGUAGES = {
    ".py": "python", ".pyi": "python", ".js": "javascript", ".mjs": "javascript",
    ".cjs": "javascript", ".jsx": "javascript", ".ts": "typescript", ".tsx": "tsx",
    ".go": "go", ".rs": "rust", ".java": "java", ".kt": "kotlin", ".c": "c", ".h": "c",
    ".cc": "cpp", ".cpp": "cpp", ".hpp": "cpp", ".cs": "csharp", ".rb": "ruby", ".php": "php",
    ".swift": "swift", ".scala": "scala", ".lua": "lua", ".sh": "bash", ".bash": "bash",
    ".json": "json", ".toml": "toml", ".yaml": "yaml", ".yml": "yaml", ".html": "html",
    ".css": "css",
}


def language_for(path: str) -> str | None:
    return LANGUAGES.get(PurePath(path).suffix.lower())


@cache
def _parser(language: str):
    from tree_sitter_language_pack import get_parser

    return get_parser(language)  # type: ignore[arg-type]


def first_error_line(text: str, language: str) -> int | None:
    """1-based line of the first syntax error, or None when the text parses cleanly."""
    root = _parser(language).parse(text.encode()).root_node
    if not root.has_error:
        return None
    stack = [root]
    while stack:
        node = stack.pop()
        if node.is_error or node.is_missing:
            return node.start_point[0] + 1
        stack.extend(reversed([c for c in node.children if c.has_error or c.is_missing
                               or c.is_error]))
    return root.start_point[0] + 1


def validate(original: str, merged: str, path: str) -> list[str]:
    """Problems that make `merged` unsafe to write; empty when it is fine."""
    problems = []
    literal = {line.strip() for line in original.splitlines()}
    for number, line in enumerate(merged.splitlines(), start=1):
        if is_marker(line) and line.strip() not in literal:
            problems.append(f"elision marker left in the result at line {number}: "
                            f"{line.strip()[:60]!r}")
            break
    language = language_for(path)
    if language and first_error_line(original, language) is None:
        bad = first_error_line(merged, language)
        if bad is not None:
            problems.append(f"result no longer parses as {language} (first error at line "
                            f"{bad}); the original did")
    return problems
