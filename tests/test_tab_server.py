"""Tab against the real model: `POST /v1/tab` on a live loopback server, `codeplane complete`,
and the session slot logic on the shared engine."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from upstreams.scripted import wait_for

from codeplane.config import TabSettings
from codeplane.core.principal import LOCAL_TENANT
from codeplane.core.schemas import ChatCompletionRequest
from codeplane.tab.context import Budget, build_request
from codeplane.tab.service import TabRequest, TabService

pytestmark = pytest.mark.model

SOURCE = '''"""Small arithmetic helpers."""


def add(a, b):
    return a + b


def subtract(a, b):
    return a - b


def multiply(a, b):
    return a * b


def divide(a, b):
    return a / b


def main():
    print(add(1, 2))
    print(subtract(3, 1))
    print(multiply(2, 3))
    print(div
'''


def body(text: str, offset: int, **extra) -> dict:
    return build_request("calc.py", text, offset, None, Budget(), **extra)


def post(server, payload: dict) -> dict:
    response = httpx.post(f"{server.url}/v1/tab", json=payload, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_tab_suggests_cached_and_typed_ahead(live_server):
    text = SOURCE.rstrip("\n") + ")\n"  # the editor auto-closed the bracket
    offset = text.rindex("div") + 3
    first = post(live_server, body(text, offset, cursor_id="t1", min_confidence=0.0))
    assert first["source"] == "model" and not first["cached"]
    assert first["text"].startswith("ide("), first
    # balanced by itself: the ")" of print( is already right of the cursor
    assert first["text"].count("(") == first["text"].count(")"), first
    assert set(first) >= {"text", "latency_ms", "cached", "confidence", "shown"}

    again = post(live_server, body(text, offset, cursor_id="t1", min_confidence=0.0))
    assert again["cached"] and again["source"] == "cache" and again["text"] == first["text"]

    typed = text[:offset] + "id" + text[offset:]
    ahead = post(live_server, body(typed, offset + 2, cursor_id="t1", min_confidence=0.0))
    assert ahead["source"] == "typed_ahead" and ahead["text"] == first["text"][2:]

    other = text[:offset] + "x" + text[offset:]  # typed something else: ask the model again
    fresh = post(live_server, body(other, offset + 1, cursor_id="t1", max_tokens=4))
    assert fresh["source"] == "model"
    # the stable layout appended one typed token: everything before it came from the KV cache
    assert fresh["prompt_tokens"] - fresh["cached_tokens"] <= 3, fresh

    stats = httpx.get(f"{live_server.url}/v1/tab/stats").json()
    assert stats["cache_hits"] >= 1 and stats["typed_ahead"] >= 1


def test_low_confidence_is_hidden_and_mid_line_skipped(live_server):
    text = SOURCE.rstrip("\n") + ")\n"
    offset = text.rindex("div") + 3
    hidden = post(live_server, body(text, offset, cursor_id="t2", min_confidence=1.0,
                                    max_tokens=4))
    assert hidden["text"] == "" and not hidden["shown"]
    assert hidden["reason"] == "low_confidence" and hidden["confidence"] < 1.0
    mid = text.index("return a + b") + len("return ")
    skipped = post(live_server, body(text, mid, cursor_id="t2"))
    assert skipped["source"] == "skipped" and skipped["reason"] == "mid_line"
    assert skipped["latency_ms"] < 50


def test_tab_bad_requests(live_server):
    missing = httpx.post(f"{live_server.url}/v1/tab", json={"prefix": "x"}, timeout=10)
    assert missing.status_code == 400 and "path" in missing.json()["error"]["message"]
    unknown = httpx.post(f"{live_server.url}/v1/tab", timeout=10,
                         json={"path": "a.py", "prefix": "x = ", "model": "nope"})
    assert unknown.status_code == 404


@contextmanager
def occupied(engine) -> Iterator[None]:
    """code-small busy with a streamed chat until the block ends, so what is submitted
    meanwhile has to queue."""
    running, gate = threading.Event(), threading.Event()

    def occupy(_chunk: dict) -> None:  # its first streamed chunk holds the model's queue
        running.set()
        gate.wait(60)

    chat = ChatCompletionRequest(model="code-small", max_tokens=2, messages=[
        {"role": "user", "content": "hi"}])
    blocker = threading.Thread(target=engine.run_sync, args=("code-small", "openai.chat", chat,
                                                             True), kwargs={"on_event": occupy})
    blocker.start()
    assert running.wait(60)  # the blocker holds the model before anything else is queued
    try:
        yield
    finally:
        gate.set()
        blocker.join()


def test_newer_request_drops_queued_and_cancels_running(engine):
    svc = TabService(engine, TabSettings(max_tokens=4))
    text = SOURCE.rstrip("\n") + ")\n"
    req = TabRequest(**body(text, text.rindex("div") + 3, cursor_id="t3"))
    with occupied(engine):
        session, seq, cancel = svc.begin(req, LOCAL_TENANT)
        results = []
        queued = threading.Thread(target=lambda: results.append(
            svc.generate(req, LOCAL_TENANT, session, seq, cancel)))
        queued.start()
        wait_for(lambda: engine.status()["code-small"].waiting == 1, what="for the queue")
        svc.begin(req, LOCAL_TENANT)  # a newer keystroke from the same cursor
        assert cancel.is_set()
    queued.join(timeout=60)
    assert results[0].source == "cancelled" and results[0].reason == "stale"
    assert results[0].prompt_tokens == 0  # dropped before touching the model
    assert svc.stats["model_calls"] == 0


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "codeplane", *args], capture_output=True,
                          text=True, timeout=120, check=False)


def test_complete_command(live_server, tmp_path):
    path = tmp_path / "calc.py"
    path.write_text(SOURCE.rstrip("\n") + ")\n")
    line = SOURCE.rstrip("\n").count("\n") + 1
    col = len("    print(div") + 1
    out = run_cli("complete", str(path), "--line", str(line), "--col", str(col), "--json",
                  "--min-confidence", "0", "--server", live_server.url)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["text"].startswith("ide(") and result["latency_ms"] > 0
    plain = run_cli("complete", str(path), "--line", str(line), "--col", str(col),
                    "--min-confidence", "0", "--server", live_server.url)
    assert plain.stdout.strip() == result["text"].strip()

    bad = run_cli("complete", str(path), "--line", "999", "--col", "1",
                  "--server", live_server.url)
    assert bad.returncode == 2 and "past the end" in bad.stderr and "Traceback" not in bad.stderr
    remote = run_cli("complete", str(path), "--line", "1", "--col", "1",
                     "--server", "http://192.0.2.1:8300")
    assert remote.returncode == 2 and "TLS" in remote.stderr


def test_jumping_back_to_a_file_restores_its_kv_slot(live_server):
    text = SOURCE.rstrip("\n") + ")\n"
    other = "import os\n\n\ndef home():\n    return os.environ.get(\"HOME\", \"/\")\n\n\n" \
            "def user():\n    return os.environ.get(\"USER\", \"nobody\")\n\n\ndef shell():\n" \
            "    return os.environ.get(\"\n"
    where = text.rindex("div") + 3
    post(live_server, {**body(text, where, cursor_id="t5"), "path": "slots_a.py",
                       "max_tokens": 2})
    before = httpx.get(f"{live_server.url}/v1/tab/stats").json()["slot_restores"]
    post(live_server, {**build_request("slots_b.py", other, len(other) - 1, None, Budget()),
                       "cursor_id": "t5", "max_tokens": 2})
    typed = text[:where] + "X" + text[where:]  # not what was suggested: the model runs
    back = post(live_server, {**body(typed, where + 1, cursor_id="t5"), "path": "slots_a.py",
                              "max_tokens": 2})
    assert back["source"] == "model"
    assert back["prompt_tokens"] - back["cached_tokens"] <= 3, back
    assert httpx.get(f"{live_server.url}/v1/tab/stats").json()["slot_restores"] == before + 1


HANDLER = '''class Handler:
    """Holds the streams of one request."""

    def __init__(self, stream, wsgi_errors, max_keepalive_connections=10):
        self.stream = stream
        self.wsgi_errors = wsgi_errors
        self.pool = Pool(stream, max_keepalive_connections=max_keepalive_connections)

    def close(self):
        self.stream.close()
'''


def test_start_of_indented_line_gets_no_stray_space(live_server):
    """Issue 18: at the start of an indented line the typed indentation ended the prompt on a
    whitespace token, and the model added a space: `" self.x"`, mis-indented when inserted."""
    line = "        self.wsgi_errors = wsgi_errors\n"
    text = HANDLER.replace(line, "        \n")
    offset = text.index("        \n") + 8
    got = post(live_server, body(text, offset, cursor_id="heal1", min_confidence=0.0))
    assert got["text"] and not got["text"][0].isspace(), got
    assert got["text"].startswith("self."), got


def test_cursor_inside_an_identifier_continues_the_word(live_server):
    """Issue 18: `max_keepalive_connecti|` got `,` - the prompt ended on a partial token the
    model could not continue. Token healing lets it re-choose that token."""
    text = HANDLER.replace("max_keepalive_connections=max_keepalive_connections)",
                           "max_keepalive_connections=max_keepalive_connecti")
    offset = text.index("=max_keepalive_connecti") + len("=max_keepalive_connecti")
    got = post(live_server, body(text, offset, cursor_id="heal2", min_confidence=0.0))
    assert got["text"].startswith("ons"), got


def test_cursor_after_a_split_word_start_heals_the_whole_word(live_server):
    """`retu` tokenizes as ` ret` + `u`: with only `u` backed off the model answered `r`
    (`retur`), a broken word. The healing backs off every token of the word start that a
    longer token extends, so the model can choose ` return` itself."""
    text = SOURCE.replace("    return a * b", "    retu")
    offset = text.index("    retu\n") + len("    retu")
    got = post(live_server, body(text, offset, cursor_id="heal3", min_confidence=0.0))
    assert got["text"] == "rn a * b", got


UNESCAPE = '''import re


def unescape(text):
    def fix(m):
        res = m.group(0)
        if res.startswith("&#"):
            res = re.sub(r'(&[\\#a-zA-Z0-9]+;)', '', res)
        return res
    return re.sub("&#?\\w+;", fix, text)
'''


FIND = '''def find(environ, exports, get_path_info, start_response):
    path = get_path_info(environ)
    file_loader = None

    for search_path, loader in exports:
        if search_path == path:
            real_filename, file_loader = loader(None)

            if file_loader is not None:
                break

        if not search_path.endswith("/"):
            search_path += "/"

    return file_loader
'''


def test_indented_line_after_a_blank_line_gets_code_not_blanks(live_server):
    """Session 9: on an indented line after a blank one the model re-emitted the healed
    indentation and then only spaces until the line ended - an empty answer (17 of 645
    tuning positions; elsewhere a deeper indentation than typed, `   except`). After the
    indentation the healing now requires code. (What it writes here is a poor guess - the
    prompt layout, not the healing, is why: docs/tab.md, session 9.)"""
    text = FIND.replace("            if file_loader is not None:\n", "            \n")
    offset = text.index("            \n                break") + 12
    got = post(live_server, body(text, offset, cursor_id="indent1", min_confidence=0.0))
    assert got["text"] and not got["text"][0].isspace(), got


def test_default_shows_a_doubtful_suggestion_with_its_confidence(live_server):
    """Session 9: nothing is hidden by default (the margin rule's pick on 20 tuning
    projects); a suggestion the decision doubts is shown and carries its low confidence,
    for clients that filter. Until then this one came back empty or hidden."""
    text = UNESCAPE.replace("        return res\n", "        \n")
    offset = text.index("        \n    return re.sub") + 8
    got = post(live_server, body(text, offset, cursor_id="doubt1"))  # no min_confidence
    assert got["shown"] and got["text"] and got["reason"] is None, got
    assert got["confidence"] is not None and got["confidence"] < 0.1, got  # doubtful
