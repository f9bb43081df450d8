"""`POST /v1/apply`: merge an edit into a file's text sent by the client (nothing is stored).

A merge that needs no model is free; one that uses the model (`method` "model", or "auto"
once the deterministic merge declined) counts against the key's requests per minute, tokens
per minute and budget like a chat call (`gateway.routes.metered`), charged with the tokens
the model used."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from pydantic import ConfigDict, Field

from codeplane.apply.service import apply_edit, estimated_tokens
from codeplane.core.errors import not_found, unavailable
from codeplane.core.principal import principal_of
from codeplane.core.schemas import WireModel
from codeplane.gateway.routes import metered
from codeplane.models.engine import EngineCrashed
from codeplane.models.registry import UnknownModel

router = APIRouter()


class ApplyRequest(WireModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(..., max_length=4096,
                      description="File path; its suffix picks the syntax check")
    original: str = Field(max_length=4_000_000)
    edit: str = Field(max_length=1_000_000)
    model: str = Field("code-small", max_length=256)
    method: Literal["auto", "deterministic", "model"] = "auto"


@router.post("/v1/apply")
def apply(body: ApplyRequest, request: Request) -> dict:
    """Sync route: FastAPI runs it in its thread pool; model work waits on the model's own
    worker thread like every other request for that model."""
    engine = request.app.state.engine
    result = None
    if body.method != "model":  # the free path first: no model, no key limits
        result = apply_edit(body.original, body.edit, body.path, method="deterministic")
    try:
        if result is None or (not result.ok and body.method == "auto"):
            engine.spec(body.model)  # an unknown model is a 404 before anything is counted
            with metered(request, estimated_tokens(body.original, body.edit)) as meter:
                result = apply_edit(body.original, body.edit, body.path, engine, body.model,
                                    method=body.method)
                meter.used = result.model_tokens()
    except UnknownModel as exc:
        raise not_found(str(exc)) from exc
    except EngineCrashed as exc:
        raise unavailable(str(exc), code="engine_crashed") from None
    request.app.state.services.events.record("apply_outcome", principal_of(request).tenant, {
        "model": body.model, "ok": result.ok, "method": result.method, "format": result.format,
        "seconds": result.seconds, "output_tokens": result.output_tokens})
    return result.to_json()
