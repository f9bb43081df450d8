"""The local llama.cpp engine as a gateway deployment (`provider = "local"`).

Work runs as an engine job (`openai.chat`, `openai.completions`: `models/local_openai.py`) in
the model's worker process: KV-cache prefix reuse stays automatic, and a cancelled call
(client gone, stream closed) sets the cancel event, which the engine forwards to the worker
so decoding stops between two tokens. Errors keep the server's mapping: context overflow and
unsupported features are the client's (400, not retried); missing or corrupt weights are the
deployment's (503, may fail over), and so is a crashed worker (503 `engine_crashed`; the
engine starts a fresh one for the next request).

Each request resolves its model in the registry (re-read when the file changed), so a model
registered or re-registered while the server runs is served by the next request. The reply's
`usage` names the LoRA adapter version that produced it (`"adapter"`: null for a plain
model): the gateway's usage events, `codeplane agent` and background runs record it from
there, with no caller knowing adapters exist.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from pydantic import Field

from codeplane.config.gateway import DeploymentConfig
from codeplane.core.metrics import Metrics
from codeplane.gateway.providers.base import (
    Call,
    Provider,
    ProviderServices,
    Reply,
    UpstreamError,
    Usage,
)
from codeplane.gateway.providers.embedder import EmbedderProvider
from codeplane.models.embed import LOCAL_MODELS
from codeplane.models.engine import (
    ContextOverflow,
    Engine,
    EngineCrashed,
    Generation,
    Unsupported,
)
from codeplane.models.lora import AdapterError
from codeplane.models.pull import WeightsError, ensure_weights
from codeplane.models.registry import ModelSpec, UnknownModel

CAPABILITY = {"chat": "chat", "completions": "completion", "embeddings": "embeddings"}
JOBS = {"chat": "openai.chat", "completions": "openai.completions"}


class LocalDeployment(DeploymentConfig):
    """`provider = "local"`: a model of this machine, one request at a time unless
    `max_parallel` says (one llama.cpp context, or one ONNX run that uses every core)."""

    provider: Literal["local"] = "local"
    max_parallel: int | None = Field(1, ge=1)

    def timeouts(self) -> bool:
        """A local generation's length is the client's choice (max_tokens) and the engine is
        on this machine: no deadlines unless the file sets them."""
        return bool({"timeout_s", "first_token_timeout_s"} & self.model_fields_set)


def local_provider(dep: LocalDeployment, services: ProviderServices) -> Provider:
    """The provider of a local model: a local embedding model by its name, else the engine's."""
    if dep.upstream_model in LOCAL_MODELS:
        return EmbedderProvider(dep, services)
    return LocalProvider(services.engine, dep.upstream_model, services.metrics)


class LocalProvider:
    def __init__(self, engine: Engine, model: str, metrics: Metrics) -> None:
        self.engine, self.model, self.metrics = engine, model, metrics

    async def request(self, call: Call) -> Reply:
        spec = self._require(call)
        cancel = threading.Event()
        task = asyncio.ensure_future(self._run(spec, call, cancel, None))
        task.add_done_callback(self._record_done)
        try:
            body, _, _ = await asyncio.shield(task)  # a client that leaves ends the wait only
        except asyncio.CancelledError:
            cancel.set()  # client went away: free the model between two tokens
            raise
        body["model"] = call.raw.get("model", body["model"])
        return Reply(body, Usage.of(body["usage"]))

    async def stream(self, call: Call) -> AsyncIterator[dict[str, Any] | Usage]:
        spec = self._require(call)
        cancel = threading.Event()
        queue: asyncio.Queue[dict | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def emit(chunk: dict) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, chunk)

        task = asyncio.ensure_future(self._run(spec, call, cancel, emit))
        task.add_done_callback(lambda _: queue.put_nowait(None))
        task.add_done_callback(self._record_done)
        try:
            while (chunk := await queue.get()) is not None:
                yield chunk
            body, _, _ = await task
            yield Usage.of(body["usage"])
            if call.include_usage:
                yield {**{k: body[k] for k in ("id", "created", "model")},
                       "object": f"{body['object']}.chunk" if body["object"] ==
                       "chat.completion" else "text_completion",
                       "choices": [], "usage": body["usage"]}
        finally:
            # Stream closed or done: the job stops between two tokens and the task ends
            # with what was generated, which `_record_done` counts (not cancelled: the
            # tokens a client abandoned were spent all the same).
            cancel.set()

    def _require(self, call: Call) -> ModelSpec:
        """The model's spec as registered now. Fail before queueing: no capability is 400,
        missing weights 503, a model removed while the server runs 404."""
        try:
            spec = self.engine.spec(self.model)
        except UnknownModel as exc:
            raise UpstreamError(404, str(exc), retryable=False, code="model_not_found",
                                param="model") from None
        capability = CAPABILITY[call.kind]
        if call.kind == "completions" and call.parsed.suffix is not None:
            capability = "fim"
        if capability not in spec.capabilities:
            raise UpstreamError(400, f"model {call.raw.get('model')!r} does not support "
                                     f"{capability}", retryable=False, param="model")
        if call.kind == "completions" and call.stream and len(call.parsed.prompts()) != 1:
            raise UpstreamError(400, "streaming supports exactly one prompt", retryable=False,
                                param="prompt")
        weights = self.engine.weights_of(spec)
        if weights.name not in self.engine.loaded():
            try:
                ensure_weights(weights, self.engine.settings)
            except WeightsError as exc:
                raise UpstreamError(503, str(exc), retryable=True,
                                    code="model_unavailable") from None
        return spec

    async def _run(self, spec: ModelSpec, call: Call, cancel: threading.Event,
                   emit: Callable[[dict], None] | None) -> tuple[dict, Generation, float]:
        try:
            (body, gen), waited = await self.engine.run(
                spec, JOBS[call.kind], call.parsed, emit is not None, on_event=emit,
                cancel=cancel)
        except ContextOverflow as exc:
            raise UpstreamError(400, str(exc), retryable=False, code="context_length_exceeded",
                                param="messages") from None
        except Unsupported as exc:
            raise UpstreamError(400, str(exc), retryable=False) from None
        except (WeightsError, AdapterError) as exc:
            raise UpstreamError(503, str(exc), retryable=True,
                                code="model_unavailable") from None
        except EngineCrashed as exc:
            raise UpstreamError(503, str(exc), retryable=True, code="engine_crashed",
                                retry_after=exc.retry_after) from None
        body["usage"]["adapter"] = spec.adapter.version if spec.adapter else None
        return body, gen, waited

    def _record_done(self, task: asyncio.Future) -> None:
        if not task.cancelled() and task.exception() is None:
            _, gen, waited = task.result()
            self._record(gen, waited)

    def _record(self, gen: Generation, waited: float) -> None:
        self.metrics.record_generation(self.model, gen.prompt_tokens, gen.completion_tokens,
                                       gen.cached_tokens, waited)

    async def aclose(self) -> None:
        """The engine belongs to the app; nothing to release here."""
