"""Next-edit Tab through a real LSP session: a scripted JSON-RPC client drives
`codeplane lsp` (a spawned process) against a live server with the real code-small model."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from test_lsp_tab import LspClient

pytestmark = pytest.mark.model

SHAPES = '''def area(width, height):
    """Area of a rectangle."""
    return width * height


def report(shapes):
    total = 0
    for w, h in shapes:
        total += area(w, h)
    small = area(1, 2)
    return total + small
'''


def apply_item(text: str, item: dict) -> str:
    """Replace the item's range with its text, as an editor accepting it does."""
    lines = text.splitlines(keepends=True)

    def offset(pos: dict) -> int:
        return sum(len(x) for x in lines[:pos["line"]]) + pos["character"]

    rng = item["range"]
    return text[:offset(rng["start"])] + item["insertText"] + text[offset(rng["end"]):]


def test_a_rename_gets_a_range_replacing_suggestion(live_server, tmp_path):
    source = tmp_path / "shapes.py"
    source.write_text(SHAPES)  # the editor opened it from disk
    env = {**os.environ, "CODEPLANE_HOME": str(tmp_path / "home")}
    client = LspClient([sys.executable, "-m", "codeplane", "lsp", "--server", live_server.url,
                        "--debounce-ms", "0", "--min-confidence", "0"], env)
    try:
        client.request("initialize", {"processId": os.getpid(), "rootUri": None,
                                      "capabilities": {}})
        client.notify("initialized", {})
        uri = Path(source).as_uri()
        client.notify("textDocument/didOpen", {"textDocument": {
            "uri": uri, "languageId": "python", "version": 1, "text": SHAPES}})
        # the user renames the first call site: `area` -> `surface`, one keystroke at a time
        line = SHAPES.splitlines().index("        total += area(w, h)")
        col = len("        total += ")
        version = 1
        for n in range(4):  # backspace over "area"
            version += 1
            client.notify("textDocument/didChange", {
                "textDocument": {"uri": uri, "version": version},
                "contentChanges": [{"range": {"start": {"line": line, "character": col + 3 - n},
                                              "end": {"line": line, "character": col + 4 - n}},
                                    "text": ""}]})
        for n, ch in enumerate("surface"):
            version += 1
            client.notify("textDocument/didChange", {
                "textDocument": {"uri": uri, "version": version},
                "contentChanges": [{"range": {"start": {"line": line, "character": col + n},
                                              "end": {"line": line, "character": col + n}},
                                    "text": ch}]})
        text = SHAPES.replace("total += area(", "total += surface(")
        where = {"textDocument": {"uri": uri},
                 "position": {"line": line, "character": col + len("surface")},
                 "context": {"triggerKind": 2}}
        items = client.request("textDocument/inlineCompletion", where, timeout=300)["items"]
        assert items, "no suggestion after the rename"
        item = items[0]
        rng = item["range"]
        # a next edit replaces a region (not an insertion at the cursor) ...
        assert (rng["start"], rng["end"]) != (where["position"], where["position"]), item
        assert rng["start"]["character"] == 0 and rng["start"] != rng["end"], item
        applied = apply_item(text, item)
        # ... which the editor applies: the file changes, the user's own rename stays
        assert applied != text and "total += surface(w, h)" in applied, (item, applied)
        if item.get("command"):
            assert item["command"]["command"] == "codeplane.nextEdit.jump"
        print("LSP next edit:", item, "\n--- applied ---\n" + applied)  # the transcript
    finally:
        client.close()
