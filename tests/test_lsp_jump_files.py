"""What the LSP sends with a next-edit request for the jump: only the open document the
jump can lead to (in process: the request body is read where the LSP hands it to its
server client; no model, no server)."""

from __future__ import annotations

import asyncio

from lsprotocol import types as lsp
from pygls.workspace import Workspace

from codeplane.tab.lsp import TabLanguageServer
from codeplane.tab.telemetry import Telemetry


class _Client:
    """Stands where the LSP's HTTP client does and keeps the bodies it is given."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []

    async def next_edit(self, body: dict) -> dict:
        self.bodies.append(body)
        return {"suggestion": None, "jump": None}


def _server(tmp_path, docs: dict[str, str]) -> tuple[TabLanguageServer, _Client, dict]:
    server = TabLanguageServer("http://127.0.0.1:9", Telemetry(tmp_path / "tab.jsonl"),
                               debounce_ms=0, min_confidence=None)
    server.protocol._workspace = Workspace(tmp_path.as_uri())
    uris = {}
    for name, text in docs.items():
        uris[name] = (tmp_path / name).as_uri()
        server.workspace.put_text_document(lsp.TextDocumentItem(uris[name], "python", 1, text))
    server.tab = client = _Client()
    return server, client, uris


def _sent(server: TabLanguageServer, client: _Client, uri: str) -> list[str]:
    asyncio.run(server.next_edit(uri, lsp.Position(0, 0)))
    return [f["path"] for f in client.bodies[-1]["open_files"]]


def test_only_the_first_open_document_still_holding_the_renamed_word_is_sent(tmp_path):
    """`area` renamed to `surface` in main.py; of the other open documents, notes.py lacks
    the word and both uses.py and shapes.py have it: the server's jump goes to the first that
    has it (uses.py, edited last), so that one alone is sent, not all three (every request
    carried up to 8 documents of 100,000 characters before)."""
    docs = {"main.py": "x = area(1, 2)\n", "notes.py": "nothing here\n",
            "shapes.py": "def area(w, h):\n    return w * h\n",
            "uses.py": "import shapes\nshapes.area(3, 4)\n"}
    server, client, uris = _server(tmp_path, docs)
    server.workspace.update_text_document(  # uses.py edited: a line added
        lsp.VersionedTextDocumentIdentifier(version=2, uri=uris["uses.py"]),
        lsp.TextDocumentContentChangeWholeDocument("# uses\n" + docs["uses.py"]))
    server.note_change(uris["uses.py"])
    server.history.record("main.py", docs["main.py"], "x = surface(1, 2)\n", now=1e9)
    assert _sent(server, client, uris["main.py"]) == ["uses.py"]


def test_no_document_is_sent_when_the_newest_edit_is_not_a_one_word_change(tmp_path):
    docs = {"main.py": "x = area(1, 2)\n", "shapes.py": "def area(w, h):\n    return w * h\n"}
    server, client, uris = _server(tmp_path, docs)
    server.history.record("main.py", docs["main.py"], "x = area(1, 2)\ny = 3\n")
    assert _sent(server, client, uris["main.py"]) == []
