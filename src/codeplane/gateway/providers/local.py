"""The local llama.cpp engine as a gateway deployment (`provider = "local"`).

Work runs as an engine job (`openai.chat`, `openai.completions`: `models/local_openai.py`) in
the model's worker process: KV-cache prefix reuse stays automatic, and a cancelled call
(client gone, stream closed) sets the cancel event, which the engine forwards to the worker
so decoding stops between two tokens. Errors keep the server's mapping: context overflow and
unsupported features are the client's (400, not retried); missing or corrupt weights are the
deployment's (503, may fail over), and so is a crashed worker (503 `engine_crashed`; the
engine starts a fresh one for the next request).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from codeplane.core.metrics import Metrics
from codeplane.gateway.providers.base import Call, UpstreamError
from codeplane.models.engine import (
    ContextOverflow,
    Engine,
    EngineCrashed,
    Generation,
    Unsupported,
)
from codeplane.models.pull import WeightsError, ensure_weights

CAPABILITY = {"chat": "chat", "completions": "completion", "embeddings": "embeddings"}
JOBS = {"chat": "openai.chat", "completions": "openai.completions"}


class LocalProvider:
    def __init__(self, engine: Engine, model: str, metrics: Metrics) -> None:
        self.engine, self.model, self.metrics = engine, model, metrics

    async def request(self, call: Call) -> dict[str, Any]:
        self._require(call)
        cancel = threading.Event()
        try:
            body, gen, waited = await self._run(call, cancel, None)
        except asyncio.CancelledError:
            cancel.set()  # client went away: free the model between two tokens
            raise
        self._record(gen, waited)
        body["model"] = call.raw.get("model", body["model"])
        return body

    async def stream(self, call: Call) -> AsyncIterator[dict[str, Any]]:
        self._require(call)
        cancel = threading.Event()
        queue: asyncio.Queue[dict | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def emit(chunk: dict) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, chunk)

        task = asyncio.ensure_future(self._run(call, cancel, emit))
        task.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while (chunk := await queue.get()) is not None:
                yield chunk
            body, gen, waited = await task
            self._record(gen, waited)
            call.extra["usage"] = body["usage"]
            if call.include_usage:
                yield {**{k: body[k] for k in ("id", "created", "model")},
                       "object": f"{body['object']}.chunk" if body["object"] ==
                       "chat.completion" else "text_completion",
                       "choices": [], "usage": body["usage"]}
        finally:
            cancel.set()  # stream closed or done: stop decoding between two tokens
            if not task.done():
                task.cancel()

    def _require(self, call: Call) -> None:
        """Fail before queueing: no capability is 400, missing weights 503."""
        spec = self.engine.spec(self.model)
        capability = CAPABILITY[call.kind]
        if call.kind == "completions" and call.parsed.suffix is not None:
            capability = "fim"
        if capability not in spec.capabilities:
            raise UpstreamError(400, f"model {call.raw.get('model')!r} does not support "
                                     f"{capability}", retryable=False, param="model")
        if call.kind == "completions" and call.stream and len(call.parsed.prompts()) != 1:
            raise UpstreamError(400, "streaming supports exactly one prompt", retryable=False,
                                param="prompt")
        if spec.name not in self.engine.loaded():
            try:
                ensure_weights(spec, self.engine.settings)
            except WeightsError as exc:
                raise UpstreamError(503, str(exc), retryable=True,
                                    code="model_unavailable") from None

    async def _run(self, call: Call, cancel: threading.Event,
                   emit: Callable[[dict], None] | None) -> tuple[dict, Generation, float]:
        try:
            (body, gen), waited = await self.engine.run(
                self.model, JOBS[call.kind], call.parsed, emit is not None, on_event=emit,
                cancel=cancel)
        except ContextOverflow as exc:
            raise UpstreamError(400, str(exc), retryable=False, code="context_length_exceeded",
                                param="messages") from None
        except Unsupported as exc:
            raise UpstreamError(400, str(exc), retryable=False) from None
        except WeightsError as exc:
            raise UpstreamError(503, str(exc), retryable=True,
                                code="model_unavailable") from None
        except EngineCrashed as exc:
            raise UpstreamError(503, str(exc), retryable=True, code="engine_crashed",
                                retry_after=exc.retry_after) from None
        return body, gen, waited

    def _record(self, gen: Generation, waited: float) -> None:
        self.metrics.record_generation(self.model, gen.prompt_tokens, gen.completion_tokens,
                                       gen.cached_tokens, waited)

    async def aclose(self) -> None:
        """The engine belongs to the app; nothing to release here."""


class EmbedderProvider:
    """The server's local embedding model (`codeplane.models.embed`, shared with private
    search) as the deployment behind `/v1/embeddings`."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    async def request(self, call: Call) -> dict[str, Any]:
        from codeplane.models.embed import EmbedderUnavailable, embedder_from_config

        texts = call.raw.get("input")
        texts = [texts] if isinstance(texts, str) else texts
        if not texts or len(texts) > 2048 or not all(isinstance(t, str) for t in texts):
            raise UpstreamError(400, "input must hold 1-2048 strings", retryable=False,
                                param="input")
        try:
            embedder = await asyncio.to_thread(embedder_from_config, self.config)
            vectors = await asyncio.to_thread(embedder.embed, texts)
        except EmbedderUnavailable as exc:
            raise UpstreamError(503, str(exc), retryable=True,
                                code="model_unavailable") from None
        tokens = sum(len(t.split()) for t in texts)
        return {"object": "list", "model": call.raw["model"],
                "data": [{"object": "embedding", "index": i, "embedding": v.tolist()}
                         for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def stream(self, call: Call) -> AsyncIterator[dict[str, Any]]:
        raise UpstreamError(400, "embeddings do not stream", retryable=False)
        yield {}  # pragma: no cover - makes this an async generator

    async def aclose(self) -> None:
        """The embedder is shared per process; nothing to release."""
