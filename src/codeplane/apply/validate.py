"""Checks a merged file must pass before anyone writes it.

An apply that silently breaks or truncates a file is the failure users remember (see
docs/apply.md), so every result goes through: no elision marker survives, a file that parsed
before still parses (tree-sitter), and the size did not collapse for no visible reason.
"""

from __future__ import annotations

from codeplane.apply.formats import is_marker
from codeplane.core.languages import first_error_line, language_for


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
