"""Next-edit Tab through a real LSP session: a scripted JSON-RPC client drives
`codeplane lsp` (a spawned process) against a live server with the real code-small model."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import httpx
import pytest
from test_lsp_tab import LspClient
from upstreams.scripted import wait_for

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


class Recorded(LspClient):
    """The scripted client, keeping the JSON-RPC messages both ways (docs/tab.md shows the
    transcript of a run)."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.log: list[tuple[str, dict]] = []
        self.shows: set = set()  # ids of the server's window/showDocument requests
        super().__init__(args, env)
        put = self._inbox.put
        self._inbox.put = lambda message: (self._received(message), put(message))

    def _received(self, message: dict) -> None:
        self.log.append(("<-", message))
        if message.get("method") == "window/showDocument":
            self.shows.add(message["id"])

    def _send(self, message: dict) -> None:
        if message.get("id") in self.shows and "method" not in message:
            message = {**message, "result": {"success": True}}  # the editor moved there
        self.log.append(("->", message))
        super()._send(message)

    def transcript(self) -> str:
        return "\n".join(f"{way} {json.dumps(m)}" for way, m in self.log)


def apply_item(text: str, item: dict) -> str:
    """Replace the item's range with its text, as an editor accepting it does."""
    lines = text.splitlines(keepends=True)

    def offset(pos: dict) -> int:
        return sum(len(x) for x in lines[:pos["line"]]) + pos["character"]

    rng = item["range"]
    return text[:offset(rng["start"])] + item["insertText"] + text[offset(rng["end"]):]


def _lsp(kind: type[LspClient], live_server, tmp_path: Path) -> LspClient:
    """`codeplane lsp` against the live server, answering without debounce or hiding."""
    env = {**os.environ, "CODEPLANE_HOME": str(tmp_path / "home")}
    return kind([sys.executable, "-m", "codeplane", "lsp", "--server", live_server.url,
                 "--debounce-ms", "0", "--min-confidence", "0"], env)


def _open_shapes(client: LspClient, source: Path) -> tuple[str, int, int]:
    """Initialize, open SHAPES (written to `source`: the editor opened it from disk) and
    return its URI and the first call site of `area` (line, column)."""
    source.write_text(SHAPES)
    client.request("initialize", {"processId": os.getpid(), "rootUri": None,
                                  "capabilities": {}})
    client.notify("initialized", {})
    uri = source.as_uri()
    client.notify("textDocument/didOpen", {"textDocument": {
        "uri": uri, "languageId": "python", "version": 1, "text": SHAPES}})
    return uri, SHAPES.splitlines().index("        total += area(w, h)"), len("        total += ")


def test_a_rename_gets_a_range_replacing_suggestion(live_server, tmp_path):
    client = _lsp(Recorded, live_server, tmp_path)
    try:
        uri, line, col = _open_shapes(client, tmp_path / "shapes.py")
        # the user renames the first call site: `area` -> `surface`, one keystroke at a time
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
        command = item["command"]  # shown: its accept is reported, with the jump if any
        assert command["command"] in ("codeplane.nextEdit.jump", "codeplane.tab.accepted")
        client.request("workspace/executeCommand", {"command": command["command"],
                                                    "arguments": command["arguments"]})
        assert '"event": "accepted"' in (tmp_path / "home/client/tab/events.jsonl").read_text()
        print("LSP next edit:", item, "\n--- applied ---\n" + applied)
        print("--- JSON-RPC transcript ---\n" + client.transcript())
    finally:
        client.close()


def test_a_pause_after_an_edit_prefills_the_next_edit_prompt(live_server, tmp_path):
    """When the user pauses after an edit the next request will answer with a next edit,
    the LSP prefills that request's prompt: the request then evaluates one prompt token."""
    client = _lsp(LspClient, live_server, tmp_path)

    def stats() -> dict:
        return httpx.get(f"{live_server.url}/v1/tab/stats", timeout=30).json()

    try:
        uri, line, col = _open_shapes(client, tmp_path / "pause.py")
        before = stats()
        client.notify("textDocument/didChange", {  # a rename pasted in one change
            "textDocument": {"uri": uri, "version": 2},
            "contentChanges": [{"range": {"start": {"line": line, "character": col},
                                          "end": {"line": line, "character": col + 4}},
                                "text": "surface"}]})
        wait_for(lambda: stats()["next_prefills"] > before["next_prefills"], timeout=300,
                 what="the idle prefill of the next edit")
        where = {"textDocument": {"uri": uri},
                 "position": {"line": line, "character": col + len("surface")},
                 "context": {"triggerKind": 2}}
        client.request("textDocument/inlineCompletion", where, timeout=300)
        after = stats()
        assert after["next_calls"] == before["next_calls"] + 1, after
        prompt = after["next_prompt_tokens"] - before["next_prompt_tokens"]
        assert after["next_cached_tokens"] - before["next_cached_tokens"] == prompt - 1
    finally:
        client.close()


MAIN = "import shapes\n\n\ndef run():\n    return shapes.area(1, 2)\n"
USES = "import shapes\n\n\ndef both():\n    return shapes.area(3, 4)\n"


def test_a_rename_jumps_to_the_most_recently_edited_open_file_still_calling_it(live_server,
                                                                             tmp_path):
    """main.py's only call of `area` is renamed; shapes.py and uses.py, both open, still
    call it, uses.py edited last: the suggestion's jump command carries uses.py's URI, and
    running it sends `window/showDocument` for uses.py at its first `area`."""
    client = _lsp(Recorded, live_server, tmp_path)
    try:
        _open_shapes(client, tmp_path / "shapes.py")
        docs = {}
        for name, text in (("uses.py", USES), ("main.py", MAIN)):
            (tmp_path / name).write_text(text)
            docs[name] = (tmp_path / name).as_uri()
            client.notify("textDocument/didOpen", {"textDocument": {
                "uri": docs[name], "languageId": "python", "version": 1, "text": text}})
        client.notify("textDocument/didChange", {  # uses.py: a line added at the top
            "textDocument": {"uri": docs["uses.py"], "version": 2},
            "contentChanges": [{"range": {"start": {"line": 0, "character": 0},
                                          "end": {"line": 0, "character": 0}},
                                "text": "# uses\n"}]})
        line, col = 4, len("    return shapes.")
        client.notify("textDocument/didChange", {  # main.py: the rename, pasted in
            "textDocument": {"uri": docs["main.py"], "version": 2},
            "contentChanges": [{"range": {"start": {"line": line, "character": col},
                                          "end": {"line": line, "character": col + 4}},
                                "text": "surface"}]})
        where = {"textDocument": {"uri": docs["main.py"]},
                 "position": {"line": line, "character": col + len("surface")},
                 "context": {"triggerKind": 2}}
        items = client.request("textDocument/inlineCompletion", where, timeout=300)["items"]
        assert items, "no suggestion after the rename"
        command = items[0]["command"]
        assert command["command"] == "codeplane.nextEdit.jump", items[0]
        assert command["arguments"][:2] == [docs["uses.py"], 5], items[0]
        shown = client.request("workspace/executeCommand", {"command": command["command"],
                                                            "arguments": command["arguments"]})
        assert shown is True
        shows = [m for way, m in client.log
                 if way == "<-" and m.get("method") == "window/showDocument"]
        assert [(m["params"]["uri"], m["params"]["selection"]["start"]["line"])
                for m in shows] == [(docs["uses.py"], 5)]
        print("--- JSON-RPC transcript ---\n" + client.transcript())
    finally:
        client.close()
