"""Sketches as chat models write them: every marker wording, comment syntax and placement
must either merge to what a careful reader would write or decline; never may the code a
marker stands for be deleted with `ok: true`. Also whitespace drift in context lines (the
file keeps its own bytes) and the wrong-merge guard. Deterministic path only (no model)."""

from __future__ import annotations

import pytest

from codeplane.apply.api import apply_edit

STORE = '''import os


class Store:
    """Files under a root directory, cached in memory."""

    def __init__(self, root):
        self.root = root
        self.items = {}
        self.loaded = False

    def load(self):
        for name in os.listdir(self.root):
            with open(os.path.join(self.root, name)) as fh:
                self.items[name] = fh.read()
        self.loaded = True
        return self.items

    def save(self, name, text):
        path = os.path.join(self.root, name)
        with open(path, "w") as fh:
            fh.write(text)
        self.items[name] = text


def main():
    store = Store(".")
    store.load()
    print(len(store.items))
'''
EXPECTED = STORE.replace("        return self.items\n", "        return dict(self.items)\n")

WORDINGS = [
    "# ... existing code ...", "# ... rest of the function unchanged ...", "# (unchanged)",
    "# existing code here", "# [previous implementation]", "...", "# ...",
    "# rest of the code unchanged", "# ... (unchanged) ...", "# … existing methods …",
    "# [rest of file unchanged]", "# unchanged code", "# (rest of the class omitted)",
    "# keep existing code", "# remaining methods unchanged", "# ...existing code...",
]


def _sketch(wording: str) -> str:
    """Header lines kept as context, markers in function bodies, indented as the block
    they stand for."""
    return f"""{wording}
class Store:
    {wording}
    def load(self):
        {wording}
        self.loaded = True
        return dict(self.items)

    def save(self, name, text):
        {wording}
{wording}
"""


@pytest.mark.parametrize("wording", WORDINGS)
def test_marker_wording_in_body_and_under_headers_merges(wording: str) -> None:
    result = apply_edit(STORE, _sketch(wording), "store.py")
    assert result.ok, result.diagnostics
    assert result.merged == EXPECTED


@pytest.mark.parametrize("wording", WORDINGS)
def test_marker_wording_between_context_keeps_the_elided_lines(wording: str) -> None:
    sketch = f"""    def __init__(self, root):
        self.root = root
    {wording}
        self.loaded = True
        return dict(self.items)
{wording}
"""
    result = apply_edit(STORE, sketch, "store.py")
    assert result.ok, result.diagnostics
    assert result.merged == EXPECTED


JS = """import fs from "fs";

export function load(root) {
  const items = {};
  for (const name of fs.readdirSync(root)) {
    items[name] = fs.readFileSync(name, "utf8");
  }
  return items;
}

export function save(root, name, text) {
  fs.writeFileSync(root + "/" + name, text);
}
"""


@pytest.mark.parametrize("wording", ["// existing code here", "// ... rest unchanged ...",
                                     "/* unchanged */", "// (previous implementation)",
                                     "/* ... */"])
def test_c_style_markers_keep_the_loop(wording: str) -> None:
    sketch = f"""{wording}
export function load(root) {{
  {wording}
    items[name] = fs.readFileSync(name, "utf8");
  }}
  return {{ ...items }};
}}
{wording}
"""
    result = apply_edit(JS, sketch, "store.js")
    assert result.ok, result.diagnostics
    assert result.merged == JS.replace("  return items;", "  return { ...items };")


SQL = """-- schema
CREATE TABLE users (
  id INTEGER PRIMARY KEY,
  name TEXT NOT NULL,
  email TEXT
);

CREATE INDEX users_name ON users (name);
"""


@pytest.mark.parametrize("wording", ["-- ... existing columns ...", "-- (unchanged)"])
def test_sql_markers_keep_the_columns(wording: str) -> None:
    sketch = f"""{wording}
CREATE TABLE users (
  id INTEGER PRIMARY KEY,
  {wording}
  name TEXT NOT NULL,
  email TEXT UNIQUE
);
{wording}
"""
    result = apply_edit(SQL, sketch, "schema.sql")
    assert result.ok, result.diagnostics
    assert result.merged == SQL.replace("email TEXT\n", "email TEXT UNIQUE\n")


HTML = """<html>
<body>
  <h1>Title</h1>
  <p>First</p>
  <p>Second</p>
  <footer>old</footer>
</body>
</html>
"""


@pytest.mark.parametrize("wording", ["<!-- ... existing markup ... -->",
                                     "<!-- unchanged -->"])
def test_html_markers_keep_the_markup(wording: str) -> None:
    sketch = f"""{wording}
<body>
  <h1>Title</h1>
  {wording}
  <p>Second</p>
  <footer>new</footer>
</body>
{wording}
"""
    result = apply_edit(HTML, sketch, "page.html")
    assert result.ok, result.diagnostics
    assert result.merged == HTML.replace("old", "new")


def test_new_stub_body_is_code_not_a_marker() -> None:
    sketch = """    def save(self, name, text):
        path = os.path.join(self.root, name)
        with open(path, "w") as fh:
            fh.write(text)
        self.items[name] = text

    def close(self):
        ...
# ... existing code ...
"""
    result = apply_edit(STORE, sketch, "store.py")
    assert result.ok, result.diagnostics
    want = STORE.replace("        self.items[name] = text\n",
                         "        self.items[name] = text\n\n    def close(self):\n        ...\n")
    assert _code(result.merged) == _code(want)  # where the blank lines go is not the point


def _code(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]
