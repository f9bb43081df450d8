"""Tab's workspace context (tab/related.py): definitions of the names near the cursor, found
with tree-sitter over the files the client holds, stable while the user types."""

from __future__ import annotations

from pathlib import Path

from codeplane.tab.context import QUANTUM, Budget, build_request
from codeplane.tab.related import Related, WorkspaceDefs, names_near, related

HELPERS = '''"""Helpers."""


class Parser:
    """Reads headers."""

    def parse_header(self, raw: bytes, strict: bool = False) -> dict:
        """Split one raw header line."""
        return {}


def normalize_name(name: str) -> str:
    return name.lower()
'''


def app_source(filler: int = 40) -> str:
    body = "".join(f"    step_{i} = {i}\n" for i in range(filler))
    return ("from helpers import Parser, normalize_name\n\n\ndef handle(raw):\n"
            "    parser = Parser()\n    fields = parser.parse_header(raw)\n" + body +
            "    return normalize_name(\n")


def test_definitions_of_nearby_names_come_from_other_files():
    defs = WorkspaceDefs()
    defs.add("pkg/helpers.py", HELPERS)
    text = app_source(0)
    line = text.count("\n")  # the empty last line, right after `return normalize_name(`
    chunks = related("pkg/app.py", text, line, defs, (0, 0), 400)
    texts = [c.text for c in chunks]
    assert any("def normalize_name(name: str) -> str:" in t for t in texts)
    # a method comes with its class line, so the model knows where it lives
    method = next(t for t in texts if "def parse_header" in t)
    assert method.startswith("class Parser:") and chunks[0].path == "pkg/helpers.py"


def test_the_cursor_line_and_far_lines_do_not_choose_context():
    text = "alpha_one = 1\n" + "x = 0\n" * (3 * QUANTUM) + "beta_two = gamma_three\n"
    last = text.count("\n") - 1
    near = names_near(text, last)
    assert "beta_two" not in near and "gamma_three" not in near  # typed on the cursor line
    assert "alpha_one" not in near  # three blocks away


def test_budget_and_window_limit_what_is_sent():
    defs = WorkspaceDefs()
    defs.add("pkg/helpers.py", HELPERS)
    text = app_source(0)
    line = text.count("\n")
    assert related("pkg/app.py", text, line, defs, (0, 0), 1) == []
    local = HELPERS + "\n\ndef use():\n    normalize_name('x')\n    \n"
    cursor = local.count("\n") - 1
    # the definition is inside the window the server already gets: not repeated
    assert all("def normalize_name" not in c.text for c in
               related("pkg/helpers.py", local, cursor, WorkspaceDefs(), (0, cursor + 1), 400))


def test_the_edited_document_replaces_the_indexed_copy():
    """What the editor holds now is what is searched - never the file as it was on disk
    (in the benchmark that older copy holds the line the user is about to type)."""
    defs = WorkspaceDefs()
    defs.add("pkg/a.py", "def old_name():\n    pass\n\n\nx = 1\n")
    edited = "def new_name():\n    pass\n\n\nold_name()\nnew_name()\n\n"
    texts = [c.text for c in related("pkg/a.py", edited, 7, defs, (6, 7), 400)]
    assert texts == ["def new_name():\n    pass"]


def test_context_is_frozen_while_typing_within_a_block():
    defs = WorkspaceDefs()
    defs.add("pkg/helpers.py", HELPERS)
    rel = Related(defs)
    text = app_source(40)
    budget = Budget(prefix_tokens=64, suffix_tokens=16)
    offset = text.index("    step_20")
    first = build_request("pkg/app.py", text, offset, None, budget, rel)["context"]
    typed = text[:offset] + "    fields = normalize_na" + text[offset:]
    again = build_request("pkg/app.py", typed, offset + 25, None, budget, rel)["context"]
    assert again == first
    # the small prefix window no longer shows `parser.parse_header(...)`: it is sent
    assert any("def parse_header" in c["text"] for c in first)


def test_scan_reads_workspace_files_of_the_language_only(tmp_path: Path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "helpers.py").write_text(HELPERS)
    (tmp_path / "notes.txt").write_text("def not_code(): pass\n")
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "vendored.py").write_text("def vendored(): pass\n")
    defs = WorkspaceDefs()
    assert defs.scan(tmp_path, "app.py") == 1
    assert [d.path for d in defs.lookup("normalize_name")] == ["pkg/helpers.py"]
    assert defs.lookup("vendored") == [] and defs.lookup("not_code") == []
