"""Attacks on `/v1/index/*` over real loopback HTTP against a real server (FastAPI + LanceDB +
SQLite + the bge-small ONNX embedder): malformed bodies, a bad upload followed by good ones,
restarts, other tenants, workspace floods and embedding floods.

Every attack here broke the store or answered 500 before the bodies were typed and the SQLite
transactions scoped (issue 13, items 1-2 of the index side).
"""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest
from conftest import LiveServer, free_port, make_settings
from indexkit import tenant_app, tenant_headers

KEY = "k" * 43
OTHER_KEY = "o" * 43
LEAF = "a" * 32


def chunk(n: int, text: str | None = "def f():\n    return 1\n", **extra) -> dict:
    body = {"id": f"{n:032x}", "key": f"c{n:031x}", "start": 1, "end": 2, **extra}
    if text is not None:
        body["text"] = text
    return body


def good_upload(path: str = "QUJD", n: int = 1) -> dict:
    return {"files": [{"path": path, "leaf": LEAF, "chunks": [chunk(n)]}]}


class Client:
    """Raw HTTP as an attacker would send it: any bytes, any tenant, any workspace key."""

    def __init__(self, live: LiveServer, tenant: str = "local", key: str = KEY) -> None:
        self.http = httpx.Client(base_url=live.url, timeout=120,
                                 headers={**live.tenants[tenant], "X-Codeplane-Key": key})

    def __call__(self, method: str, ws: str, suffix: str = "", body=None,
                 raw: bytes | None = None) -> httpx.Response:
        content = raw if raw is not None else (None if body is None else json.dumps(body))
        return self.http.request(method, f"/v1/index/workspaces/{ws}{suffix}", content=content,
                                 headers={"content-type": "application/json"})


@pytest.fixture
def home(tmp_path):
    return tmp_path / "server-home"


TENANTS = ["acme", "evil", "flood", "calm"]


def start(home, **indexing) -> LiveServer:
    """A real server on loopback; `.tenants` holds each tenant's request headers."""
    settings = make_settings(home, indexing=indexing)
    tenants = tenant_headers(settings, [] if (home / "server").exists() else TENANTS)
    server = LiveServer(tenant_app(settings), free_port())
    server.tenants = tenants
    return server.start()


@pytest.fixture
def live(home):
    server = start(home)
    yield server
    server.stop()


def test_bad_upload_then_valid_write_from_another_workspace_and_restart(home, live) -> None:
    """The reported break: one body missing `leaf` left the shared SQLite connection inside a
    transaction, so every later write of every workspace failed until restart and was lost."""
    call = Client(live)
    assert call("PUT", "wsA").status_code == 200
    assert call("PUT", "wsB").status_code == 200
    bad = call("POST", "wsA", "/files", {"files": [{"path": "AA"}]})
    assert bad.status_code == 400
    assert "leaf" in bad.json()["error"]["message"]
    ok = call("POST", "wsB", "/files", good_upload())
    assert ok.status_code == 200, ok.text
    assert ok.json() == {"embedded": 1, "reused": 0, "stored": 1}
    assert call("POST", "wsB", "/commit", {"nodes": [{"path": "", "hash": "r" * 32}]}
                ).status_code == 200
    assert call("POST", "wsA", "/files", good_upload("QUJD/RA", 2)).status_code == 200
    live.stop()

    again = start(home)
    try:
        call = Client(again)
        tree = call("POST", "wsB", "/tree", {"paths": [""]}).json()["nodes"][""]
        assert tree == {"hash": "r" * 32, "children": {"QUJD": [LEAF, False]}}
        assert call("GET", "wsB").json()["chunks"] == 1
        assert call("GET", "wsA").json()["chunks"] == 1
    finally:
        again.stop()


LONE_SURROGATE = b'"\\ud800x"'
HUGE_INT = b"1" + b"0" * 5000
ROUTES = ["/tree", "/commit", "/delete", "/missing", "/files", "/search"]
# Bodies that answered 500 or broke the store, per route; each must be a 4xx now.
MALFORMED: dict[str, list[bytes]] = {
    "*": [b"", b"{", b"[]", b"null", b"\xff\xfe not utf-8", b'{"paths": "x", "extra": 1}',
          b'{"files": ' + HUGE_INT + b"}"],
    "/tree": [b'{"paths": [1]}', b'{"paths": ["a\\u0000b"]}', b'{"paths": [' + LONE_SURROGATE
              + b"]}", b'{"paths": ["x' + b"/" * 5000 + b'"]}'],
    "/commit": [b'{"nodes": [{"path": "AA"}]}', b'{"nodes": [{"hash": "x"}]}',
                b'{"nodes": [1]}', b'{"nodes": [{"path": "A\'B", "hash": "x"}]}',
                b'{"nodes": [{"path": "AA", "hash": ' + HUGE_INT + b"}]}"],
    "/delete": [b'{"paths": [""]}', b'{"paths": [null]}', b'{"paths": ["a\'; DROP"]}'],
    "/missing": [b'{"keys": [{"k": 1}]}', b'{"keys": ["a\\u0000"]}',
                 b'{"keys": ["' + b"k" * 200 + b'"]}'],
    "/files": [b'{"files": [{"path": "AA"}]}', b'{"files": "AA"}', b'{"files": [[]]}',
               b'{"files": [{"path": "AA", "leaf": "' + b"a" * 32 + b'", "chunks": [{}]}]}',
               json.dumps({"files": [{"path": "AA", "leaf": LEAF, "chunks": [
                   chunk(1, start=10**30)]}]}).encode(),
               json.dumps({"files": [{"path": "AA", "leaf": LEAF, "chunks": [
                   chunk(1, start=5, end=2)]}]}).encode(),
               json.dumps({"files": [{"path": "AA", "leaf": LEAF, "chunks": [
                   chunk(1, text="x\0y")]}]}).encode(),
               b'{"files": [{"path": "AA", "leaf": "' + LEAF.encode() + b'", "chunks": [{"id": "'
               + b"1" * 32 + b'", "key": "k1", "start": 1, "end": 1, "text": '
               + LONE_SURROGATE + b"}]}]}",
               json.dumps({"files": [{"path": "AA", "leaf": LEAF, "chunks": [
                   chunk(1, text="x" * 20_000)]}]}).encode(),
               json.dumps({"files": [{"path": "AA", "leaf": LEAF, "chunks": [
                   chunk(1, text=None, vector="AAAA")]}]}).encode(),
               json.dumps({"files": [{"path": "AA", "leaf": LEAF, "chunks": [
                   chunk(1, text=None, vector=base64.b64encode(
                       np.full(384, np.nan, "<f4").tobytes()).decode())]}]}).encode(),
               json.dumps({"files": [{"path": "AA", "leaf": LEAF, "chunks": [
                   chunk(i) for i in range(5001)]}]}).encode()],
    "/search": [b'{"query": ""}', b'{"query": 5}', b'{"query": "x", "limit": 1e308}',
                b'{"query": "x", "limit": ' + HUGE_INT + b"}", b'{"query": "x", "limit": -1}',
                b'{"query": ' + LONE_SURROGATE + b"}", b'{"query": "a\\u0000"}',
                b'{"query": "x", "prefix": "a\' OR 1=1"}', b'{"query": "x", "vector": "AAAA"}',
                b"{}"],
}


def test_malformed_bodies_get_4xx_on_every_index_route_and_break_nothing(live) -> None:
    call = Client(live)
    assert call("PUT", "ws1").status_code == 200
    answers = []
    for route in ROUTES:
        for raw in MALFORMED["*"] + MALFORMED[route]:
            resp = call("POST", "ws1", route, raw=raw)
            answers.append((route, raw[:60], resp.status_code))
            assert 400 <= resp.status_code < 500, (route, raw[:80], resp.text[:300])
            assert resp.json()["error"]["message"]
    bad_ids = ["a" * 200, "a%00b", "a.b", "%ED%A0%80"]
    for ws in bad_ids:
        assert call("PUT", ws).status_code in (400, 404)
    for header in ("short", "k" * 43 + "\u00e9", "bad key with spaces!!"):
        resp = httpx.put(f"{live.url}/v1/index/workspaces/ws1",
                         headers={"X-Codeplane-Key": header.encode("utf-8")})
        assert resp.status_code == 400
    assert len(answers) > 50
    # The store still works for everyone afterwards.
    assert call("POST", "ws1", "/files", good_upload()).status_code == 200
    hits = call("POST", "ws1", "/search", {"query": "return one", "limit": 3}).json()
    assert [r["path"] for r in hits["results"]] == ["QUJD"]


def test_another_tenant_gets_404_even_with_the_right_key(live) -> None:
    owner, intruder = Client(live, "acme"), Client(live, "evil")
    assert owner("PUT", "shared").status_code == 200
    assert owner("POST", "shared", "/files", good_upload()).status_code == 200
    for method, suffix, body in [("GET", "", None), ("DELETE", "", None),
                                 ("POST", "/tree", {"paths": [""]}),
                                 ("POST", "/files", good_upload()),
                                 ("POST", "/missing", {"keys": ["c1"]}),
                                 ("POST", "/delete", {"paths": ["QUJD"]}),
                                 ("POST", "/commit", {"nodes": [{"path": "", "hash": "x"}]}),
                                 ("POST", "/search", {"query": "return one"})]:
        resp = intruder(method, "shared", suffix, body)
        assert resp.status_code == 404, (method, suffix, resp.text)
    # Creating the same id makes the intruder its own empty workspace, not a view of acme's.
    assert intruder("PUT", "shared").json()["chunks"] == 0
    assert intruder("POST", "shared", "/search", {"query": "return one"}).json()["results"] == []
    assert intruder("POST", "shared", "/missing", {"keys": ["c" + "0" * 30 + "1"]}
                    ).json()["missing"] == ["c" + "0" * 30 + "1"]  # no shared embedding cache
    assert owner("GET", "shared").json()["chunks"] == 1
    assert Client(live, "acme", OTHER_KEY)("GET", "shared").status_code == 403


def test_workspace_creation_flood_is_capped_per_tenant(home) -> None:
    live = start(home, max_workspaces_per_tenant=3)
    try:
        flood = Client(live, "flood")
        assert [flood("PUT", f"w{i}").status_code for i in range(3)] == [200] * 3
        refused = flood("PUT", "w3")
        assert refused.status_code == 403
        assert "max_workspaces_per_tenant" in refused.json()["error"]["message"]
        assert flood("PUT", "w0").status_code == 200  # reopening an existing one is fine
        assert Client(live, "calm")("PUT", "w3").status_code == 200
        assert flood("DELETE", "w0").status_code == 200
        assert flood("GET", "w0").status_code == 404
        assert flood("PUT", "w3").status_code == 200
    finally:
        live.stop()


class HeldEmbeddings(BaseHTTPRequestHandler):
    """A loopback `/v1/embeddings` that holds each request until the test releases it."""

    entered = threading.Event()
    release = threading.Event()

    def do_POST(self) -> None:
        texts = json.loads(self.rfile.read(int(self.headers["content-length"])))["input"]
        type(self).entered.set()
        type(self).release.wait(60)
        body = json.dumps({"data": [{"index": i, "embedding": [1.0] + [0.0] * 383}
                                    for i in range(len(texts))]}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_) -> None:
        return


def test_embedding_calls_respect_the_concurrency_limit(home) -> None:
    fake = ThreadingHTTPServer(("127.0.0.1", 0), HeldEmbeddings)
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    embedder = {"kind": "openai", "base_url": f"http://127.0.0.1:{fake.server_port}/v1",
                "model": "held", "dim": 384}
    live = start(home, embedder=embedder, embed_concurrency=1, embed_wait=0.5)
    try:
        call = Client(live)
        assert call("PUT", "ws").status_code == 200
        first: list[httpx.Response] = []
        holder = threading.Thread(target=lambda: first.append(
            call("POST", "ws", "/files", good_upload("QQ", 1))))
        holder.start()
        assert HeldEmbeddings.entered.wait(60)
        second = Client(live)("POST", "ws", "/files", good_upload("Qg", 2))
        assert second.status_code == 503
        assert second.json()["error"]["code"] == "embedder_busy"
        HeldEmbeddings.release.set()
        holder.join(60)
        assert first[0].status_code == 200
        assert call("POST", "ws", "/files", good_upload("Qg", 2)).status_code == 200
    finally:
        HeldEmbeddings.release.set()
        live.stop()
        fake.shutdown()


def test_a_fifo_planted_as_gitignore_does_not_block_the_scan(tmp_path) -> None:
    """A `.gitignore` that is a FIFO (or a symlink out of the tree) is skipped, not read: the
    indexer used to block forever in open()."""
    import os

    from codeplane.indexing.scan import scan

    repo = tmp_path / "repo"
    (repo / "sub").mkdir(parents=True)
    (repo / "a.py").write_text("A = 1\n")
    (repo / "sub" / "b.py").write_text("B = 2\n")
    os.mkfifo(repo / ".gitignore")
    (tmp_path / "outside").write_text("*.py\n")
    (repo / "sub" / ".gitignore").symlink_to(tmp_path / "outside")
    assert sorted(scan(repo).files) == ["a.py", "sub/b.py"]
