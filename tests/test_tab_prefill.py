"""Tab's first suggestion in a file: `POST /v1/tab/prefill` (real model, real HTTP on
loopback), the prefill yielding to completions, tenant isolation of the KV cache, and the
Tab model loaded when the server starts."""

from __future__ import annotations

import asyncio
import os
import sys
import uuid

import httpx
import pytest
from conftest import LiveServer, free_port, make_settings
from test_lsp_tab import LspClient
from test_tab_server import SOURCE
from upstreams.scripted import caller, run_server, wait_for

from codeplane.config import TabSettings
from codeplane.core.principal import LOCAL_TENANT
from codeplane.models.engine import Engine
from codeplane.server.app import create_app
from codeplane.tab import preload
from codeplane.tab.context import Budget, build_request
from codeplane.tab.service import PrefillRequest, TabRequest, TabService

pytestmark = pytest.mark.model

TEXT = SOURCE.rstrip("\n") + ")\n"
OFFSET = TEXT.rindex("div") + 3


def other_file() -> str:
    """A document no earlier request has put in the KV cache."""
    return f'"""Module {uuid.uuid4().hex}."""\n\n' + "\n".join(
        f"def f{i}(x):\n    return x * {i}\n" for i in range(40))


def completion(path: str, text: str, offset: int, cursor_id: str) -> dict:
    return build_request(path, text, offset, None, Budget(), cursor_id=cursor_id,
                         min_confidence=0.0, max_tokens=6)


def prefill_body(path: str, text: str, offset: int, cursor_id: str) -> dict:
    """What the LSP sends: the window a completion at `offset` would send, as text+cursor."""
    body = completion(path, text, offset, cursor_id)
    return {"path": path, "text": body["prefix"] + body["suffix"],
            "cursor": len(body["prefix"]), "cursor_id": cursor_id}


def post(url: str, route: str, body: dict, headers: dict | None = None) -> dict:
    response = httpx.post(f"{url}{route}", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_prefill_then_complete_gives_the_same_text_from_the_cache(live_server):
    url = live_server.url
    post(url, "/v1/tab", completion("other.py", other_file(), 30, "elsewhere"))
    alone = post(url, "/v1/tab", completion("calc.py", TEXT, OFFSET, "alone"))
    post(url, "/v1/tab", completion("other.py", other_file(), 30, "elsewhere"))

    pre = post(url, "/v1/tab/prefill", prefill_body("calc.py", TEXT, OFFSET, "warmed"))
    assert not pre["yielded"] and pre["evaluated_tokens"] == pre["prompt_tokens"] > 50, pre
    warmed = post(url, "/v1/tab", completion("calc.py", TEXT, OFFSET, "warmed"))
    assert warmed["source"] == "model" and warmed["text"] == alone["text"], (warmed, alone)
    assert warmed["text"].startswith("ide(")
    # everything the prefill evaluated came from the KV cache
    assert warmed["cached_tokens"] >= pre["prompt_tokens"] - 1, (warmed, pre)


def test_a_cold_document_is_answered_from_the_short_window_then_from_the_full_one(
        live_server):
    """No prefill came first: the first completion's prompt is the short window, and the
    full window is prefilled behind it, so the next completion there takes all of it from
    the KV cache."""
    url, doc = live_server.url, other_file()
    offset = doc.index("return x * 30\n") + len("return x * 30\n")
    limit = TabSettings().cold_prompt_tokens

    def prefills() -> tuple[int, int]:
        stats = httpx.get(f"{url}/v1/tab/stats", timeout=10).json()
        return stats["prefills"], stats["prefills_yielded"]

    before = prefills()
    first = post(url, "/v1/tab", completion("cold.py", doc, offset, "cold"))
    assert first["source"] == "model" and first["window"] == "short", first
    assert 0 < first["prompt_tokens"] <= limit, first
    # where its time went (bench/tab_first.py prints it): nested parts of the whole
    assert 0 < first["prompt_ms"] and first["prompt_ms"] + first["decode_ms"] \
        <= first["model_ms"] <= first["latency_ms"], first
    wait_for(lambda: prefills()[0] > before[0], timeout=120, what="the background prefill")
    assert prefills()[1] == before[1], "the background prefill yielded"
    # another cursor in the same document: no LRU hit, the same full prompt
    full = post(url, "/v1/tab", completion("cold.py", doc, offset, "again"))
    assert full["source"] == "model" and full["window"] == "full", full
    assert full["prompt_tokens"] > limit, full
    assert full["prompt_tokens"] - full["cached_tokens"] <= 1, full


def test_the_full_window_when_the_short_one_is_off(engine):
    """`cold_prompt_tokens = 0`: a cold document gets its full window at once, as before."""
    svc = TabService(engine, TabSettings(cold_prompt_tokens=0))
    doc = other_file()
    offset = doc.index("return x * 30\n") + len("return x * 30\n")
    got = svc.complete_sync(TabRequest(**completion("off.py", doc, offset, "off")))
    assert got.window == "full" and got.prompt_tokens > TabSettings().cold_prompt_tokens, got
    assert svc.stats["prefills"] == 0


def test_prefill_yields_to_a_completion(engine):
    """A prefill queued behind a running completion is dropped when another completion
    arrives; a newer prefill of the same document supersedes an older one."""
    svc = TabService(engine, TabSettings())
    doc = other_file()

    async def scenario() -> tuple:
        busy = asyncio.create_task(svc.complete(TabRequest(
            path="busy.py", prefix=other_file(), max_tokens=4, cursor_id="busy"), LOCAL_TENANT))
        await asyncio.sleep(0)  # each task runs up to its engine call: queued in this order
        older = asyncio.create_task(svc.prefill(
            PrefillRequest(path="big.py", text=doc, cursor_id="big"), LOCAL_TENANT))
        await asyncio.sleep(0)
        newer = asyncio.create_task(svc.prefill(
            PrefillRequest(path="big.py", text=doc + "\n", cursor_id="big"), LOCAL_TENANT))
        await asyncio.sleep(0)
        live = asyncio.create_task(svc.complete(TabRequest(
            path="calc.py", prefix=TEXT[:OFFSET], suffix=TEXT[OFFSET:], max_tokens=6,
            cursor_id="live", min_confidence=0.0), LOCAL_TENANT))
        return await asyncio.gather(busy, older, newer, live)

    _, older, newer, live = asyncio.run(scenario())
    assert older.yielded and newer.yielded, (older, newer)
    assert older.evaluated_tokens < older.prompt_tokens or older.prompt_tokens == 0
    assert live.source == "model" and live.text.startswith("ide("), live
    assert svc.stats["prefills_yielded"] == 2


def test_a_request_during_the_warm_up_is_answered_before_the_rest_of_it(engine):
    """The warm-up waits for the weights only: its own job (vocabulary index, one decode)
    is queued after a completion that arrived meanwhile and leaves the decode to it; with
    no request in between it decodes. Order, not timing: a completion holds the model
    while the warm-up and the request queue."""
    svc = TabService(engine, TabSettings())

    async def scenario() -> tuple:
        busy = asyncio.create_task(svc.complete(TabRequest(
            path="busy.py", prefix=other_file(), max_tokens=4, cursor_id="busy"), LOCAL_TENANT))
        await asyncio.sleep(0)
        warm = asyncio.create_task(svc.warm())
        await asyncio.sleep(0)
        live = asyncio.create_task(svc.complete(TabRequest(
            path="calc.py", prefix=TEXT[:OFFSET], suffix=TEXT[OFFSET:], max_tokens=6,
            cursor_id="live", min_confidence=0.0), LOCAL_TENANT))
        return await asyncio.gather(busy, warm, live)

    _, decoded, live = asyncio.run(scenario())
    assert decoded is False  # the request came first: the warm-up left its decode to it
    assert live.source == "model" and live.text.startswith("ide("), live
    assert svc.pending_prefills() == 0
    assert asyncio.run(svc.warm()) is True  # nothing waiting: the warm-up decodes


def test_a_tenant_never_reuses_another_tenants_prefill(tmp_path, engine):
    server = run_server(tmp_path / "home", None, engine=engine, gateway={"auth": "on"})
    try:
        alice, bob = caller(server, "alice"), caller(server, "bob")
        doc = other_file()
        offset = doc.index("return x * 7\n") + len("return x * 7\n")  # a blank line
        pre = post(server.url, "/v1/tab/prefill", prefill_body("m.py", doc, offset, "c"),
                   alice)
        assert pre["evaluated_tokens"] == pre["prompt_tokens"] > 100, pre
        # bob sends the same document: cold for him (the short window), nothing of
        # alice's cache reused
        theirs = post(server.url, "/v1/tab", completion("m.py", doc, offset, "c"), bob)
        assert theirs["source"] == "model" and theirs["cached_tokens"] == 0, theirs
        assert theirs["window"] == "short", theirs
        # alice's prefill was kept for her (saved before bob's request replaced it)
        mine = post(server.url, "/v1/tab", completion("m.py", doc, offset, "c"), alice)
        assert mine["window"] == "full", mine
        assert mine["cached_tokens"] >= pre["prompt_tokens"] - 1, (mine, pre)
    finally:
        server.stop()


def test_prefill_refuses_bad_input_with_4xx(tmp_path, engine):
    server = run_server(tmp_path / "home", None, engine=engine, gateway={"auth": "on"},
                        max_body_bytes=1 << 20)
    try:
        key = caller(server, "alice")
        route = f"{server.url}/v1/tab/prefill"
        ok = {"path": "a.py", "text": "def f():\n    return 1\n"}
        assert httpx.post(route, json=ok, timeout=30).status_code == 401  # no key
        assert httpx.post(route, json=ok, timeout=30, headers={
            "authorization": "Bearer cp-not-a-key"}).status_code == 401
        bad = [{**ok, "cursor": len(ok["text"]) + 1}, {**ok, "cursor": -1},
               {"path": "a.py"}, {**ok, "unknown": 1}, {**ok, "text": 5},
               {**ok, "context": "x"}, {**ok, "cursor_id": "x" * 201},
               {**ok, "language": "py thon"}, {**ok, "text": "x" * 400_001}]
        for body in bad:
            got = httpx.post(route, json=body, headers=key, timeout=30)
            assert got.status_code == 400, (body.keys(), got.status_code, got.text)
        assert httpx.post(route, json={**ok, "model": "no-such-model"}, headers=key,
                          timeout=30).status_code == 404
        assert httpx.post(route, content=b"{not json", headers={
            **key, "content-type": "application/json"}, timeout=30).status_code == 400
        huge = b'{"path": "a.py", "text": "' + b"x" * (2 << 20) + b'"}'
        assert httpx.post(route, content=huge, headers={
            **key, "content-type": "application/json"}, timeout=30).status_code == 413
    finally:
        server.stop()


def test_the_tab_model_loads_when_the_server_starts(tmp_path):
    """With a [tab] section the server loads the Tab model in the background (its own
    engine here: the session's may have loaded it already)."""
    settings = make_settings(tmp_path / "home", tab={"model": "code-small"})
    server = LiveServer(create_app(settings), free_port()).start()
    try:
        assert httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200
        wait_for(lambda: "code-small" in httpx.get(f"{server.url}/healthz", timeout=10)
                 .json()["models_loaded"], timeout=120, what="for the Tab model to load")
    finally:
        server.stop()


def test_serve_starts_the_tab_model_and_its_state_before_the_server_is_built(tmp_path):
    """`codeplane serve` starts loading the Tab model before it imports the server
    (`tab/preload.py`): the weights and the worker's Tab state come from that job, so the
    server's warm-up finds them; nothing to preload without a [tab] section."""
    settings = make_settings(tmp_path / "home", tab={"model": "code-small"})
    engine = Engine(settings)
    try:
        started = preload.start(settings, engine)
        assert started is not None and started.result(timeout=120) is None
        assert engine.loaded() == ["code-small"]
        svc = TabService(engine, settings.tab)
        assert asyncio.run(svc.warm()) is True
    finally:
        engine.close()
    assert preload.start(make_settings(tmp_path / "bare"), engine) is None


def test_the_lsp_prefills_on_open_and_after_an_edit_pause(live_server, tmp_path):
    def prefills() -> int:
        return httpx.get(f"{live_server.url}/v1/tab/stats", timeout=10).json().get(
            "prefills", 0)

    env = {**os.environ, "CODEPLANE_HOME": str(tmp_path / "home")}
    client = LspClient([sys.executable, "-m", "codeplane", "lsp", "--server", live_server.url,
                        "--prefill-idle-ms", "50"], env)
    try:
        client.request("initialize", {"processId": os.getpid(), "rootUri": None,
                                      "capabilities": {}})
        client.notify("initialized", {})
        uri = (tmp_path / "calc.py").as_uri()
        before = prefills()
        client.notify("textDocument/didOpen", {"textDocument": {
            "uri": uri, "languageId": "python", "version": 1, "text": TEXT}})
        wait_for(lambda: prefills() > before, timeout=120, what="for the didOpen prefill")
        opened = prefills()
        line = TEXT.count("\n", 0, OFFSET)
        client.notify("textDocument/didChange", {
            "textDocument": {"uri": uri, "version": 2},
            "contentChanges": [{"range": {"start": {"line": line, "character": 0},
                                          "end": {"line": line, "character": 0}},
                                "text": "    x = 1\n"}]})
        wait_for(lambda: prefills() > opened, timeout=120, what="for the didChange prefill")
    finally:
        client.close()
