"""A key's limits hold on every route that runs a model (audit 2026-11-28, L1:
budget_bypass.sh): `/v1/tab` (model path) and `/v1/apply` (when a model is used) are admitted
against the key's requests per minute and hold its tokens per minute and budget, then charge
the tokens the model really used, as `/v1/chat/completions` does. Answers that need no model
(Tab's cache, typed-ahead and mid-line skip; a deterministic apply) stay free. Real model
(code-small), small max_tokens, real HTTP on loopback. Requests per minute are tested with
two requests sent at once against a limit of one: one is admitted, one refused, however long
the model takes (no timing)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import LiveServer, free_port, make_settings

from codeplane.gateway.keys import KeyStore
from codeplane.server.app import create_app

ORIGINAL = "def total(items):\n    return sum(items)\n\n\ndef mean(items):\n    return 0\n"
EXACT = ("<<<<<<< SEARCH\n    return 0\n=======\n    return total(items) / len(items)\n"
         ">>>>>>> REPLACE\n")


@pytest.fixture(scope="module")
def server(tmp_path_factory, engine):
    settings = make_settings(tmp_path_factory.mktemp("budgets") / "home",
                             gateway={"auth": "on"})
    live = LiveServer(create_app(settings, engine=engine), free_port()).start()
    yield live
    live.stop()


def key(server: LiveServer, name: str, **limits) -> tuple[KeyStore, dict]:
    store = KeyStore.from_settings(server.app.state.settings)
    _, secret = store.create(name, **limits)
    return store, {"authorization": f"Bearer {secret}"}


def used(store: KeyStore, name: str) -> int:
    return store.used(next(k for k in store.active() if k.name == name))


def tab(server: LiveServer, headers: dict, n: int, **extra) -> httpx.Response:
    body = {"path": "a.py", "prefix": f"def scale_{n}(x):\n    return ", "model": "code-small",
            "max_tokens": 4, "cursor_id": f"c{n}", **extra}
    return httpx.post(f"{server.url}/v1/tab", json=body, headers=headers, timeout=120)


def apply(server: LiveServer, headers: dict, method: str) -> httpx.Response:
    """An exact SEARCH/REPLACE edit: the deterministic merge takes it; `method="model"`
    makes the model rewrite it anyway."""
    body = {"path": "stats.py", "original": ORIGINAL, "edit": EXACT, "method": method,
            "model": "code-small"}
    return httpx.post(f"{server.url}/v1/apply", json=body, headers=headers, timeout=300)


def at_once(*calls) -> list[httpx.Response]:
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def test_tab_model_calls_are_admitted_by_rpm_and_the_cache_stays_free(server):
    _, headers = key(server, "tab-rpm", rpm=1)
    replies = at_once(lambda: tab(server, headers, 1), lambda: tab(server, headers, 2))
    assert sorted(r.status_code for r in replies) == [200, 429], [r.text for r in replies]
    served = next(r for r in replies if r.status_code == 200)
    refused = next(r for r in replies if r.status_code == 429)
    assert served.json()["source"] == "model" and int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    n = 1 if replies[0] is served else 2
    again = tab(server, headers, n)  # the served request again: answered from the cache
    assert again.status_code == 200 and again.json()["source"] == "cache"


def test_tab_charges_the_tokens_the_model_used_and_refuses_past_the_budget(server):
    store, headers = key(server, "tab-budget", budget_tokens=100_000)
    reply = tab(server, headers, 10).json()
    assert reply["source"] == "model" and reply["prompt_tokens"] > 0
    assert used(store, "tab-budget") == reply["prompt_tokens"] + reply["completion_tokens"]
    store, poor = key(server, "tab-poor", budget_tokens=5)
    refused = tab(server, poor, 11)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "budget_exhausted"
    assert tab(server, poor, 11, fast_only=True).json()["source"] == "miss"  # free
    assert used(store, "tab-poor") == 0


def test_a_cold_documents_short_answer_is_charged_for_the_full_window_it_prefills(server):
    """A document the server has not seen is answered from a short window while its full
    window is prefilled in the background: the request is charged for both, or a tenant
    could make the server evaluate ~10x the tokens it pays for (one cold path per request)."""
    store, headers = key(server, "tab-cold", budget_tokens=100_000)
    prefix = "".join(f"def scale_{i}(x):\n    return x * {i}\n\n\n" for i in range(60))
    body = {"path": "cold.py", "prefix": prefix + "def scale_60(x):\n    return ",
            "model": "code-small", "max_tokens": 4, "cursor_id": "cold"}
    reply = httpx.post(f"{server.url}/v1/tab", json=body, headers=headers, timeout=120).json()
    assert reply["source"] == "model" and reply["window"] == "short", reply
    assert reply["prefill_tokens"] > reply["prompt_tokens"], reply
    assert used(store, "tab-cold") == (reply["prompt_tokens"] + reply["completion_tokens"]
                                       + reply["prefill_tokens"])


def test_apply_with_a_model_is_admitted_and_charged_deterministic_stays_free(server):
    store, headers = key(server, "apply-rpm", rpm=1, budget_tokens=100_000)
    replies = at_once(lambda: apply(server, headers, "model"),
                      lambda: apply(server, headers, "model"))
    assert sorted(r.status_code for r in replies) == [200, 429], [r.text for r in replies]
    result = next(r for r in replies if r.status_code == 200).json()
    assert result["method"] == "model"  # merged or declined: the model ran either way
    spent = result["output_tokens"] + result["stats"]["prompt_tokens"]
    assert spent > 0 and used(store, "apply-rpm") == spent
    for method in ("deterministic", "auto"):  # merged without a model: nothing counted
        free = apply(server, headers, method)
        assert free.status_code == 200 and free.json()["method"] == "deterministic"
    assert used(store, "apply-rpm") == spent


def test_apply_past_the_budget_is_refused_only_when_a_model_is_needed(server):
    store, headers = key(server, "apply-poor", budget_tokens=10)
    refused = apply(server, headers, "model")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "budget_exhausted"
    assert apply(server, headers, "auto").json()["ok"]  # the deterministic merge needs none
    assert used(store, "apply-poor") == 0
