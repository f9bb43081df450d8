"""`codeplane lsp` driven by a real LSP client: a spawned process, JSON-RPC over stdio."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from test_tab_server import SOURCE

from codeplane.events import query
from codeplane.storage import ObjectStore

pytestmark = pytest.mark.model


class LspClient:
    """Minimal JSON-RPC 2.0 client with LSP's Content-Length framing."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=env)
        self._next = 0
        self._inbox: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        out = self.proc.stdout
        while True:
            headers = {}
            while True:
                line = out.readline()
                if not line:
                    return
                if line in (b"\r\n", b"\n"):
                    break
                key, _, value = line.decode().partition(":")
                headers[key.strip().lower()] = value.strip()
            self._inbox.put(json.loads(out.read(int(headers["content-length"]))))

    def _send(self, message: dict) -> None:
        data = json.dumps({"jsonrpc": "2.0", **message}).encode()
        self.proc.stdin.write(b"Content-Length: %d\r\n\r\n" % len(data) + data)
        self.proc.stdin.flush()

    def notify(self, method: str, params: dict) -> None:
        self._send({"method": method, "params": params})

    def request(self, method: str, params: dict | None, timeout: float = 120) -> dict:
        self._next += 1
        ident = self._next
        self._send({"id": ident, "method": method, "params": params})
        while True:
            message = self._inbox.get(timeout=timeout)
            if message.get("id") == ident and "method" not in message:
                assert "error" not in message, message
                return message["result"]
            if "id" in message and "method" in message:  # server->client request: ack it
                self._send({"id": message["id"], "result": None})

    def close(self) -> None:
        try:
            self.request("shutdown", None, timeout=20)
            self.notify("exit", {})
            self.proc.wait(timeout=20)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture
def lsp(live_server, tmp_path):
    env = {**os.environ, "CODEPLANE_HOME": str(tmp_path / "home")}
    client = LspClient([sys.executable, "-m", "codeplane", "lsp", "--server", live_server.url,
                        "--debounce-ms", "0", "--min-confidence", "0"], env)
    yield client, tmp_path / "home" / "client" / "tab" / "events.jsonl"
    client.close()


def test_lsp_inline_and_fallback_completion(lsp, live_server, tmp_path):
    client, events = lsp
    init = client.request("initialize", {"processId": os.getpid(), "rootUri": None,
                                         "capabilities": {}})
    caps = init["capabilities"]
    assert "inlineCompletionProvider" in caps and caps.get("completionProvider")
    client.notify("initialized", {})
    uri = Path(tmp_path / "calc.py").as_uri()
    text = SOURCE.rstrip("\n") + ")\n"
    line = text.count("\n", 0, text.rindex("div"))
    col = len("    print(div")
    client.notify("textDocument/didOpen", {"textDocument": {
        "uri": uri, "languageId": "python", "version": 1, "text": text}})
    where = {"textDocument": {"uri": uri}, "position": {"line": line, "character": col}}

    inline = client.request("textDocument/inlineCompletion",
                            {**where, "context": {"triggerKind": 2}})
    item = inline["items"][0]
    assert item["insertText"].startswith("ide("), inline
    assert item["command"]["command"] == "codeplane.tab.accepted"

    # the user types "id": an incremental change, then the rest comes from typed-ahead
    client.notify("textDocument/didChange", {
        "textDocument": {"uri": uri, "version": 2},
        "contentChanges": [{"range": {"start": {"line": line, "character": col},
                                      "end": {"line": line, "character": col}},
                            "text": "id"}]})
    moved = {"textDocument": {"uri": uri}, "position": {"line": line, "character": col + 2}}
    ahead = client.request("textDocument/inlineCompletion",
                           {**moved, "context": {"triggerKind": 2}})
    assert ahead["items"][0]["insertText"] == item["insertText"][2:]

    plain = client.request("textDocument/completion", moved)
    assert plain["items"][0]["textEdit"]["newText"] == item["insertText"][2:]

    sid = item["command"]["arguments"][0]
    assert client.request("workspace/executeCommand",
                          {"command": "codeplane.tab.accepted", "arguments": [sid]}) is True
    logged = [json.loads(x) for x in events.read_text().splitlines()]
    assert [e["event"] for e in logged] == ["shown", "accepted"]
    assert logged[0]["latency_ms"] > 0 and "text" not in logged[0]

    # the LSP reported the acceptance to the server: it is in the event lake
    live_server.app.state.services.events.flush()
    lake = query.connect(ObjectStore.open(str(
        live_server.app.state.settings.server_dir / "objects")))
    assert lake.execute("SELECT count(*) FROM tab_accepted WHERE suggestion_id = ?",
                        [sid]).fetchone() == (1,)
