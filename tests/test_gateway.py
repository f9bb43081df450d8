"""The gateway against real loopback upstreams that fail on purpose: failover, fallbacks,
cooldown and slow-start recovery, in-band stream errors, shedding order, keys and limits."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import pytest
from conftest import LiveServer, free_port, make_settings
from upstreams.server import Upstream

from codeplane.config import ConfigError, load_settings
from codeplane.gateway.keys import KeyStore
from codeplane.gateway.providers.openai import OpenAIDeployment, OpenAIProvider
from codeplane.gateway.providers.table import PROVIDERS, Row
from codeplane.models.engine import Engine
from codeplane.server.app import create_app

CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@pytest.fixture
def upstreams():
    ups = [Upstream(name=f"up{i}").start() for i in range(3)]
    yield ups
    for up in ups:
        up.stop()


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there: connection refused


@pytest.fixture
def start(tmp_path):
    """Starts a server over the given `[[models]]` (and `[router]`, `[gateway]`) in the test's
    home; each one it started is stopped when the test ends, passed or failed."""
    servers: list[LiveServer] = []

    def start_server(models, router=None, gateway=None, engine=None) -> LiveServer:
        settings = make_settings(tmp_path / "home", models=models, router=router or {},
                                 gateway=gateway or {})
        servers.append(LiveServer(create_app(settings, engine=engine or Engine(settings)),
                                  free_port()).start())
        return servers[-1]

    yield start_server
    for server in servers:
        server.stop()


def dep(name: str, url: str, **extra) -> dict:
    return {"name": name, "provider": "openai", "base_url": url, "model": "up-model", **extra}


def sse(reply: httpx.Response) -> list[str]:
    return [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]


def test_one_always_failing_deployment_never_fails_a_client(start, upstreams):
    good, bad = upstreams[0], upstreams[1]
    bad.reset("500")
    server = start([dep("chat", bad.url), dep("chat", good.url),
                    dep("chat", dead_url())])
    for i in range(30):
        body = {**CHAT, "stream": i % 2 == 1}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            text = "".join(sse(r)) if body["stream"] else r.read().decode()
        assert "up0" in text or "tok0" in text
    # The broken and the refusing deployment were cooled down after 3 failures each.
    assert bad.hits <= 3
    status = httpx.get(f"{server.url}/v1/gateway/status").json()
    states = {d["id"]: d["state"] for m in status["models"] for d in m["deployments"]}
    assert states["chat#0"] == "open" and states["chat#2"] == "open"
    assert states["chat#1"] == "closed"
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'codeplane_gateway_requests_total{deployment="chat#0",model="chat",' \
           'outcome="error"} 3.0' in metrics
    assert 'codeplane_gateway_circuit_open{deployment="chat#0"} 1.0' in metrics
    assert "codeplane_gateway_queue_wait_seconds_bucket" in metrics


def test_fallback_chain_and_client_errors_are_not_retried(start, upstreams):
    primary, backup = upstreams[0], upstreams[1]
    primary.reset("500")
    server = start([dep("chat", primary.url), dep("chat-backup", backup.url)],
                   router={"fallbacks": {"chat": ["chat-backup"]}})
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT)
    assert reply.status_code == 200
    assert reply.json()["choices"][0]["message"]["content"] == "hello from up1"
    assert reply.json()["model"] == "chat"
    assert backup.bodies[-1]["model"] == "up-model"  # upstream's own name goes upstream
    assert reply.headers["x-request-id"]
    # A 400 from upstream is the client's problem: returned as-is, never retried.
    primary.reset("ok")
    reply = httpx.post(f"{server.url}/v1/chat/completions",
                       json={**CHAT, "tool_choice": "bogus"})
    assert reply.status_code == 400  # validated before any upstream sees it


def test_429_names_when_to_retry(start, upstreams):
    up = upstreams[0]
    up.reset("429")
    up.retry_after = 7
    server = start([dep("chat", up.url)])
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT)
    assert reply.status_code == 429
    assert int(reply.headers["retry-after"]) == 7
    assert reply.json()["error"]["type"] == "rate_limit_error"
    # The deployment now cools down for the 7 s it asked for: no more upstream hits.
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT)
    assert reply.status_code == 503 and 1 <= int(reply.headers["retry-after"]) <= 7
    assert "slow down" in reply.json()["error"]["message"]
    assert up.hits == 1


def test_slow_first_token_fails_over(start, upstreams):
    slow, fast = upstreams[0], upstreams[1]
    slow.reset("slow_first")
    server = start([dep("chat", slow.url, first_token_timeout_s=0.3, timeout_s=0.3),
                    dep("chat", fast.url)])
    for stream in (True, False, True):
        start_t = time.perf_counter()
        with httpx.stream("POST", f"{server.url}/v1/chat/completions",
                          json={**CHAT, "stream": stream}) as r:
            assert r.status_code == 200
            r.read()
        assert time.perf_counter() - start_t < 2
    assert fast.hits == 3


@pytest.mark.parametrize("mode", ["cut", "malformed", "stall", "error_event"])
def test_stream_broken_after_first_token_ends_with_error_event(start, upstreams, mode):
    up = upstreams[0]
    up.reset(mode)
    server = start([dep("chat", up.url)], router={"stream_idle_timeout_s": 0.3})
    with httpx.stream("POST", f"{server.url}/v1/chat/completions",
                      json={**CHAT, "stream": True}, timeout=10) as r:
        assert r.status_code == 200
        events = sse(r)
    assert events[-1] != "[DONE]"
    last = json.loads(events[-1])
    assert last["error"]["code"] == "stream_interrupted"
    assert any('"tok0 "' in e for e in events)  # the client did see the first tokens
    assert up.hits == 1  # never retried once tokens were out


def test_cooldown_half_open_probe_and_slow_start(start, upstreams):
    flaky, steady = upstreams[0], upstreams[1]
    flaky.reset("500")
    server = start([dep("chat", flaky.url), dep("chat", steady.url)],
                   router={"cooldown_s": 0.5, "slow_start_s": 3.0})
    url = f"{server.url}/v1/chat/completions"
    with httpx.Client() as http:
        for _ in range(12):
            assert http.post(url, json=CHAT).status_code == 200
        assert flaky.hits == 3  # opened after allowed_fails=3
        flaky.reset("ok")
        time.sleep(0.6)  # cooldown over: half-open
        early = []
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # first third of the ramp
            early.append(http.post(url, json=CHAT).json()["choices"][0]["message"]["content"])
        time.sleep(2.2)  # ramp complete
        late = [http.post(url, json=CHAT).json()["choices"][0]["message"]["content"]
                for _ in range(len(early))]
    share_early = early.count("hello from up0") / len(early)
    share_late = late.count("hello from up0") / len(late)
    assert share_early > 0  # the probe went through and closed the circuit
    assert share_early < 0.3 and share_late > 0.35, (share_early, share_late)


def test_slow_start_caps_parallelism_of_a_recovered_only_deployment(start, upstreams):
    up = upstreams[0]
    up.reset("500")
    server = start([dep("chat", up.url)],
                   # the cap is ceil(20 * elapsed / 200 s): 1 for the test's first 10 s, so a
                   # loaded machine's slower requests never see it ramp past the assertion's 3
                   router={"cooldown_s": 0.3, "slow_start_s": 200.0, "slow_start_parallel": 20})
    url = f"{server.url}/v1/chat/completions"
    for _ in range(3):
        httpx.post(url, json=CHAT)
    up.reset("ok")
    up.delay_s = 0.2
    time.sleep(0.35)
    assert httpx.post(url, json=CHAT).status_code == 200  # the half-open probe
    up.max_active = 0
    with ThreadPoolExecutor(20) as pool:
        codes = list(pool.map(lambda _: httpx.post(url, json=CHAT, timeout=30).status_code,
                              range(20)))
    assert codes == [200] * 20  # everyone served, queued at the gateway...
    assert up.max_active <= 3  # ...not dumped on the recovering backend at once


def test_overload_sheds_batch_before_interactive(start, upstreams):
    up = upstreams[0]
    up.delay_s = 0.3
    server = start([dep("chat", up.url, max_parallel=4)],
                   gateway={"queue": {"batch": 4}, "queue_timeout_s": {"batch": 1.0}})
    url = f"{server.url}/v1/chat/completions"

    http = httpx.Client(timeout=30, limits=httpx.Limits(max_connections=32))

    def call(priority: str) -> tuple[str, int, float, str | None]:
        t = time.perf_counter()
        r = http.post(url, json=CHAT, headers={"x-codeplane-priority": priority})
        return priority, r.status_code, time.perf_counter() - t, r.headers.get("retry-after")

    try:
        unloaded = sorted(call("interactive")[2] for _ in range(3))[1]
        stop = time.monotonic() + 2.5

        def flood() -> list[tuple]:
            out = []
            while time.monotonic() < stop:
                out.append(call("batch"))
                if out[-1][1] == 429:
                    time.sleep(0.05)
            return out

        with ThreadPoolExecutor(10) as pool:
            floods = [pool.submit(flood) for _ in range(10)]
            time.sleep(0.3)
            inter = [call("interactive") for _ in range(8)]  # a user typing meanwhile
            batch = [r for f in floods for r in f.result()]
        assert all(c == 200 for _, c, _, _ in inter)
        assert sum(1 for _, c, _, _ in batch if c == 429) >= 10
        assert all(ra and int(ra) >= 1 for _, c, _, ra in batch if c == 429)
        # Batch may hold only half the slots, so interactive finds room at once instead
        # of waiting 0.3 s behind a batch request.
        worst = max(s for _, _, s, _ in inter)
        metrics = httpx.get(f"{server.url}/metrics").text
        assert worst < unloaded + 0.2, (unloaded, inter)
        assert 'codeplane_gateway_shed_total{priority="batch",reason="queue"}' in metrics
    finally:
        http.close()


def test_keys_auth_rate_and_budget_limits(start, tmp_path, upstreams):
    up = upstreams[0]
    server = start([dep("chat", up.url)], gateway={"auth": "on"})
    store = KeyStore.from_settings(server.app.state.settings)
    _, limited = store.create("ci", rpm=2)
    _, budget = store.create("intern", budget_tokens=40)
    _, revoked = store.create("old")
    store.revoke("old")
    url = f"{server.url}/v1/chat/completions"
    assert httpx.post(url, json=CHAT).status_code == 401
    assert httpx.post(url, json=CHAT, headers=_bearer("cp-nope")).status_code == 401
    assert httpx.post(url, json=CHAT, headers=_bearer(revoked)).status_code == 401
    codes = [httpx.post(url, json=CHAT, headers=_bearer(limited)) for _ in range(3)]
    assert [r.status_code for r in codes] == [200, 200, 429]
    assert 20 <= int(codes[2].headers["retry-after"]) <= 31
    assert "'ci'" in codes[2].json()["error"]["message"]
    codes = [httpx.post(url, json=CHAT, headers=_bearer(budget)).status_code
             for _ in range(3)]
    # Each call holds ~23 tokens (prompt estimate + max_tokens 8) and uses 12: the third
    # finds 24 used + 23 held > 40.
    assert codes == [200, 200, 403]
    stored = b"".join(p.read_bytes()
                      for p in (tmp_path / "home" / "server").glob("codeplane.db*"))
    assert budget.encode() not in stored and limited.encode() not in stored


def test_per_ip_limit_and_priority_header(start, upstreams):
    server = start([dep("chat", upstreams[0].url)], gateway={"ip_rpm": 3})
    url = f"{server.url}/v1/chat/completions"
    bad = httpx.post(url, json=CHAT, headers={"x-codeplane-priority": "vip"})
    assert bad.status_code == 400
    codes = [httpx.post(url, json=CHAT).status_code for _ in range(4)]
    assert codes == [200, 200, 200, 429]


def test_anthropic_translation_both_ways(start, upstreams):
    up = upstreams[0]
    server = start([{"name": "claude", "provider": "anthropic", "base_url": up.base,
                     "model": "claude-x", "api_key_env": "NO_SUCH_VAR"}])
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "toolu_0", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
                {"role": "tool", "tool_call_id": "toolu_0", "content": "sunny"}]
    body = {"model": "claude", "messages": messages, "tools": tools, "tool_choice": "required"}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body).json()
    sent = up.bodies[-1]
    assert sent["system"] == "be brief" and sent["model"] == "claude-x"
    assert sent["tools"][0]["input_schema"]["properties"]["city"]
    assert sent["tool_choice"] == {"type": "any"}
    assert sent["messages"][1]["content"][0]["type"] == "tool_use"
    assert sent["messages"][2]["content"][0] == {"type": "tool_result",
                                                 "tool_use_id": "toolu_0",
                                                 "content": "sunny"}
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == \
        {"city": "Paris"}
    assert reply["usage"] == {"prompt_tokens": 9, "completion_tokens": 4,
                              "total_tokens": 13}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions",
                      json={**body, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        chunks = [json.loads(e) for e in sse(r) if e != "[DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or ""
                   for c in chunks if c["choices"])
    args = "".join(tc["function"].get("arguments", "") for c in chunks if c["choices"]
                   for tc in c["choices"][0]["delta"].get("tool_calls") or [])
    assert text.startswith("tok0 tok1") and json.loads(args) == {"city": "Paris"}
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert any(c["choices"] and c["choices"][0]["finish_reason"] == "tool_calls"
               for c in chunks)


def test_embeddings_and_completions_pass_through(start, upstreams):
    server = start([dep("emb", upstreams[0].url), dep("text", upstreams[1].url)])
    reply = httpx.post(f"{server.url}/v1/embeddings", json={"model": "emb", "input": ["a", "b"]})
    assert reply.status_code == 200 and len(reply.json()["data"]) == 2
    reply = httpx.post(f"{server.url}/v1/completions", json={"model": "text", "prompt": "x"})
    assert reply.json()["choices"][0]["text"] == "hello from up1"


@pytest.mark.model
def test_local_model_as_fallback_streams_through_the_gateway(start, engine):
    """A remote group that is down falls back to the built-in local model, streaming."""
    server = start([dep("chat", dead_url())], engine=engine,
                   router={"fallbacks": {"chat": ["code-small"]}})
    body = {**CHAT, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                      timeout=60) as r:
        assert r.status_code == 200
        events = sse(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] >= 1
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if c["choices"]).strip()
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'deployment="local:code-small",model="code-small",outcome="ok"' in metrics
    assert 'deployment="chat#0",model="chat",outcome="error"' in metrics


def test_invalid_config_names_key_and_line(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    toml = home / "codeplane.toml"
    toml.write_text('[[models]]\nname = "a"\nprovider = "openai"\nbase_url = "http://x/v1"\n\n'
                    '[[models]]\nname = "b"\nprovider = "openai"\nbase_url = "http://x/v1"\n'
                    'rpm = -5\n')
    with pytest.raises(ConfigError, match=r"models\.1\.rpm \(line 10\)"):
        load_settings(home=home)
    toml.write_text('[[models]]\nname = "a"\nprovider = "openai"\nbase_url = "http://x/v1"\n'
                    'api_key = "sk-123"\n')
    with pytest.raises(ConfigError, match="api_key_env"):
        load_settings(home=home)
    toml.write_text('[router]\ncooldown_s = 1\nretries = 3\n')
    with pytest.raises(ConfigError, match=r"router\.retries \(line 3\)"):
        load_settings(home=home)
    toml.write_text('[gateway]\nqueue = { urgent = 3 }\n')
    with pytest.raises(ConfigError, match="urgent"):
        load_settings(home=home)


def test_settings_loaded_without_the_provider_table_are_checked_before_the_gateway_builds(
        tmp_path):
    """A script or a child process loads settings without the provider table: the keys every
    provider has are checked then, the provider's own keys (and its kind) by its row before
    the gateway builds anything, named with key and line as a load names them."""
    home = tmp_path / "home"
    home.mkdir()
    first = '[[models]]\nname = "a"\nprovider = "openai"\nbase_url = "http://x/v1"\n\n'
    unknown = r"models\.1 \(line 6\): provider must be one of openai, anthropic, local"
    for entry, where in (('provider = "local"\nmax_paralel = 2\n',
                          r"models\.1\.max_paralel \(line 9\): Extra inputs"),
                         ('provider = "opneai"\n', unknown)):
        (home / "codeplane.toml").write_text(first + '[[models]]\nname = "b"\n' + entry)
        settings = make_settings(home)
        assert settings.models[0].base_url == "http://x/v1"
        with pytest.raises(ConfigError, match=where):
            create_app(settings, engine=Engine(settings))


class TeamDeployment(OpenAIDeployment):
    """A kind the test adds: a team's OpenAI-compatible GPU server, with a key of its own."""

    provider: Literal["team-gpu"]
    pool: str


def test_a_provider_is_one_row(start, upstreams, tmp_path, monkeypatch):
    """A row added to `PROVIDERS`, and nothing else, makes a kind: a `codeplane` command
    checks its entries' keys when settings load, and the gateway builds and routes it."""
    from typer.testing import CliRunner

    from codeplane.cli import app

    monkeypatch.setitem(PROVIDERS, "team-gpu", Row(OpenAIProvider, TeamDeployment))
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("CODEPLANE_HOME", str(home))
    entry = dep("chat", upstreams[0].url, provider="team-gpu", pool="a100")
    (home / "codeplane.toml").write_text(
        "[[models]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in entry.items())
        + 'pol = "h100"\n')
    result = CliRunner().invoke(app, ["keys", "list"])
    assert result.exit_code == 2
    assert "models.0.pol (line 7): Extra inputs are not permitted" in result.output
    (home / "codeplane.toml").unlink()
    server = start([entry])
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == "hello from up0"


def test_a_sub_app_on_its_own_loads_models_unchecked_after_the_program_ran(tmp_path,
                                                                          monkeypatch):
    """The provider table is the running program's, not the process's: once `codeplane`
    ran, a sub-app invoked on its own (no root to hand a table over) still loads `[[models]]`
    unchecked, as a script does."""
    from typer.testing import CliRunner

    from codeplane.cli import app
    from codeplane.gateway.cli import keys_app

    monkeypatch.setenv("CODEPLANE_HOME", str(tmp_path))
    (tmp_path / "codeplane.toml").write_text(
        '[[models]]\nname = "a"\nprovider = "team-gpu"\nbase_url = "http://x/v1"\n')
    assert CliRunner().invoke(app, ["keys", "list"]).exit_code == 2  # checked: unknown kind
    alone = CliRunner().invoke(keys_app, ["list"])
    assert alone.exit_code == 0, alone.output


def test_two_programs_check_models_by_their_own_provider_tables(tmp_path, monkeypatch):
    """Two `codeplane` programs in one process, built over different provider tables, each
    check `[[models]]` by the table its root hands its commands, whichever ran last."""
    from typer.testing import CliRunner

    from codeplane.cli import app, build_app

    team = build_app({**PROVIDERS, "team-gpu": Row(OpenAIProvider, TeamDeployment)})
    monkeypatch.setenv("CODEPLANE_HOME", str(tmp_path))
    (tmp_path / "codeplane.toml").write_text(
        '[[models]]\nname = "a"\nprovider = "team-gpu"\nbase_url = "http://x/v1"\n'
        'pool = "a100"\n')
    for program, code in ((team, 0), (app, 2), (team, 0), (app, 2)):
        result = CliRunner().invoke(program, ["keys", "list"])
        assert result.exit_code == code, result.output
    assert "provider must be one of openai, anthropic, local" in result.output


def _bearer(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


def test_keys_and_status_commands(start, tmp_path, upstreams, monkeypatch):
    from typer.testing import CliRunner

    from codeplane.cli import app

    server = start([dep("chat", upstreams[0].url)])
    monkeypatch.setenv("CODEPLANE_HOME", str(tmp_path / "home"))
    run = CliRunner().invoke
    created = run(app, ["keys", "create", "tab", "--rpm", "60", "--priority",
                        "interactive", "--json"])
    assert created.exit_code == 0, created.output
    secret = json.loads(created.output)["key"]
    assert secret.startswith("cp-")
    assert run(app, ["keys", "create", "tab"]).exit_code == 2  # name taken
    listed = json.loads(run(app, ["keys", "list", "--json"]).output)
    assert listed[0]["name"] == "tab" and listed[0]["rpm"] == 60
    assert secret not in json.dumps(listed)
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT,
                       headers=_bearer(secret))
    assert reply.status_code == 200
    assert run(app, ["keys", "revoke", "tab"]).exit_code == 0
    assert run(app, ["keys", "revoke", "tab"]).exit_code == 2
    status = run(app, ["gateway", "status", "--server", server.url, "--json"])
    assert status.exit_code == 0, status.output
    deps = {d["id"]: d for m in json.loads(status.output)["models"]
            for d in m["deployments"]}
    assert deps["chat#0"]["state"] == "closed" and deps["chat#0"]["latency_ms"]
    table = run(app, ["gateway", "status", "--server", server.url])
    assert "chat#0" in table.output and "closed" in table.output


def test_clients_that_hang_up_early_never_leak_a_slot(start, upstreams):
    """Streams whose client left before the first chunk still release the model's only
    slot, so the next request is served (no permanently wedged model)."""
    import socket

    up = upstreams[0]
    up.delay_s = 0.2
    server = start([dep("chat", up.url, max_parallel=1)])
    body = json.dumps({**CHAT, "stream": True}).encode()
    for _ in range(5):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                         b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(body), body))
    time.sleep(1.5)
    status = httpx.get(f"{server.url}/v1/gateway/status").json()
    chat = next(m for m in status["models"] if m["name"] == "chat")
    assert chat["inflight"] == 0 and chat["deployments"][0]["outstanding"] == 0
    assert httpx.post(f"{server.url}/v1/chat/completions", json=CHAT,
                      timeout=10).status_code == 200


def test_shutdown_closes_the_services_the_app_built(start, upstreams):
    """The composition root closes what it built: the gateway flushes key usage (kept in
    memory for up to 10 s while running) when the server stops."""
    server = start([dep("chat", upstreams[0].url)], gateway={"auth": "on"})
    store = KeyStore.from_settings(server.app.state.settings)
    key, secret = store.create("ci")
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT,
                       headers=_bearer(secret))
    assert reply.status_code == 200
    assert store.used(key) == 0  # charged in the server's memory only so far
    server.stop()
    assert store.used(key) == 12
