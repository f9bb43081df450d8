"""Limits an attacker with a valid key (or none) runs into, over real loopback HTTP: the body
size limit (declared and chunked), token budgets and tokens-per-minute reserved before a call
so concurrent requests cannot overrun them, the field allowlist in front of paid upstreams,
and 4xx (never 5xx) for malformed input on the model, apply and tab routes."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest
from conftest import LiveServer, free_port, make_settings
from upstreams.server import Upstream

from codeplane.gateway.keys import KeyStore
from codeplane.server.app import create_app

CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30}


@dataclass
class HeldUpstream(Upstream):
    """An upstream that holds every model request until the test releases it, so requests
    are concurrent by construction, not by timing."""

    arrived: int = 0
    release: threading.Event = field(default_factory=threading.Event)

    async def _respond(self, method, path, raw, writer) -> bool:
        if method == "POST":
            self.arrived += 1
            await asyncio.get_running_loop().run_in_executor(None, self.release.wait)
        return await super()._respond(method, path, raw, writer)


def start(tmp_path, upstream_url: str, engine=None, **serve) -> LiveServer:
    models = [{"name": "chat", "provider": "openai", "base_url": upstream_url,
               "model": "up-model"}]
    settings = make_settings(tmp_path / "home", models=models, gateway={"auth": "on"},
                             serve=serve)
    return LiveServer(create_app(settings, engine=engine), free_port()).start()


def bearer(secret: str) -> dict:
    return {"authorization": f"Bearer {secret}"}


@pytest.fixture
def upstream():
    up = HeldUpstream(name="held").start()
    yield up
    up.release.set()
    up.stop()


def _burst(url: str, headers: dict, up: HeldUpstream, n: int) -> list[int]:
    """Send n requests at once; once every one has either been refused or reached the
    upstream, release the upstream and return the status codes."""
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(httpx.post, url, json=CHAT, headers=headers, timeout=60)
                   for _ in range(n)]
        deadline = time.monotonic() + 60
        while sum(f.done() for f in futures) + up.arrived < n:
            assert time.monotonic() < deadline, "requests neither refused nor forwarded"
            time.sleep(0.02)
        admitted = up.arrived
        up.release.set()
        codes = [f.result().status_code for f in futures]
    assert codes.count(200) == admitted
    return codes


@pytest.mark.parametrize("limit", ["budget_tokens", "tpm"])
def test_concurrent_requests_cannot_overrun_a_token_limit(tmp_path, upstream, limit):
    """Each call holds ~45 tokens (prompt estimate + max_tokens 30) before it starts: with
    100 tokens, 2 of 10 simultaneous calls go through. Charged after the call, as before,
    all 10 would have seen an unspent budget."""
    server = start(tmp_path, upstream.url)
    store = KeyStore.from_settings(server.app.state.settings)
    key, secret = store.create("intern", **{limit: 100})
    url = f"{server.url}/v1/chat/completions"
    try:
        codes = _burst(url, bearer(secret), upstream, 10)
        refused = 403 if limit == "budget_tokens" else 429
        assert sorted(codes) == [200] * 2 + [refused] * 8
        keys = server.app.state.services.keys
        if limit == "budget_tokens":
            assert keys.used(key) == 24  # settled at the real 12 tokens per call
            assert keys.held(key) == 0  # nothing stays reserved
            # 76 left >= 45 held: the released reservations make room again
            assert httpx.post(url, json=CHAT, headers=bearer(secret)).status_code == 200
    finally:
        server.stop()


def test_only_known_fields_reach_a_paid_upstream(tmp_path, upstream):
    upstream.release.set()
    server = start(tmp_path, upstream.url)
    _, secret = KeyStore.from_settings(server.app.state.settings).create("ci")
    body = {**CHAT, "n": 8, "best_of": 4, "service_tier": "priority", "store": True,
            "metadata": {"x": "y"}, "web_search_options": {}, "temperature": 0.2,
            "stop": ["\n"]}
    try:
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=body,
                           headers=bearer(secret))
        assert reply.status_code == 200
        sent = upstream.bodies[-1]
        assert not {"n", "best_of", "service_tier", "store", "metadata",
                    "web_search_options"} & set(sent)
        assert sent["temperature"] == 0.2 and sent["max_tokens"] == 30
        assert sent["model"] == "up-model" and sent["stop"] == ["\n"]
    finally:
        server.stop()


@pytest.fixture
def small_limit(tmp_path, upstream):
    upstream.release.set()
    server = start(tmp_path, upstream.url, max_body_bytes=4096)
    _, secret = KeyStore.from_settings(server.app.state.settings).create("ci")
    yield server, secret
    server.stop()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/apply", "/v1/tab",
                                  "/v1/index/workspaces/ws1/files", "/v1/agent/runs"])
def test_bodies_over_the_limit_get_413_declared_or_chunked(small_limit, path):
    server, secret = small_limit
    big = b'{"model": "' + b"x" * 8192 + b'"}'
    headers = {**bearer(secret), "content-type": "application/json",
               "x-codeplane-key": "k" * 32}
    declared = httpx.post(server.url + path, content=big, headers=headers)
    assert declared.status_code == 413, declared.text
    assert "max_body_bytes" in declared.json()["error"]["message"]

    def chunks():  # no Content-Length: Transfer-Encoding: chunked
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]

    chunked = httpx.post(server.url + path, content=chunks(), headers=headers)
    assert chunked.status_code == 413, chunked.text
    no_key = httpx.post(server.url + path, content=big,
                        headers={"content-type": "application/json"})
    assert no_key.status_code == 401  # the gate answers before the limit reads anything


BAD_BODIES = {
    "/v1/chat/completions": [
        '{"model": "code-small", "messages": [{"role": "user", "content": "\\ud800"}]}',
        ('{"model": "code-small", "messages": [{"role": "user", "content": [{"type": "text", '
         '"text": 5}]}], "max_tokens": 1}'),
        ('{"model": "code-small", "messages": [{"role": "user", "content": "hi"}], '
         '"max_tokens": 100000000000000000000000000}'),
        ('{"model": "code-small", "messages": [{"role": "user", "content": "hi"}], '
         '"max_tokens": 1, "seed": 1e400}'),
        '{"model": "code-small", "messages": []}', '{"model": ["x"]}', "[]", '"x"', "null",
        '{"model": "code-small\\u0000", "messages": [{"role": "user", "content": "hi"}]}',
    ],
    "/v1/completions": [
        '{"model": "code-small", "prompt": "\\ud800", "max_tokens": 1}',
        '{"model": "code-small", "prompt": [], "max_tokens": 1}',
        '{"model": "code-small", "prompt": [1, 2], "max_tokens": -1}',
    ],
    "/v1/embeddings": ['{"model": "bge-small", "input": "\\udfff"}',
                       '{"model": "bge-small", "input": {"a": 1}}'],
    "/v1/apply": [
        '{"path": "a.py", "original": "x = 1\\n", "edit": "x = \\ud800\\n"}',
        '{"path": "a.py", "original": 5, "edit": "x"}',
        '{"path": "a.py", "original": "x", "edit": "x", "method": "psychic"}',
    ],
    "/v1/tab": ['{"path": "a.py", "prefix": "def \\ud800"}',
                '{"path": "a.py", "prefix": "x", "max_tokens": 99999999999999999999}'],
}


@pytest.mark.parametrize("path", sorted(BAD_BODIES))
def test_malformed_input_gets_4xx_never_5xx(tmp_path, engine, upstream, path):
    upstream.release.set()
    server = start(tmp_path, upstream.url, engine=engine)
    _, secret = KeyStore.from_settings(server.app.state.settings).create("ci")
    headers = {**bearer(secret), "content-type": "application/json"}
    try:
        for body in BAD_BODIES[path]:
            reply = httpx.post(server.url + path, content=body.encode("utf-8", "surrogatepass"),
                               headers=headers, timeout=120)
            assert 400 <= reply.status_code < 500, (body, reply.status_code, reply.text[:300])
            assert reply.json()["error"]["message"]
    finally:
        server.stop()
