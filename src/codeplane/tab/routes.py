"""`POST /v1/tab`: one Tab suggestion; `POST /v1/tab/prefill`: a document's prompt evaluated
before its first suggestion. A thin layer over `TabService`.

Client guidance (also in docs/tab.md): call on every keystroke with the same `cursor_id`; do
not wait for the previous answer (the server cancels it) and debounce only the model path -
cache and typed-ahead answers come back in a few milliseconds, so checking them first is free.
Free for the key too: only a model call counts against its requests per minute, tokens per
minute and budget (`gateway.routes.metered`), charged with the tokens it used.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from fastapi import APIRouter, Request

from codeplane.core.errors import APIError, not_found, unavailable
from codeplane.core.principal import principal_of
from codeplane.gateway.router import BYTES_PER_TOKEN
from codeplane.gateway.routes import metered
from codeplane.models.engine import ContextOverflow, Engine, EngineCrashed, Unsupported
from codeplane.models.pull import WeightsError, ensure_weights
from codeplane.models.registry import UnknownModel
from codeplane.tab.backend import UpstreamError
from codeplane.tab.feedback import Feedback
from codeplane.tab.nextedit import NextRequest, next_edit, prompt_parts
from codeplane.tab.service import PrefillRequest, TabRequest, TabResult, TabService

router = APIRouter()


def service(request: Request) -> TabService:
    """The app's one TabService, built by the composition root (`server/services.py`)."""
    return request.app.state.services.tab


@router.post("/v1/tab")
async def tab(body: TabRequest, request: Request) -> dict:
    svc = service(request)
    if not svc.remote(body.model):  # an upstream's model is checked by the upstream
        _require_fim(svc.engine, body.model or svc.settings.model)
    tenant = principal_of(request).tenant
    with _model_errors():
        result = await _complete(svc, body, tenant, request)
    if result.shown and result.source == "model":  # cache/typed-ahead: shown already
        # the decision's signals ride along (and on to the accepted/rejected event), so the
        # show/hide model can be refitted from what users took (tab/decision.py)
        fields = {"suggestion_id": result.id, "model": body.model or svc.settings.model,
                  "latency_ms": result.latency_ms, "chars": len(result.text),
                  "confidence": result.confidence, "source": result.source,
                  "language": body.language, **(result.signals or {})}
        request.app.state.services.events.record("tab_shown", tenant, fields)
        svc.shown.remember(tenant, result.id, fields)
    return result.to_json()


async def _complete(svc: TabService, body: TabRequest, tenant: str,
                    request: Request) -> TabResult:
    """The fast paths first (cache, typed-ahead, mid-line skip: no model, no charge), then,
    if the model is needed, the model call under the key's limits."""
    if body.fast_only:
        return await svc.complete(body, tenant)
    fast = await svc.complete(body.model_copy(update={"fast_only": True}), tenant)
    if fast.source != "miss":
        return fast
    with metered(request, _estimate(svc, body)) as meter:
        result = await svc.complete(body, tenant)
        meter.used = result.prompt_tokens + result.completion_tokens + result.prefill_tokens
    return result


@router.post("/v1/tab/prefill")
async def tab_prefill(body: PrefillRequest, request: Request) -> dict:
    """Evaluate a document's prompt before its first completion (the editor opened the file
    or paused typing), into a KV slot of this tenant and document; metered like a model
    call, charged with the tokens it evaluated."""
    svc = service(request)
    tab = body.as_tab()
    if not svc.remote(body.model):
        _require_fim(svc.engine, body.model or svc.settings.model)
    start = time.perf_counter()
    with _model_errors(), metered(request, _estimate(svc, tab)) as meter:
        got = await svc.prefill(body, principal_of(request).tenant)
        meter.used = got.evaluated_tokens - got.cached_tokens
    return {**got.to_json(), "latency_ms": round((time.perf_counter() - start) * 1000, 2)}


def _estimate(svc: TabService, body: TabRequest) -> int:
    """At most the prompt the service builds (capped at `max_prompt_tokens`) plus the
    longest suggestion it may decode."""
    text = len(body.prefix) + len(body.suffix) + sum(len(s.text) for s in body.context)
    prompt = min(1 + text // BYTES_PER_TOKEN, svc.settings.max_prompt_tokens)
    return prompt + (body.max_tokens or svc.settings.max_tokens_multiline)


@router.post("/v1/tab/next")
async def tab_next(body: NextRequest, request: Request) -> dict:
    """Next-edit Tab (`tab/nextedit.py`): zero or one rewrite of lines near the cursor, and
    maybe a jump, when its show/hide rule says so. On the embedded engine only (the job
    decodes speculatively in the model's worker); charged like a Tab model call. A shown
    suggestion is an event in the lake; `POST /v1/tab/feedback` takes its outcome."""
    svc = service(request)
    model = _next_model(svc, body)
    tenant = principal_of(request).tenant
    with _model_errors(), metered(request, _next_estimate(body)) as meter:
        result = await next_edit(svc, body, tenant)
        meter.used = result.prompt_tokens + result.completion_tokens
    if result.id:  # shown: the rule's signals ride along to the accepted/rejected event
        fields = {"suggestion_id": result.id, "model": model,
                  "latency_ms": result.latency_ms, "probability": result.probability,
                  "source": result.source, "format": body.format,
                  "jump": result.jump is not None, **(result.signals or {})}
        request.app.state.services.events.record("tab_next_shown", tenant, fields)
        svc.shown.remember(tenant, result.id, fields, kind="tab_next")
    return result.to_json()


@router.post("/v1/tab/next/prefill")
async def tab_next_prefill(body: NextRequest, request: Request) -> dict:
    """Evaluate the prompt of the next-edit request `body` before it is asked for (the
    editor paused after an edit), into this tenant's next-edit slot of the document, so
    that request pays for its decode only; metered like a model call, charged with the
    tokens it evaluated. It yields to completions as `/v1/tab/prefill` does."""
    svc = service(request)
    model = _next_model(svc, body)
    start = time.perf_counter()
    with _model_errors(), metered(request, _next_estimate(body)) as meter:
        got = await svc.prefill_next(body.for_model(), principal_of(request).tenant)
        meter.used = got.evaluated_tokens - got.cached_tokens
    return {**got.to_json(), "model": model,
            "latency_ms": round((time.perf_counter() - start) * 1000, 2)}


def _next_model(svc: TabService, body: NextRequest) -> str:
    """The model a next-edit request runs on, checked: embedded, known, with FIM tokens."""
    model = svc.next_model(body.model)
    if svc.remote(model):
        raise APIError(400, "next edit runs on the embedded engine, not on [tab] upstream",
                       param="model")
    _require_fim(svc.engine, model)
    return model


def _next_estimate(body: NextRequest) -> int:
    """At most the prompt the job builds plus the longest answer it may decode."""
    parts, _, _ = prompt_parts(body, body.format)
    return 1 + sum(len(text) for text, _ in parts) // BYTES_PER_TOKEN + (body.max_tokens or 512)


@contextmanager
def _model_errors() -> Iterator[None]:
    """A model call's failures as the API's errors: the request's fault 400, the model's 503."""
    try:
        yield
    except ContextOverflow as exc:
        raise APIError(400, str(exc), code="context_length_exceeded") from None
    except Unsupported as exc:
        raise APIError(400, str(exc), param="model") from None
    except UpstreamError as exc:
        raise unavailable(str(exc), code="upstream_unavailable") from None
    except EngineCrashed as exc:
        raise unavailable(str(exc), code="engine_crashed") from None


@router.post("/v1/tab/feedback")
def tab_feedback(body: Feedback, request: Request) -> dict:
    """The editor's verdict on a shown suggestion, recorded in the event lake (the accept
    rate of `codeplane events stats`); only the tenant it was shown to may report, once."""
    tenant = principal_of(request).tenant
    shown = service(request).shown.take(tenant, body.id)
    if shown is None:
        raise not_found(f"no shown suggestion {body.id!r} awaits feedback (unknown, expired "
                        "or already reported)")
    kind, fields = shown
    request.app.state.services.events.record(f"{kind}_{body.outcome}", tenant,
                                             {**fields, "after_ms": body.shown_ms})
    return {"id": body.id, "outcome": body.outcome, "recorded": True}


@router.get("/v1/tab/stats")
def tab_stats(request: Request) -> dict:
    """Counters since start: model calls avoided, prompt tokens reused (no code, no paths),
    and the prefills queued or running now."""
    svc = service(request)
    return {**svc.stats, "prefills_pending": svc.pending_prefills()}


def _require_fim(engine: Engine, name: str) -> None:
    try:
        spec = engine.spec(name)
    except UnknownModel:
        raise not_found(f"model {name!r} does not exist") from None
    if "fim" not in spec.capabilities:
        raise APIError(400, f"model {name!r} does not support fim", param="model")
    if spec.name not in engine.loaded():
        try:
            ensure_weights(spec, engine.settings)
        except WeightsError as exc:
            raise unavailable(str(exc)) from None
