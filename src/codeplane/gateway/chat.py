"""A `ChatModel` that calls the Gateway in-process: what server-side agent runs talk to.

The same path as a client of `/v1/chat/completions` - the caller's key, its budget and rate
limits (`admit`), its priority class, the routing, fallbacks and circuit breakers - without a
request over loopback. Nothing about the model's address comes from the request that started
the run (the old loopback URL was built from the Host header, which an attacker chose).

The agent runs on a thread of its own; the gateway belongs to the server's event loop. Each
reply runs as a task on that loop while the agent's thread waits; a cancelled run cancels the
task, which closes the upstream stream (a local generation stops between two tokens).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request

from codeplane.core.chat import Cancelled, ModelError, Sampling, Turn, TurnBuilder
from codeplane.core.errors import APIError
from codeplane.core.principal import principal_of
from codeplane.core.schemas import ChatCompletionRequest
from codeplane.core.sse import chunk_error
from codeplane.gateway.admission import Shed
from codeplane.gateway.providers.base import Call, UpstreamError
from codeplane.gateway.router import Client, Gateway

CANCEL_POLL_S = 0.2  # how often a waiting agent thread looks at its cancel flag


class GatewayChatModel:
    def __init__(self, gateway: Gateway, name: str, client: Client,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.gateway, self.name, self.client, self.loop = gateway, name, client, loop

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "via": "gateway", "priority": self.client.priority}

    def complete(self, messages: list[dict], tools: list[dict], sampling: Sampling,
                 cancel: threading.Event | None = None) -> Turn:
        """One reply, streamed inside the gateway so that `cancel` can stop it mid-way."""
        call = self._call(messages, tools, sampling)
        future: Future[Turn] = asyncio.run_coroutine_threadsafe(self._reply(call), self.loop)
        while True:
            try:
                return future.result(timeout=CANCEL_POLL_S)
            except TimeoutError:
                if cancel is not None and cancel.is_set():
                    future.cancel()
                    raise Cancelled from None

    def _call(self, messages: list[dict], tools: list[dict], sampling: Sampling) -> Call:
        raw = {"model": self.name, "messages": messages, "tools": tools,
               "tool_choice": sampling.tool_choice, "max_tokens": sampling.max_tokens,
               "temperature": sampling.temperature, "stream": True,
               "stream_options": {"include_usage": True}}
        try:
            parsed = ChatCompletionRequest.model_validate(raw)
        except ValidationError as exc:
            raise ModelError(f"the agent built an invalid model request: {exc}",
                             "invalid_request") from None
        return Call("chat", raw, parsed, True, True, self.client.request_id)

    async def _reply(self, call: Call) -> Turn:
        try:
            self.gateway.admit(self.client)
            first, rest = await self.gateway.stream(call, self.client)
        except Shed as exc:
            raise ModelError(f"model call refused: {exc.message}", exc.code) from None
        except UpstreamError as exc:
            raise ModelError(f"model {self.name!r} failed: {exc.message}", exc.code) from None
        except KeyError:
            raise ModelError(f"model {self.name!r} does not exist",
                             "model_not_found") from None
        turn = TurnBuilder()
        try:
            _fold(turn, first)
            async for chunk in rest:
                _fold(turn, chunk)
        finally:
            await rest.aclose()
        return turn.turn()

    def close(self) -> None:
        """Nothing to release: the gateway and its connections belong to the server."""


def run_models(request: Request, gateway: Gateway,
               model: str) -> Callable[[str], GatewayChatModel]:
    """Model clients for the runs a request starts (agent runs, background turns), reaching
    `model` as the caller: its key (its limits and budget), its priority class and address.
    The key is looked up now: one revoked since the gate let the request in is a 401, not a
    keyless run. Returns run id -> that run's client; the id names its model requests in the
    logs. Called on the server's event loop, which the clients run their replies on."""
    key = None
    principal = principal_of(request)
    if principal.key_id is not None:
        key = next((k for k in gateway.keys.all()
                    if k.id == principal.key_id and not k.revoked), None)
        if key is None:
            raise APIError(401, "the API key was revoked", code="invalid_api_key")
    priority = key.priority if key else gateway.settings.gateway.default_priority
    ip = request.client.host if request.client else "unknown"
    loop = asyncio.get_running_loop()

    def for_run(run_id: str) -> GatewayChatModel:
        return GatewayChatModel(gateway, model, Client(priority=priority, ip=ip, key=key,
                                                       request_id=f"run-{run_id}"), loop)

    return for_run


def _fold(turn: TurnBuilder, chunk: dict[str, Any]) -> None:
    """Add a chunk; the gateway ends a stream that broke after its first token with an
    in-band error chunk, which ends the reply as an error."""
    error = chunk_error(chunk)
    if error is not None:
        raise ModelError(f"model stream {error.message}", error.code)
    turn.add(chunk)
