"""Audit 2026-11-28 M7: Tab's suggestion cache and cursor sessions were shared by every
tenant. Bob got Alice's cached suggestion (for her private code) by sending the same
path/prefix/suffix/cursor, and cancelled her request in flight by sending any request with her
`cursor_id` (the LSP uses the document URI, easy to guess). Both run here on a live server
with the auth gate on and two tenants' real keys (tab_cross_tenant.py in the audit)."""

from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest
from upstreams.scripted import caller, run_server, wait_for

pytestmark = pytest.mark.model

BODY = {"path": "/workspace/app.py", "cursor_id": "file:///workspace/app.py",
        "prefix": "def alice_private_helper(x):\n    # compute the checksum of x\n    return ",
        "suffix": "\n", "model": "code-small", "min_confidence": 0.0, "max_tokens": 8}


@pytest.fixture
def server(tmp_path, engine):
    server = run_server(tmp_path / "home", None, engine=engine, gateway={"auth": "on"})
    yield server
    server.stop()


def tab(server, headers: dict, **changes) -> dict:
    reply = httpx.post(f"{server.url}/v1/tab", headers=headers, json={**BODY, **changes},
                       timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_another_tenant_never_gets_a_cached_suggestion(server):
    alice, bob = caller(server, "alice"), caller(server, "bob")
    first = tab(server, alice)
    assert first["source"] == "model" and first["shown"], first
    assert tab(server, alice)["source"] == "cache"  # the cache works for its tenant
    theirs = tab(server, bob)
    assert theirs["source"] == "model" and not theirs["cached"], theirs
    assert theirs["id"] != first["id"]
    typed = tab(server, bob, prefix=BODY["prefix"] + first["text"][:1])
    assert typed["id"] != first["id"], typed  # nor the rest of hers (typed-ahead)


def test_another_tenants_cursor_id_cancels_nothing(server, engine):
    alice, bob = caller(server, "alice"), caller(server, "bob")
    tab(server, alice, cursor_id="warm-up")  # the model is loaded
    pid = engine.status()["code-small"].pid
    replies: dict[str, dict] = {}
    # Alice's request reaches the model's worker, which is held still until Bob has sent his
    # request with her cursor id (the audit raced them with a sleep).
    os.kill(pid, signal.SIGSTOP)
    try:
        theirs = threading.Thread(target=lambda: replies.update(alice=tab(server, alice)))
        theirs.start()
        wait_for(lambda: engine.status()["code-small"].job == "tab.suggest",
                 what="for Alice's request to reach the model")
        mine = threading.Thread(target=lambda: replies.update(
            bob=tab(server, bob, prefix="x = ", path="/b.py")))
        mine.start()
        wait_for(lambda: engine.status()["code-small"].waiting == 1,
                 what="for Bob's request to queue")
    finally:
        os.kill(pid, signal.SIGCONT)
    theirs.join(120)
    mine.join(120)
    assert replies["alice"]["source"] == "model", replies["alice"]  # not "cancelled"
    assert replies["bob"]["source"] == "model", replies["bob"]
