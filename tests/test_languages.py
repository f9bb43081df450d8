"""The one language table, parser cache and syntax-error walk (`core/languages.py`) that the
chunker, Tab, apply and the agent's lints share."""

from __future__ import annotations

import threading

from codeplane.core.languages import (
    SyntaxIssue,
    code_language,
    first_error_line,
    language_for,
    parser,
    syntax_errors,
)


def test_one_table_for_code_and_data() -> None:
    assert language_for("src/app.PY") == code_language("src/app.py") == "python"
    assert language_for("a.b/lib.hh") == "cpp" and language_for("x.mjs") == "javascript"
    assert language_for("conf/app.yml") == "yaml" and code_language("conf/app.yml") is None
    for name in ("Makefile", "a.b/README", "notes.txt", "archive.tar.gz"):
        assert language_for(name) is None and code_language(name) is None


def test_a_parser_per_thread() -> None:
    mine = parser("python")
    other: list[object] = []
    thread = threading.Thread(target=lambda: other.append(parser("python")))
    thread.start()
    thread.join()
    assert parser("python") is mine and other[0] is not mine


def test_syntax_errors_in_source_order() -> None:
    text = "function f( {\n  return 1;\n}\nconst ok = 2;\nlet g = (;\n"
    found = syntax_errors(text, "javascript")
    assert found and [e.line for e in found] == sorted(e.line for e in found)
    assert found[0].line == 1 and found[-1].line == 5
    assert syntax_errors(text, "javascript", limit=1) == found[:1]
    assert first_error_line(text, "javascript") == 1
    assert syntax_errors("const ok = 2;\n", "javascript") == []
    assert first_error_line("x = 1\n", "python") is None
    assert [SyntaxIssue(2, 9, "}")] == syntax_errors("{\n  \"a\": 1\n", "json")
