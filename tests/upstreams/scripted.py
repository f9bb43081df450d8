"""A scripted OpenAI-compatible chat model on loopback (a stand-in for a frontier provider):
replies with scripted assistant messages, streamed as real providers stream them, or with a
broken stream sent as given; records every request and every stream the client left early.

Also the pieces for a real codeplane server whose agent runs use it: `run_server` starts the
real app on loopback with the scripted model as a gateway deployment, and `TenantHeader` sets
the request's principal from an `x-test-tenant` header (standing in for the auth gate, which
resolves it from the API key; until the gate is on main).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from conftest import LiveServer, free_port, make_settings
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from codeplane.gateway.keys import KeyStore
from codeplane.models.engine import Engine
from codeplane.server.app import create_app


class ScriptedModel:
    """`script` items: {"content", "calls": [(name, args)], "prompt_tokens"} for a reply,
    {"error", "status"} for an HTTP error, {"raw": [lines]} for a stream sent as given, and
    {"raw": [...], "hang": True} for a stream that never ends after its lines."""

    def __init__(self) -> None:
        self.script: list[dict] = []
        self.requests: list[dict] = []
        self.delay = 0.0
        self.chunk_delay = 0.0
        self.abandoned = 0
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            self.requests.append(body)
            await asyncio.sleep(self.delay)
            step = self.script.pop(0) if self.script else {"content": "done"}
            if "error" in step:
                return JSONResponse({"error": step["error"]}, status_code=step["status"])
            if "raw" in step:  # a broken or failing stream, sent as given
                return StreamingResponse(self._raw(step["raw"], step.get("hang", False)),
                                         media_type="text/event-stream")
            message = {"role": "assistant", "content": step.get("content")}
            if step.get("calls"):
                message["tool_calls"] = [
                    {"id": f"call_{i}", "type": "function",
                     "function": {"name": n, "arguments": a if isinstance(a, str)
                                  else json.dumps(a)}}
                    for i, (n, a) in enumerate(step["calls"])]
            finish = "tool_calls" if step.get("calls") else "stop"
            usage = {"prompt_tokens": step.get("prompt_tokens", 100), "completion_tokens": 10,
                     "total_tokens": 110}
            if not body.get("stream"):
                return {"choices": [{"index": 0, "message": message, "finish_reason": finish}],
                        "usage": usage}
            return StreamingResponse(self._sse(message, finish, usage),
                                     media_type="text/event-stream")

        self.server = LiveServer(app, free_port())

    @property
    def url(self) -> str:
        return self.server.url + "/v1"

    def reset(self) -> ScriptedModel:
        self.script.clear()
        self.requests.clear()
        self.delay = self.chunk_delay = 0.0
        self.abandoned = 0
        return self

    async def _raw(self, lines: list[str], hang: bool):
        try:
            for line in lines:
                yield line
            while hang:  # never ends; keep-alive comments show the connection is alive
                await asyncio.sleep(0.2)
                yield ": keep-alive\n\n"
        except asyncio.CancelledError:
            self.abandoned += 1
            raise

    async def _sse(self, message: dict, finish: str, usage: dict):
        """Content in 4-character pieces, each tool call's arguments in two halves."""
        text = message.get("content") or ""
        deltas = [{"role": "assistant"}] + [{"content": text[i:i + 4]}
                                            for i in range(0, len(text), 4)]
        for index, call in enumerate(message.get("tool_calls") or []):
            args = call["function"]["arguments"]
            half = len(args) // 2
            deltas.append({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                           "function": {"name": call["function"]["name"],
                                                        "arguments": args[:half]}}]})
            deltas.append({"tool_calls": [{"index": index,
                                           "function": {"arguments": args[half:]}}]})
        chunks = [{"choices": [{"index": 0, "delta": d, "finish_reason": None}]}
                  for d in deltas]
        chunks += [{"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
                   {"choices": [], "usage": usage}]
        try:
            for chunk in chunks:
                await asyncio.sleep(self.chunk_delay)
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            self.abandoned += 1
            raise


def run_server(home: Path, model_url: str | None, engine: Engine | None = None,
               gateway: dict | None = None, **serve) -> LiveServer:
    """A real codeplane server on loopback; `model_url` is served as the model "scripted"."""
    models = [{"name": "scripted", "provider": "openai", "base_url": model_url,
               "model": "scripted"}] if model_url else []
    settings = make_settings(home, models=models, gateway=gateway or {}, serve=serve)
    app = create_app(settings, engine=engine or Engine(settings))
    server = LiveServer(app, free_port())
    return server.start()


def wait_for(condition: Callable[[], Any], timeout: float = 30, what: str = "") -> Any:
    """Poll until `condition()` is truthy; fail the test after `timeout` seconds (a bound
    for a hang, not a speed check)."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"still waiting after {timeout}s {what}"
        time.sleep(0.05)
    return value


def caller(server: LiveServer, tenant: str = "t1", **key_options) -> dict[str, str]:
    """Headers that make a request come from `tenant`, through a real API key of that tenant
    (created on first use with `key_options`: budget_tokens, priority, ...), so every request
    passes the server's own auth gate."""
    callers = server.__dict__.setdefault("callers", {})
    if tenant not in callers:
        _, secret = KeyStore.from_settings(server.app.state.settings).create(
            tenant, tenant=tenant, **key_options)
        callers[tenant] = {"authorization": f"Bearer {secret}"}
        wait_for(lambda: httpx.get(f"{server.url}/v1/models",  # the server has seen it
                                   headers=callers[tenant]).status_code == 200)
    return callers[tenant]


def ui_sign_in(url: str, key: str, headers: dict | None = None) -> httpx.Response:
    """Sign in to the web UI as a browser does: GET the form, then POST its token with the
    key, the form's cookie alongside (passed by hand: a `Secure` one would not go back over
    plain http, where a TLS proxy would carry it). 303 with the session cookie on success."""
    form = httpx.get(f"{url}/ui/login", headers=headers)
    token = re.search(r'name="csrf" value="([^"]+)"', form.text).group(1)
    cookie = f"codeplane_login={form.cookies['codeplane_login']}"
    return httpx.post(f"{url}/ui/login", data={"key": key, "csrf": token},
                      headers={**(headers or {}), "cookie": cookie})


def ui_session(server: LiveServer, tenant: str = "t1") -> dict[str, str]:
    """Cookies of a browser signed in to the web UI as `tenant` (its `caller` key)."""
    key = caller(server, tenant)["authorization"][7:]
    return {"codeplane_session": ui_sign_in(server.url, key).cookies["codeplane_session"]}


def wait_end(url: str, run_id: str, headers: dict[str, str] | None = None,
             timeout: float = 30) -> dict:
    """The run once it has ended (fails the test if it is still running at `timeout`)."""
    def finished() -> dict | None:
        got = httpx.get(f"{url}/v1/agent/runs/{run_id}", headers=headers).json()
        return got if got["status"] != "running" else None

    return wait_for(finished, timeout, f"for run {run_id} to end")
