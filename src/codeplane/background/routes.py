"""`/v1/background-agents`: launch a run that outlives the request, list and show runs, watch
their events (SSE, resumable with `Last-Event-ID`), send a follow-up, cancel, get the patch.

Same policy as `/v1/agent/runs` (its checks are reused, not restated): the repo lies under the
caller's workspace roots (`sandbox/roots.py`), commands always run sandboxed without network, models are reached
in-process through the gateway with the caller's key, runs are capped per tenant, and another
tenant's run is missing (404).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Header, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from codeplane.agent.requests import RunSpec, Text, run_not_found, too_many_runs
from codeplane.agent.runs import RunLimit
from codeplane.background.service import BackgroundService
from codeplane.core.errors import APIError
from codeplane.core.principal import principal_of
from codeplane.core.sse import Events, follow, resume_after
from codeplane.gateway.chat import run_models
from codeplane.gateway.routes import gateway_of, require_model
from codeplane.sandbox.fleet import FleetError
from codeplane.sandbox.roots import Roots

KEEPALIVE_S = 5.0
ENDS = ("end", "interrupted")

router = APIRouter()


def service_of(request: Request) -> BackgroundService:
    return request.app.state.services.background


class LaunchRequest(RunSpec):
    repo: Text = Field(min_length=1, max_length=4096,
                       description="absolute path of a git repository (or bundle) under the "
                                   "caller's workspace roots, or a URL under serve.repo_urls")
    ref: Text = Field("HEAD", min_length=1, max_length=256, pattern=r"^[^-\s][^\s]*$",
                      description="branch, tag or commit to start from (not an option)")


class MessageRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    content: Text = Field(min_length=1, max_length=100_000)


@router.post("/v1/background-agents", status_code=202)
async def launch(body: LaunchRequest, request: Request) -> dict[str, Any]:
    """Acquire a sandbox of the repo and start the agent; returns the run at once."""
    principal = principal_of(request)
    repo = Roots.of(request.app.state.settings.serve, principal.tenant).repo(body.repo)
    gateway = gateway_of(request)
    require_model(gateway, body.model)
    models = run_models(request, gateway, body.model)
    setup = body.agent_setup(request.app.state.engine.registry)
    try:
        return await asyncio.to_thread(service_of(request).launch, principal.tenant, repo,
                                       body.ref, body.task, body.model, models, setup)
    except RunLimit as exc:
        raise too_many_runs(exc) from None
    except FleetError as exc:  # a quota, an unknown ref, a repo git cannot clone
        raise exc.to_api() from None


@router.get("/v1/background-agents")
def list_runs(request: Request) -> dict[str, Any]:
    return {"data": service_of(request).store.list(principal_of(request).tenant)}


def get_run(request: Request, run_id: str) -> dict[str, Any]:
    """The caller's run, or 404 (another tenant's run does not exist)."""
    run = service_of(request).store.get(principal_of(request).tenant, run_id)
    if run is None:
        raise run_not_found("background agent", run_id)
    return run


@router.get("/v1/background-agents/{run_id}")
def show(run_id: str, request: Request) -> dict[str, Any]:
    return get_run(request, run_id)


@router.get("/v1/background-agents/{run_id}/patch")
def patch(run_id: str, request: Request) -> PlainTextResponse:
    """The run's result as `git format-patch` text (empty: no change, or not finished);
    413 when the result was larger than `[background] patch_bytes` (its branch bundle holds
    it)."""
    run = get_run(request, run_id)
    text = service_of(request).store.patch(run_id)
    if text is None and run["commit_sha"]:
        raise APIError(413, f"the result of background agent {run_id!r} is larger than this "
                            "server stores as a patch ([background] patch_bytes); its branch "
                            f"{run['branch']} is kept whole as a git bundle on the server",
                       code="patch_too_large")
    text = text or ""
    return PlainTextResponse(text, media_type="text/x-diff", headers={
        "content-disposition": f'attachment; filename="codeplane-{run_id}.patch"'})


@router.post("/v1/background-agents/{run_id}/cancel")
def cancel(run_id: str, request: Request) -> dict[str, Any]:
    get_run(request, run_id)
    stopped = service_of(request).cancel(principal_of(request).tenant, run_id)
    return {"id": run_id, "cancel_requested": stopped}


@router.delete("/v1/background-agents/{run_id}")
def delete(run_id: str, request: Request) -> dict[str, Any]:
    """Erase a finished run and everything the server kept for it (checkout included)."""
    get_run(request, run_id)
    if not service_of(request).delete(principal_of(request).tenant, run_id):
        raise APIError(409, f"background agent {run_id!r} is running; cancel it first",
                       code="run_running")
    return {"id": run_id, "deleted": True}


@router.post("/v1/background-agents/{run_id}/messages", status_code=202)
def message(run_id: str, body: MessageRequest, request: Request) -> dict[str, Any]:
    """A follow-up instruction: run after the current turn, or as a continuation of a run
    that has finished."""
    get_run(request, run_id)
    try:
        sent = service_of(request).message(principal_of(request).tenant, run_id, body.content)
    except RunLimit as exc:
        raise too_many_runs(exc) from None
    except FleetError as exc:
        raise exc.to_api() from None
    if sent is None:
        raise APIError(409, f"background agent {run_id!r} was started by an earlier server "
                            "process and cannot be continued; launch a new run",
                       code="run_not_continuable")
    return {"id": run_id, **sent}


@router.get("/v1/background-agents/{run_id}/events")
async def events(run_id: str, request: Request,
                 last_event_id: str | None = Header(None)) -> StreamingResponse:
    """The run's events as SSE, each with its sequence number as `id:`; a client that
    reconnects with `Last-Event-ID: N` gets exactly the events after N."""
    get_run(request, run_id)
    after = resume_after(last_event_id)
    return StreamingResponse(_sse(service_of(request), principal_of(request).tenant, run_id,
                                  after), media_type="text/event-stream",
                             headers={"cache-control": "no-store"})


async def _sse(service: BackgroundService, tenant: str, run_id: str,
               after: int) -> AsyncIterator[str]:
    """Events after `after`, then new ones as they are stored, until the run has ended.
    The store is the one source (a restart or a second watcher sees the same ids); the
    service wakes this watcher when the run records an event."""
    newest, last = await asyncio.to_thread(service.store.last, run_id)
    if after < newest:
        last = ""  # there is more to send; a resumed stream at the end may end at once

    async def read(after: int) -> tuple[Events, bool]:
        nonlocal last
        events = await asyncio.to_thread(service.store.events, run_id, after)
        last = events[-1][1]["type"] if events else last
        if last not in ENDS:
            return events, False
        # the status is final before the end event is stored
        run = await asyncio.to_thread(service.store.get, tenant, run_id)
        return events, run is None or run["status"] not in ("queued", "running")

    watcher = service.watch(run_id)
    try:
        async for line in follow(read, watcher, min(after, newest), KEEPALIVE_S, KEEPALIVE_S):
            yield line
    finally:
        service.unwatch(run_id, watcher)
