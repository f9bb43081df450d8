"""What most apply tests check: the edit applied to the original gives exactly the expected
file (the diagnostics shown when it does not apply)."""

from __future__ import annotations

from codeplane.apply.service import ApplyResult, apply_edit


def merges(original: str, edit: str, path: str, expected: str, **options) -> ApplyResult:
    result = apply_edit(original, edit, path, **options)
    assert result.ok, result.diagnostics
    assert result.merged == expected
    return result
