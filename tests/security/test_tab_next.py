"""`POST /v1/tab/next` attacked over real loopback HTTP with the auth gate on: no key, a
wrong key, malformed and oversized bodies (4xx, never 5xx), and two tenants on the same
`cursor_id` (each gets its own answer; neither's request is cancelled by the other's)."""

from __future__ import annotations

import threading

import httpx
import pytest
from upstreams.scripted import caller, run_server

pytestmark = pytest.mark.model

TEXT = "def area(w, h):\n    return w * h\n\n\nx = surface(1, 2)\ny = area(3, 4)\n"
BODY = {"path": "app.py", "text": TEXT, "cursor": {"line": 4, "character": 0},
        "cursor_id": "file:///workspace/app.py", "max_tokens": 24,
        "edits": [{"path": "app.py", "line": 4, "before": "x = area(1, 2)\n",
                   "after": "x = surface(1, 2)\n"}]}


@pytest.fixture
def server(tmp_path, engine):
    server = run_server(tmp_path / "home", None, engine=engine, gateway={"auth": "on"})
    yield server
    server.stop()


def post(server, body, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/tab/next", headers=headers or {}, json=body,
                      timeout=300)


def test_no_key_or_a_wrong_key_is_refused(server):
    assert post(server, BODY).status_code == 401
    assert post(server, BODY, {"authorization": "Bearer sk-not-a-key"}).status_code == 401


@pytest.mark.parametrize("change", [
    {"cursor": {"line": 99, "character": 0}},  # beyond the text
    {"cursor": {"line": 0, "character": 500}},  # beyond the line
    {"cursor": {"line": -1, "character": 0}},
    {"text": "x" * 400_001},
    {"edits": [BODY["edits"][0]] * 33},
    {"edits": [{"path": "a.py", "line": 0, "before": "x" * 8001, "after": ""}]},
    {"format": "sed"},
    {"max_tokens": 0},
    {"surprise": True},  # unknown fields are refused, not ignored
    {"cursor": "4:0"},
    {"open_files": [{"path": f"f{n}.py", "text": ""} for n in range(9)]},  # too many
    {"open_files": [{"path": "b.py", "text": "x" * 100_001}]},  # too long
    {"open_files": [{"path": "", "text": "area(1, 2)\n"}]},  # bad paths
    {"open_files": [{"path": "b\x00.py", "text": "area(1, 2)\n"}]},
    {"open_files": [{"path": "b\n.py", "text": "area(1, 2)\n"}]},
    {"open_files": [{"path": "x" * 4097, "text": ""}]},
    {"open_files": [{"path": "app.py", "text": "area(1, 2)\n"}]},  # the current file
    {"open_files": [{"path": "b.py", "text": ""}, {"path": "b.py", "text": ""}]},
    {"open_files": [{"path": "b.py"}]},
    {"open_files": [{"path": "b.py", "text": "", "uri": "file:///b.py"}]},
    {"open_files": [["b.py", "area(1, 2)"]]},
    {"open_files": {"path": "b.py", "text": ""}},
])
def test_bad_input_is_a_4xx(server, change):
    reply = post(server, {**BODY, **change}, caller(server, "alice"))
    assert 400 <= reply.status_code < 500, (change, reply.status_code, reply.text[:200])


def test_a_huge_line_overflows_as_a_400_not_a_500(server):
    reply = post(server, {**BODY, "text": "x = " + "1 + " * 60_000 + "\n",
                          "cursor": {"line": 0, "character": 0}}, caller(server, "alice"))
    assert reply.status_code == 400, reply.text[:200]


def test_two_tenants_on_one_cursor_id_each_get_their_answer(server):
    alice, bob = caller(server, "alice"), caller(server, "bob")
    replies: dict[str, httpx.Response] = {}
    threads = [threading.Thread(target=lambda who=who, h=h: replies.update({who: post(
        server, BODY, h)})) for who, h in (("alice", alice), ("bob", bob))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for who in ("alice", "bob"):
        assert replies[who].status_code == 200, replies[who].text
        got = replies[who].json()
        assert got["source"] != "cancelled", (who, got)
        if got["suggestion"]:
            assert got["suggestion"]["start_line"] <= got["suggestion"]["end_line"]


def test_next_prefill_is_gated_and_refuses_bad_input(server):
    url = f"{server.url}/v1/tab/next/prefill"
    assert httpx.post(url, json=BODY, timeout=60).status_code == 401
    alice = caller(server, "alice")
    for change in ({"cursor": {"line": 99, "character": 0}}, {"surprise": True},
                   {"edits": [BODY["edits"][0]] * 33}, {"format": "sed"}):
        reply = httpx.post(url, json={**BODY, **change}, headers=alice, timeout=60)
        assert 400 <= reply.status_code < 500, (change, reply.status_code, reply.text[:200])


def test_a_next_prefill_serves_its_tenant_only(server):
    """Carol's prefill puts her request's whole prompt in her slot for the document: her
    request then evaluates only its last prompt token. Dave's same request reuses none of it.
    (Tenants no other test uses: the engine and its slots live for the session.)"""
    carol, dave = caller(server, "carol"), caller(server, "dave")
    pre = httpx.post(f"{server.url}/v1/tab/next/prefill", json=BODY, headers=carol,
                     timeout=300)
    assert pre.status_code == 200, pre.text
    assert pre.json()["evaluated_tokens"] == pre.json()["prompt_tokens"] > 0
    theirs = post(server, BODY, dave).json()
    assert theirs["cached_tokens"] == 0, theirs
    ours = post(server, BODY, carol).json()
    assert ours["prompt_tokens"] == pre.json()["prompt_tokens"]
    assert ours["cached_tokens"] == ours["prompt_tokens"] - 1, ours
