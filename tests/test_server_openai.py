"""The OpenAI-compatible server, driven by the official `openai` SDK over real loopback HTTP,
with the real built-in models."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from conftest import WEATHER_TOOL as WEATHER
from conftest import LiveServer, free_port, make_settings
from upstreams.scripted import wait_for

from codeplane.server.app import create_app


@pytest.fixture(scope="module")
def client(live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="unused", max_retries=0)


def test_sdk_chat_tool_call_with_code_medium(client):
    reply = client.chat.completions.create(
        model="code-medium", temperature=0, max_tokens=96, tools=[WEATHER],
        messages=[{"role": "user", "content": "What's the weather in Paris right now?"}])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert "paris" in json.loads(call.function.arguments)["city"].lower()
    assert reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens > 0


def test_tool_result_round_trip(client, engine):
    """An assistant tool call and the tool's result render through the model's own template
    (arguments as an object, the result as a tool response) and the server accepts them."""
    messages = [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21, "sky": "sunny"}'},
    ]
    prompt = engine.run_sync("code-medium", "render_chat", messages, [WEATHER])
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert '<tool_response>\n{"temp_c": 21, "sky": "sunny"}\n</tool_response>' in prompt
    reply = client.chat.completions.create(model="code-medium", temperature=0, max_tokens=8,
                                           tools=[WEATHER], messages=messages)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_choice_required_forces_a_call(client):
    reply = client.chat.completions.create(
        model="code-small", temperature=0, max_tokens=60, tools=[WEATHER],
        tool_choice="required", messages=[{"role": "user", "content": "Hello there!"}])
    assert reply.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_sdk_fim_completion_with_code_small(client):
    prefix = "def fibonacci(n):\n    if n < 2:\n        return n\n    return "
    suffix = "\n\n\nprint(fibonacci(10))\n"
    reply = client.completions.create(model="code-small", prompt=prefix, suffix=suffix,
                                      max_tokens=16, temperature=0, stop=["\n"])
    middle = reply.choices[0].text
    assert "fibonacci(n - 1)" in middle.replace("n-1", "n - 1")


def test_streaming_chat_matches_full_answer(client):
    kwargs = {"model": "code-small", "temperature": 0, "max_tokens": 24,
              "messages": [{"role": "user", "content": "Name three colors."}]}
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kwargs)
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == full
    assert finish in ("stop", "length") and usage.completion_tokens > 0
    assert usage.prompt_tokens_details.cached_tokens > 0  # same prompt again: KV prefix reused


def test_streaming_tool_call(client):
    stream = client.chat.completions.create(
        model="code-medium", temperature=0, max_tokens=96, tools=[WEATHER], stream=True,
        messages=[{"role": "user", "content": "What's the weather in Berlin?"}])
    calls, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            calls += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert calls[0].function.name == "get_weather"


def test_streaming_completion(client):
    stream = client.completions.create(model="code-small", prompt="def add(a, b):\n    return",
                                       max_tokens=8, temperature=0, stream=True)
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert "a + b" in text or "a+b" in text


def test_models_health_and_metrics(live_server, client):
    ids = {m.id for m in client.models.list()}
    assert {"code-small", "code-medium"} <= ids
    health = httpx.get(f"{live_server.url}/healthz").json()
    assert health["status"] == "ok"
    metrics = httpx.get(f"{live_server.url}/metrics").text
    assert 'route="/v1/chat/completions",status="200"' in metrics
    assert "codeplane_tokens_total" in metrics and "codeplane_queue_wait_seconds" in metrics


def test_unknown_model_is_404_in_openai_shape(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert "nope" in info.value.body["message"] and info.value.body["code"] == "model_not_found"


def test_malformed_bodies_are_400(live_server):
    url = f"{live_server.url}/v1/chat/completions"
    for body in ({"model": "code-small"}, {"model": "code-small", "messages": "hi"},
                 {"model": "code-small", "messages": [{"role": "wizard", "content": "x"}]}):
        reply = httpx.post(url, json=body)
        assert reply.status_code == 400
        assert reply.json()["error"]["type"] == "invalid_request_error"
    reply = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert reply.status_code == 400


def test_prompt_over_context_window_is_400_naming_limit(client, engine):
    n_ctx = engine.settings.engine.n_ctx
    huge = "word " * (n_ctx + 100)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="code-small", prompt=huge, max_tokens=4)
    assert str(n_ctx) in info.value.body["message"]
    assert info.value.body["code"] == "context_length_exceeded"


def test_missing_and_corrupt_weights_are_503_naming_the_fix(tmp_path):
    settings = make_settings(tmp_path / "home")
    # A home of its own, without the shared weights:
    (tmp_path / "home" / "models").unlink()
    models = settings.models_dir
    models.mkdir()
    server = LiveServer(create_app(settings), free_port()).start()
    try:
        body = {"model": "code-small", "prompt": "x", "max_tokens": 2}
        reply = httpx.post(f"{server.url}/v1/completions", json=body)
        assert reply.status_code == 503
        assert "codeplane model pull code-small" in reply.json()["error"]["message"]
        (models / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf").write_bytes(b"GGUF" + b"\0" * 64)
        reply = httpx.post(f"{server.url}/v1/completions", json=body)
        assert reply.status_code == 503
        assert "codeplane model pull code-small --force" in reply.json()["error"]["message"]
        assert httpx.get(f"{server.url}/healthz").status_code == 200  # nothing crashed
    finally:
        server.stop()


def test_client_disconnect_cancels_generation(live_server, engine):
    """Dropping a stream frees the model within a token or two, not after max_tokens: the
    tokens the abandoned generation produced (counted in /metrics once it ends) are a few,
    not 2,000."""
    body = {"model": "code-small", "max_tokens": 2000, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Count from 1 to 5000 in words, comma separated."}]}
    took, made = tokens(live_server)
    with (httpx.Client(base_url=live_server.url, timeout=60) as http,
          http.stream("POST", "/v1/chat/completions", json=body) as reply):
        for line in reply.iter_lines():
            if line.startswith("data: ") and '"content":"' in line:  # compact JSON
                break  # first token arrived; hang up
    wait_for(lambda: tokens(live_server)[0] > took, 300, "the abandoned generation to end")
    assert tokens(live_server)[1] - made < 100
    quick = httpx.post(f"{live_server.url}/v1/completions", timeout=60,
                       json={"model": "code-small", "prompt": "1, 2, 3,", "max_tokens": 2})
    assert quick.status_code == 200


def tokens(server) -> tuple[float, float]:
    """Tokens code-small took in and generated for this server's requests (its /metrics):
    a generation is counted when it ends, cancelled or not."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text

    def total(direction: str) -> float:
        return next((float(line.split()[-1]) for line in text.splitlines()
                     if line.startswith("codeplane_tokens_total{") and
                     'model="code-small"' in line and f'direction="{direction}"' in line), 0.0)

    return total("in"), total("out")


def test_non_streaming_client_timeout_cancels_generation(live_server):
    # Greedy decoding of this prompt runs for the whole budget (deterministic, unlike
    # sampling, which may end early and answer before the client's timeout).
    body = {"model": "code-small", "max_tokens": 2000, "temperature": 0,
            "messages": [{"role": "user", "content": "Count from 1 to 5000 in words, "
                                                     "comma separated."}]}
    took, made = tokens(live_server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live_server.url}/v1/chat/completions", json=body, timeout=3)
    wait_for(lambda: tokens(live_server)[0] > took, 300, "the abandoned generation to end")
    assert tokens(live_server)[1] - made < 1000  # 3 s of decoding at most, not all 2,000
    quick = httpx.post(f"{live_server.url}/v1/completions", timeout=60,
                       json={"model": "code-small", "prompt": "1, 2, 3,", "max_tokens": 2})
    assert quick.status_code == 200
