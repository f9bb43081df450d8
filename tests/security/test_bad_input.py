"""Bad input at the edge (audit 2026-11-28, L2), over real loopback HTTP with a real key:
JSON nested deeper than anything a client needs, and a `Last-Event-ID` that is not ASCII,
get a 4xx, never a 500 (a 500 also closes the client's keep-alive connection)."""

from __future__ import annotations

import httpx
import pytest
from conftest import LiveServer, free_port, make_settings

from codeplane.gateway.keys import KeyStore
from codeplane.server.app import create_app

DEEP = "[" * 900 + "]" * 900
DEEP_BODIES = {
    "an extra field of a message": '{"model": "code-small", "messages": [{"role": "user", '
                                   '"content": "hi", "x": ' + DEEP + "}]}",
    "a tool": '{"model": "code-small", "messages": [{"role": "user", "content": "hi"}], '
              '"tools": [{"a": ' + DEEP + "}]}",
    "an object chain": '{"model": "code-small", "messages": [{"role": "user", "content": '
                       '"hi"}], "tools": [' + '{"a": ' * 900 + "1" + "}" * 900 + "]}",
}


@pytest.fixture
def keyed(tmp_path, engine):
    settings = make_settings(tmp_path / "home", gateway={"auth": "on"})
    _, secret = KeyStore.from_settings(settings).create("ci")
    server = LiveServer(create_app(settings, engine=engine), free_port()).start()
    yield server, {"authorization": f"Bearer {secret}"}
    server.stop()


@pytest.mark.parametrize("where", sorted(DEEP_BODIES))
def test_deeply_nested_json_gets_400(keyed, where):
    server, key = keyed
    reply = httpx.post(f"{server.url}/v1/chat/completions", content=DEEP_BODIES[where],
                       headers={**key, "content-type": "application/json"}, timeout=60)
    assert reply.status_code == 400, reply.text[:300]
    assert "nested" in reply.json()["error"]["message"]


@pytest.mark.parametrize("route", ["/v1/agent/runs/x/events", "/v1/background-agents/x/events"])
@pytest.mark.parametrize("value", [b"\xb2", b"\xd9\xa3", "１".encode(), b"1\xb2"])
def test_a_non_ascii_last_event_id_is_a_4xx(keyed, route, value):
    """`²` (latin-1 0xB2), Arabic-Indic and full-width digits: str.isdigit() calls them
    digits, int() refuses them."""
    server, key = keyed
    reply = httpx.get(server.url + route, headers={**key, "last-event-id": value}, timeout=30)
    assert 400 <= reply.status_code < 500, reply.text[:300]
