"""Schemathesis over the OpenAPI schema of every route, with a valid key, over real loopback
HTTP: whatever a client sends (valid or not), the answer is never a 5xx.

Model work is kept out of the fuzz so it runs in a minute or two: generated model names do
not exist (404), Tab is configured with a model that does not exist, apply and agent-run bodies
name one too. Agent runs are also forced to the safe policy (sandbox on, network off, not
streamed), so a generated body can never start a real run on this machine.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from conftest import LiveServer, free_port, make_settings
from hypothesis import HealthCheck, settings

from codeplane.gateway.keys import KeyStore
from codeplane.server.app import create_app

NO_MODEL = "fuzz-no-such-model"
WORKSPACE, WS_KEY = "fuzzws", "k" * 32  # opened up front: index bodies reach the service
EXAMPLES = 30  # per operation: ~20 operations finish in about a minute
CALLS: dict[str, int] = {}  # requests per operation, printed by the summary test


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory, engine):
    home = tmp_path_factory.mktemp("fuzz") / "home"
    cfg = make_settings(home, gateway={"auth": "on"}, tab={"model": NO_MODEL})
    _, secret = KeyStore.from_settings(cfg).create("fuzzer", tenant="fuzz")
    server = LiveServer(create_app(cfg, engine=engine), free_port()).start()
    auth = {"authorization": f"Bearer {secret}"}
    opened = httpx.put(f"{server.url}/v1/index/workspaces/{WORKSPACE}",
                       headers={**auth, "x-codeplane-key": WS_KEY}, timeout=60)
    assert opened.status_code == 200, opened.text
    yield server, auth
    server.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    server, auth = fuzz_server
    loaded = schemathesis.openapi.from_url(f"{server.url}/openapi.json", headers=auth)
    loaded.config.generation.update(modes=list(schemathesis.GenerationMode))  # bad input too
    return loaded


schema = schemathesis.pytest.from_fixture("api_schema")


def _aim(case, n: int) -> None:
    """Every other index request goes to the open workspace with its key: random ids and
    keys only ever reach the 404/403 checks."""
    if case.operation.path.startswith("/v1/index/workspaces/{ws}") and n % 2:
        case.path_parameters = {**(case.path_parameters or {}), "ws": WORKSPACE}
        case.headers = {**(case.headers or {}), "X-Codeplane-Key": WS_KEY}


def _defang(case) -> None:
    """No generated body may reach a real model or start a real agent run."""
    if not isinstance(case.body, dict):
        return
    path = case.operation.path
    if path in ("/v1/apply", "/v1/agent/runs"):
        case.body["model"] = NO_MODEL
    if path == "/v1/agent/runs":
        case.body.update(sandbox=True, network=False, stream=False)


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_route_answers_5xx(case, fuzz_server):
    _, auth = fuzz_server
    label = f"{case.operation.method.upper()} {case.operation.path}"
    CALLS[label] = CALLS.get(label, 0) + 1
    _aim(case, CALLS[label])
    _defang(case)
    response = case.call(headers=auth, timeout=60)
    assert response.status_code < 500, (label, case.body, response.text[:500])


def test_every_route_was_fuzzed(fuzz_server):
    """Runs after the fuzz (file order): no operation was skipped or left unexercised."""
    server, _ = fuzz_server
    documented = {f"{m.upper()} {p}" for p, ops in server.app.openapi()["paths"].items()
                  for m in ops}
    print("fuzz requests per operation:", CALLS, "total", sum(CALLS.values()))
    assert documented and documented <= set(CALLS)
