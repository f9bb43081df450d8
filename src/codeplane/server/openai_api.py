"""`/v1/chat/completions`, `/v1/completions`, `/v1/models` over the local engine.

Handlers stay thin: validate, resolve the model, run the work on the model's thread, and
either return JSON or relay chunks as server-sent events. A client that goes away cancels its
generation between two tokens (streaming: when Starlette cancels the response; otherwise by
polling the connection while the work runs).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from codeplane.models import local_openai
from codeplane.models.engine import ContextOverflow, Engine, Generation, LocalModel, Unsupported
from codeplane.models.pull import WeightsError, ensure_weights
from codeplane.models.registry import UnknownModel
from codeplane.models.schemas import ChatCompletionRequest, CompletionRequest
from codeplane.server.errors import APIError, not_found, unavailable
from codeplane.server.metrics import Metrics

router = APIRouter()
Work = Callable[[LocalModel, threading.Event, Callable[[dict], None] | None], Any]


@router.get("/v1/models")
def list_models(request: Request) -> dict:
    engine: Engine = request.app.state.engine
    data = [{"id": s.name, "object": "model", "created": 0, "owned_by": "codeplane",
             "capabilities": list(s.capabilities)} for s in engine.registry.all()]
    return {"object": "list", "data": data}


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    _require(request, body.model, "chat")

    def work(model: LocalModel, cancel: threading.Event, emit) -> tuple[dict, Generation]:
        return local_openai.chat(model, body, cancel, emit)

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await _respond(request, body.model, work, body.stream, include_usage)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    _require(request, body.model, "fim" if body.suffix is not None else "completion")
    prompts = body.prompts()
    if body.stream and len(prompts) != 1:
        raise APIError(400, "streaming supports exactly one prompt", param="prompt")

    def work(model: LocalModel, cancel: threading.Event, emit) -> tuple[dict, Generation]:
        bodies = [local_openai.complete(model, body, p, i, cancel, emit)
                  for i, p in enumerate(prompts)]
        first, gen = bodies[0]
        if len(bodies) > 1:
            first = {**first, "choices": [b["choices"][0] for b, _ in bodies],
                     "usage": _sum_usage([b["usage"] for b, _ in bodies])}
        return first, gen

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await _respond(request, body.model, work, body.stream, include_usage)


def _require(request: Request, name: str, capability: str) -> None:
    """Fail fast, before queueing: unknown model 404, missing weights 503, no capability 400."""
    engine: Engine = request.app.state.engine
    try:
        spec = engine.spec(name)
    except UnknownModel:
        known = ", ".join(s.name for s in engine.registry.all())
        raise not_found(f"model {name!r} does not exist; available: {known}") from None
    if capability not in spec.capabilities:
        raise APIError(400, f"model {name!r} does not support {capability}", param="model")
    if spec.name not in engine.loaded():
        try:
            ensure_weights(spec, engine.settings)
        except WeightsError as exc:
            raise unavailable(str(exc)) from None


async def _respond(request: Request, name: str, work: Work, stream: bool, include_usage: bool):
    engine: Engine = request.app.state.engine
    metrics: Metrics = request.app.state.metrics
    cancel = threading.Event()
    if not stream:
        body, gen, waited = await _until_disconnect(
            request, cancel, _run(engine, name, work, cancel, None))
        metrics.record_generation(name, gen.prompt_tokens, gen.completion_tokens,
                                  gen.cached_tokens, waited)
        return body
    # Start the work now so errors found before the first token become proper HTTP errors.
    queue: asyncio.Queue[dict | None] = asyncio.Queue()
    loop = asyncio.get_running_loop()

    def emit(chunk: dict) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, chunk)

    task = asyncio.ensure_future(_run(engine, name, work, cancel, emit))
    task.add_done_callback(lambda _: queue.put_nowait(None))
    first = await queue.get()
    if first is None:
        task.result()  # raises the APIError, if any
    return StreamingResponse(_sse(first, queue, task, cancel, metrics, name, include_usage),
                             media_type="text/event-stream")


async def _sse(first: dict | None, queue: asyncio.Queue, task: asyncio.Future,
               cancel: threading.Event, metrics: Metrics, name: str,
               include_usage: bool) -> AsyncIterator[str]:
    try:
        chunk = first
        while chunk is not None:
            yield f"data: {json.dumps(chunk)}\n\n"
            chunk = await queue.get()
        try:
            body, gen, waited = await task
        except APIError as exc:  # failed mid-stream: say so in-band, never truncate silently
            yield f"data: {json.dumps(exc.body())}\n\n"
            return
        metrics.record_generation(name, gen.prompt_tokens, gen.completion_tokens,
                                  gen.cached_tokens, waited)
        if include_usage:
            usage = {k: v for k, v in body.items() if k in ("id", "created", "model")}
            yield f"data: {json.dumps({**usage, 'object': _chunk_object(body), 'choices': [], 'usage': body['usage']})}\n\n"  # noqa: E501
        yield "data: [DONE]\n\n"
    finally:
        cancel.set()  # client gone or stream done: stop decoding between two tokens


def _chunk_object(body: dict) -> str:
    return "chat.completion.chunk" if body["object"] == "chat.completion" else "text_completion"


async def _run(engine: Engine, name: str, work: Work, cancel: threading.Event,
               emit) -> tuple[dict, Generation, float]:
    try:
        (body, gen), waited = await engine.run(name, lambda m: work(m, cancel, emit))
    except ContextOverflow as exc:
        raise APIError(400, str(exc), code="context_length_exceeded", param="messages") from None
    except Unsupported as exc:
        raise APIError(400, str(exc)) from None
    except WeightsError as exc:
        raise unavailable(str(exc)) from None
    return body, gen, waited


async def _until_disconnect(request: Request, cancel: threading.Event, coro):
    task = asyncio.ensure_future(coro)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            return task.result()
        if await request.is_disconnected():
            cancel.set()


def _sum_usage(usages: list[dict]) -> dict:
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")
    total = {k: sum(u[k] for u in usages) for k in keys}
    total["prompt_tokens_details"] = {
        "cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)}
    return total

