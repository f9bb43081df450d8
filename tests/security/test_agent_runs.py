"""Attacks on server-side agent runs, against a real server on loopback whose model is a
scripted OpenAI-compatible upstream (also on loopback) reached through the gateway.

Each test is an attack or a fault from the security review (#1, #6): a Host header that
names the attacker's listener, client switches for sandbox and network, paths outside the
workspace roots, secrets pre-read into the first prompt, model streams and workspaces that
crash the run's thread, never-ending streams, and another tenant's run ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from upstreams.scripted import ScriptedModel, caller, run_server, wait_end, wait_for

START = 'data: {"choices": [{"index": 0, "delta": {"content": "I will"}}]}\n\n'
DONE = "data: [DONE]\n\n"


@pytest.fixture(scope="module")
def scripted_models():
    models = [ScriptedModel(), ScriptedModel()]
    for m in models:
        m.server.start()
    yield models
    for m in models:
        m.server.stop()


@pytest.fixture
def model(scripted_models) -> ScriptedModel:
    return scripted_models[0].reset()


@pytest.fixture
def attacker(scripted_models) -> ScriptedModel:
    """A listener the attacker runs: it answers every model call with a shell command."""
    listener = scripted_models[1].reset()
    listener.script = [{"calls": [("run_terminal_cmd", {"command": "id > rce.txt"})]}] * 5
    return listener


@pytest.fixture
def roots(tmp_path: Path) -> Path:
    """The one workspace root; `ws` inside it is the workspace the tests use."""
    root = tmp_path / "roots"
    (root / "ws").mkdir(parents=True)
    (root / "ws" / "a.py").write_text("A = 1\n")
    return root


@pytest.fixture
def serve(tmp_path: Path, model: ScriptedModel):
    """Start a server with the given `serve` policy (stopped after the test)."""
    started = []

    def start(**policy):
        started.append(run_server(tmp_path / f"home{len(started)}", model.url, **policy))
        return started[-1]

    yield start
    for server in started:
        server.stop()


def post(server, body: dict, tenant: str = "t1", **kw) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/agent/runs", json=body,
                      headers={**caller(server, tenant), **kw.pop("headers", {})}, timeout=30,
                      **kw)


def run(workspace: Path, **extra) -> dict:
    return {"task": "look around", "path": str(workspace), "model": "scripted",
            "stream": False, **extra}


def ended(server, run_id: str, tenant: str = "t1") -> dict:
    """The finished run; its transcript must end with run_end, matching the status."""
    got = wait_end(server.url, run_id, caller(server, tenant))
    assert got["transcript"][-1]["type"] == "run_end"
    assert got["transcript"][-1]["status"] == got["status"] == got["result"]["status"]
    return got


# ---------------------------------------------------------------- the model is server policy

def test_host_header_cannot_choose_the_agents_model(serve, roots, model, attacker) -> None:
    """#1: the model URL was built from the Host header; the attacker's listener got the
    first prompt and its tool call ran `id > rce.txt` on the host."""
    server = serve(workspace_roots=[str(roots)], allow_unsandboxed=True)
    ws = roots / "ws"
    reply = post(server, run(ws, sandbox=False),
                 headers={"host": f"127.0.0.1:{attacker.server.port}"})
    assert reply.status_code == 200, reply.text
    got = ended(server, reply.json()["id"])
    assert attacker.requests == [] and model.requests
    assert not (ws / "rce.txt").exists()
    start = got["transcript"][0]
    assert start["model_info"] == {"name": "scripted", "via": "gateway", "priority": "agent"}
    assert "base_url" not in json.dumps(start["model_info"])


def test_model_calls_pass_the_gateways_admission(serve, roots, model) -> None:
    """The in-process client is no back door around the gateway's limits: with one request
    a minute per client address, the run's second model call is refused and ends the run."""
    model.script = [{"calls": [("list_dir", {})]}]
    server = serve(workspace_roots=[str(roots)], gateway={"ip_rpm": 1})
    got = ended(server, post(server, run(roots / "ws")).json()["id"])
    assert got["status"] == "error" and len(model.requests) == 1
    assert "over 1 requests/min" in got["result"]["error"]


def test_model_calls_are_the_callers_key(serve, roots, model) -> None:
    """A run spends its caller's key: its priority class, its token budget."""
    model.script = [{"calls": [("list_dir", {})]}]
    server = serve(workspace_roots=[str(roots)])
    caller(server, "ci", budget_tokens=100, priority="batch")
    got = ended(server, post(server, run(roots / "ws"), "ci").json()["id"], "ci")
    assert got["transcript"][0]["model_info"]["priority"] == "batch"
    assert got["status"] == "error" and "budget" in got["result"]["error"]
    assert len(model.requests) <= 1  # the budget stops the run at its first or second call


def test_sandbox_and_network_switches_are_refused_unless_allowed(serve, roots) -> None:
    server = serve(workspace_roots=[str(roots)])
    ws = roots / "ws"
    no_sandbox = post(server, run(ws, sandbox=False))
    assert no_sandbox.status_code == 403
    assert no_sandbox.json()["error"]["code"] == "unsandboxed_not_allowed"
    assert "serve.allow_unsandboxed" in no_sandbox.json()["error"]["message"]
    network = post(server, run(ws, network=True))
    assert network.status_code == 403 and network.json()["error"]["code"] == "network_not_allowed"
    default = post(server, run(ws))
    env = ended(server, default.json()["id"])["transcript"][0]["environment"]
    assert env["sandboxed"] is True and env["network"] is False
    allowed = serve(workspace_roots=[str(roots)], allow_unsandboxed=True, allow_network=True)
    reply = post(allowed, run(ws, network=True))
    env = ended(allowed, reply.json()["id"])["transcript"][0]["environment"]
    assert env["sandboxed"] is True and env["network"] is True


def test_path_must_resolve_under_a_workspace_root(serve, roots, tmp_path) -> None:
    """#1: `path: "/"` mounted the whole filesystem read-write; a NUL byte gave a 500."""
    ws = roots / "ws"
    outside = tmp_path / "outside"
    outside.mkdir()
    (ws / "escape").symlink_to(outside)
    none = serve()
    refused = post(none, run(ws))
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "no_workspace_roots"
    assert "workspace_roots" in refused.json()["error"]["message"]
    server = serve(workspace_roots=[str(roots)])
    for path in ("/", str(outside), str(ws / "escape"), f"{roots}/../outside", str(tmp_path)):
        reply = post(server, run(Path(path)))
        assert reply.status_code == 403, (path, reply.text)
        assert reply.json()["error"]["code"] == "outside_workspace_roots"
    for path, why in (("ws", "must be absolute"), (str(ws / "nope"), "not a directory"),
                      (str(ws / "a.py"), "not a directory"), (f"{ws}/\x00x", "NUL"),
                      ("/" + "x" * 5000, "at most 4096")):
        reply = post(server, run(Path(".")) | {"path": path})
        assert reply.status_code == 400, (path, reply.text)
        assert why in reply.json()["error"]["message"]
    surrogate = b'{"task": "hi", "model": "scripted", "path": "%s/\\ud800"}' % str(ws).encode()
    reply = httpx.post(f"{server.url}/v1/agent/runs", content=surrogate,
                       headers={"content-type": "application/json"})
    assert reply.status_code == 400 and "path" in reply.json()["error"]["message"]
    extra = post(server, run(ws, base_url="http://evil"))
    assert extra.status_code == 400 and "base_url" in extra.json()["error"]["message"]
    assert post(server, run(ws, model="nope")).status_code == 404
    inside = post(server, run(ws))  # the root itself and directories under it are fine
    assert ended(server, inside.json()["id"])["status"] == "completed"
    assert post(server, run(roots)).status_code == 200


def test_first_prompt_never_carries_secret_files(serve, roots, model) -> None:
    """#1: a task naming a key made the harness pre-read it into the first prompt."""
    ws = roots / "ws"
    pem = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n" \
          "-----END OPENSSH PRIVATE KEY-----\n"
    (ws / ".env").write_text("OPENAI_API_KEY=sk-live-0123456789abcdef\n")
    (ws / "id_rsa").write_text(pem)
    (ws / "certs").mkdir()
    (ws / "certs" / "server.pem").write_text(pem)
    (ws / "backup.txt").write_text(pem)  # a private key under a harmless name
    server = serve(workspace_roots=[str(roots)])
    task = "compare .env, id_rsa, certs/server.pem, backup.txt and a.py"
    ended(server, post(server, run(ws, task=task)).json()["id"])
    prompt = json.dumps(model.requests[0]["messages"])
    assert "A = 1" in prompt  # the harmless named file was pre-read
    assert "PRIVATE KEY" not in prompt and "sk-live" not in prompt


# ---------------------------------------------------------------------- every run ends

@pytest.mark.parametrize("broken", [
    'data: {"choices": [\n\n',  # malformed JSON
    'data: {"error": "upstream exploded"}\n\n',  # an error as a bare string
    'data: {"error": {"message": "overloaded", "code": "server_error"}}\n\n',
    'data: {"choices": [7]}\n\n',  # valid JSON, wrong shape
    'data: {"choices": [{"delta": {"tool_calls": [{"index": "x"}]}}]}\n\n',
    ": only a comment, then the connection ends\n\n",  # cut before [DONE]
], ids=["malformed", "error-string", "error-object", "wrong-shape", "bad-index", "cut"])
def test_broken_model_streams_end_the_run(serve, roots, model, broken) -> None:
    """#6: a chunk `{"error": "str"}` raised AttributeError and the run stayed "running"."""
    model.script = [{"raw": [START, broken]}]
    server = serve(workspace_roots=[str(roots)])
    got = ended(server, post(server, run(roots / "ws")).json()["id"])
    assert got["status"] == "error" and got["result"]["error"]


def test_never_ending_stream_is_cancelled_and_closed(serve, roots, model) -> None:
    model.script = [{"raw": [START], "hang": True}]
    server = serve(workspace_roots=[str(roots)])
    run_id = post(server, run(roots / "ws")).json()["id"]
    wait_for(lambda: model.requests)  # the model call is under way
    cancel = httpx.post(f"{server.url}/v1/agent/runs/{run_id}/cancel",
                        headers=caller(server))
    assert cancel.status_code == 200 and cancel.json()["cancel_requested"]
    assert ended(server, run_id)["status"] == "cancelled"
    wait_for(lambda: model.abandoned == 1)  # the upstream stream was closed, not left open


def test_workspace_that_crashes_listing_still_ends_the_run(serve, roots) -> None:
    """A file name that is not UTF-8 made the workspace listing raise before the loop's
    try: the thread died and the run stayed "running" with keep-alives forever."""
    ws = roots / "ws"
    (ws / "caf\udce9.py").write_text("x = 1\n")  # the byte 0xE9, as a Latin-1 name
    server = serve(workspace_roots=[str(roots)])
    got = ended(server, post(server, run(ws)).json()["id"])
    assert got["status"] != "error", got["result"]  # and the listing itself copes with it


def test_tool_call_that_crashes_the_scheduler_still_ends_the_run(serve, roots, model) -> None:
    """Two edits in one turn, the second with arguments that are not JSON: comparing them
    for conflicts raised AttributeError outside any tool, on the run's thread."""
    edit = {"path": "a.py", "old_string": "A = 1", "new_string": "A = 2"}
    model.script = [{"calls": [("edit_file", edit), ("edit_file", "{not json")]}]
    server = serve(workspace_roots=[str(roots)])
    got = ended(server, post(server, run(roots / "ws")).json()["id"])
    assert got["status"] != "error", got["result"]  # the bad call is refused as a tool result


# -------------------------------------------------------------------- runs per tenant

def test_runs_belong_to_a_tenant_and_are_capped_per_tenant(serve, roots, model) -> None:
    model.script = [{"raw": [START], "hang": True}] * 2
    server = serve(workspace_roots=[str(roots)], max_runs_per_tenant=1)
    ws = roots / "ws"
    mine = post(server, run(ws)).json()["id"]
    url = f"{server.url}/v1/agent/runs/{mine}"
    me, other = caller(server, "t1"), caller(server, "t2")
    assert httpx.get(url, headers=other).status_code == 404
    assert httpx.get(url + "/events", headers=other).status_code == 404
    assert httpx.post(url + "/cancel", headers=other).status_code == 404
    assert httpx.get(url, headers=me).json()["status"] == "running"  # t2's cancel did nothing
    with httpx.stream("GET", url + "/events", headers=me, timeout=10) as events:  # may watch
        first = next(line for line in events.iter_lines() if line.startswith("data: "))
    assert json.loads(first[6:])["type"] == "run_start"
    assert httpx.get(url, headers=me).json()["status"] == "running"  # leaving cancels nothing
    over = post(server, run(ws))
    assert over.status_code == 429 and over.json()["error"]["code"] == "too_many_runs"
    assert "serve.max_runs_per_tenant" in over.json()["error"]["message"]
    theirs = post(server, run(ws), tenant="t2")  # another tenant has its own cap
    assert theirs.status_code == 200
    for tenant, run_id in (("t1", mine), ("t2", theirs.json()["id"])):
        httpx.post(f"{server.url}/v1/agent/runs/{run_id}/cancel",
                   headers=caller(server, tenant))
        assert ended(server, run_id, tenant)["status"] == "cancelled"
    assert post(server, run(ws)).status_code == 200  # the finished run no longer counts
