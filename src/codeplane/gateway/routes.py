"""HTTP face of the gateway: `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`,
`/v1/models` and `/v1/gateway/status`, mounted by `codeplane.server.app`; and `metered`, with
which routes that run a model themselves (Tab, apply) apply the same key limits.

Handlers stay thin: the auth gate (`server/auth.py`) has already resolved the caller; they
classify (priority, client address, request id), admit, then hand the body to the Gateway
and relay JSON or server-sent events.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ConfigDict, Field

from codeplane.config.gateway import PRIORITIES
from codeplane.core.errors import APIError, not_found
from codeplane.core.principal import principal_of
from codeplane.core.schemas import ChatCompletionRequest, CompletionRequest, WireModel
from codeplane.gateway.admission import Shed
from codeplane.gateway.providers.base import Call, UpstreamError, json_bytes
from codeplane.gateway.router import Client, Gateway
from codeplane.models.embed import LOCAL_MODELS

log = logging.getLogger("codeplane.gateway")
PRIORITY_HEADER = "x-codeplane-priority"


class EmbeddingRequest(WireModel):
    model_config = ConfigDict(extra="ignore")
    model: str = Field(max_length=256)
    input: str | list[str] | list[int] | list[list[int]] = Field(max_length=2048)


router = APIRouter()


def gateway_of(request: Request) -> Gateway:
    """The app's one Gateway, built by the composition root (`server/services.py`)."""
    return request.app.state.services.gateway


def require_model(gateway: Gateway, name: str) -> None:
    """A 404 naming the models there are, unless `name` is one the gateway serves (a
    configured model, a local one, or its alias)."""
    if gateway.group(name) is None:
        raise not_found(f"model {name!r} does not exist; available: "
                        f"{', '.join(sorted(gateway.groups))}")


@router.get("/v1/models")
def list_models(request: Request) -> dict:
    gateway = gateway_of(request)
    specs = request.app.state.engine.registry.all()
    local = {s.name: list(s.capabilities) for s in specs}
    for name in local:  # registered since start-up (`codeplane model add`): served now
        gateway.group(name)
    local.update((name, ["embeddings"]) for name in LOCAL_MODELS)
    # the agent setup a trained model was registered with (agent/setup.py): the CLI's agent
    # runs it in that setup
    setups = {s.name: {"agent_setup": s.agent} for s in specs if s.agent is not None}
    data = [{"id": name, "object": "model", "created": 0, "owned_by": "codeplane",
             "capabilities": local.get(name) or list(group.deployments[0].cfg.capabilities),
             "deployments": len(group.deployments), **setups.get(name, {})}
            for name, group in gateway.groups.items()
            if name in local or group.deployments[0].id != f"local:{name}"]  # not removed
    return {"object": "list", "data": data}


@router.get("/v1/gateway/status")
def status(request: Request) -> dict:
    return gateway_of(request).status()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    return await _serve(request, "chat", body, body.stream,
                        bool(body.stream_options and body.stream_options.include_usage))


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    return await _serve(request, "completions", body, body.stream,
                        bool(body.stream_options and body.stream_options.include_usage))


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request):
    return await _serve(request, "embeddings", body, False, False)


async def _serve(request: Request, kind: str, body: Any, stream: bool, include_usage: bool):
    gateway = gateway_of(request)
    client = _client(request, gateway)
    headers = {"x-request-id": client.request_id}
    require_model(gateway, body.model)
    try:
        gateway.admit(client)
        call = Call(kind, await request.json(), body, stream, include_usage, client.request_id)
        if not stream:
            result = await _until_disconnect(request, gateway.complete(call, client))
            return Response(json_bytes(result), media_type="application/json",
                            headers=headers)
        first, rest = await gateway.stream(call, client)
    except Shed as exc:
        raise _refused(exc, headers) from None
    except UpstreamError as exc:
        retry = {"retry-after": str(int(exc.retry_after))} if exc.retry_after else {}
        raise APIError(exc.status, exc.message, type=exc.type, code=exc.code,
                       param=exc.param, headers={**headers, **retry}) from None
    return StreamingResponse(_sse(first, rest), media_type="text/event-stream",
                             headers=headers)


@contextmanager
def metered(request: Request, tokens: int) -> Iterator[Meter]:
    """Model work a route runs itself (Tab, apply), under the caller's key limits as on
    `/v1/chat/completions`: admitted by the key's and the address's requests per minute,
    `tokens` (an upper-bound guess) held against tokens per minute and the budget, then
    settled to what the block sets `meter.used` to (nothing, if it sets nothing). A refusal
    is the same 429 (with Retry-After) or 403 `budget_exhausted`."""
    gateway = gateway_of(request)
    client = _client(request, gateway)
    try:
        gateway.admit(client)
        held = gateway.hold(client, tokens)
    except Shed as exc:
        raise _refused(exc, {"x-request-id": client.request_id}) from None
    meter = Meter()
    try:
        yield meter
    finally:
        gateway.settle(client, held, meter.used)


@dataclass
class Meter:
    used: int = 0  # tokens the metered work used: prompt (cached or not) + completion


def _refused(exc: Shed, headers: dict[str, str]) -> APIError:
    return APIError(exc.status, exc.message, code=exc.code,
                    type="rate_limit_error" if exc.status == 429 else "insufficient_quota",
                    headers={**headers, **({"retry-after": str(exc.retry_after)}
                                           if exc.status == 429 else {})})


async def _sse(first: dict, rest: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """OpenAI server-sent events; an error after the first chunk is sent in-band, without
    `[DONE]`, so a client can never mistake a broken stream for a finished one. (orjson:
    a chunk is encoded per token, so the encoder is on the hot path.)"""
    try:
        yield _event(first)
        async for chunk in rest:
            yield _event(chunk)
            if "error" in chunk:
                return
        yield b"data: [DONE]\n\n"
    finally:
        await rest.aclose()  # client gone: stop the upstream (local: between two tokens)


def _event(chunk: dict) -> bytes:
    return b"data: " + json_bytes(chunk) + b"\n\n"


async def _until_disconnect(request: Request, coro):
    """Run `coro`; cancel it if the client hangs up (which also stops a local generation)."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
    finally:
        if not task.done():
            task.cancel()


def _client(request: Request, gateway: Gateway) -> Client:
    """Priority class, address and request id for the caller the auth gate resolved; its key
    (if any) carries the priority cap and the rpm/tpm/budget limits."""
    headers = request.headers
    request_id = headers.get("x-request-id") or uuid.uuid4().hex[:16]
    principal = principal_of(request)
    key = gateway.keys.by_id(principal.key_id) if principal.key_id else None
    default = key.priority if key else gateway.settings.gateway.default_priority
    wanted = headers.get(PRIORITY_HEADER, default)
    if wanted not in PRIORITIES:
        raise APIError(400, f"{PRIORITY_HEADER} must be one of {', '.join(PRIORITIES)}",
                       param=PRIORITY_HEADER)
    if key and PRIORITIES.index(wanted) < PRIORITIES.index(key.priority):
        wanted = key.priority  # a key may lower its class, never raise it
    ip = request.client.host if request.client else "unknown"
    return Client(priority=wanted, ip=ip, key=key, request_id=request_id)
