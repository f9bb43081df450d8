"""`POST /v1/agent/runs` (SSE stream of run events), `GET /v1/agent/runs/{id}`,
`GET /v1/agent/runs/{id}/events` (SSE, resumable with `Last-Event-ID`), `POST .../{id}/cancel`.

A run executes the same `Agent` as the CLI on a thread of its own. What it may do is server
policy (`check_policy` in `agent/requests.py`), not the request's wish: it works in a directory
under the caller's workspace roots (`sandbox/roots.py`: `serve.workspace_roots`, or the
tenant's `serve.tenant_roots`), inside the sandbox and without network unless
`serve.allow_unsandboxed` / `serve.allow_network` let a request ask otherwise, and it reaches
models in-process through the gateway with the caller's key and priority (no loopback call,
nothing taken from the Host header). Runs belong to the caller's tenant: another tenant's run
id is reported missing (404). With the server database every replica answers for every run (its
events are stored as they happen).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Header, Request
from fastapi.responses import StreamingResponse

from codeplane.agent.env import Environment, ToolError, local_environment
from codeplane.agent.loop import Agent
from codeplane.agent.requests import RunRequest, check_policy, run_not_found, too_many_runs
from codeplane.agent.runs import ENDS, RunLimit, RunManager, Tail, result_of, status_of
from codeplane.agent.services import for_caller
from codeplane.core.errors import APIError
from codeplane.core.principal import principal_of
from codeplane.core.sse import Events, follow, resume_after
from codeplane.events.adapters import agent_listener
from codeplane.gateway.chat import run_models
from codeplane.gateway.routes import gateway_of, require_model
from codeplane.sandbox import SandboxUnavailable
from codeplane.sandbox.fleet import FleetError

KEEPALIVE = 5.0  # seconds without an event before the stream sends a comment line
POLL_S = 0.5  # how often a watcher reads a run another replica runs (its own wake it at once)


router = APIRouter()


def runs_of(request: Request) -> RunManager:
    """The app's run manager, built by the composition root (`server/services.py`)."""
    return request.app.state.services.runs


@router.post("/v1/agent/runs")
async def create_run(body: RunRequest, request: Request):
    principal = principal_of(request)
    settings = request.app.state.settings
    root = check_policy(body, settings.serve, principal.tenant)
    manager, gateway = runs_of(request), gateway_of(request)
    require_model(gateway, body.model)
    try:
        manager.admit(principal.tenant)  # before the sandbox probe; again at start
    except RunLimit as exc:
        raise too_many_runs(exc) from None
    try:
        env = await asyncio.to_thread(_environment, request, principal.tenant, root,
                                      body)  # the sandbox probe spawns bwrap
    except ToolError as exc:
        raise APIError(400, str(exc), param="path") from None
    except FleetError as exc:  # the pool backend: a quota, or not a git repository
        raise exc.to_api() from None
    except SandboxUnavailable as exc:
        raise APIError(503, f"refusing to run: {exc}", type="server_error",
                       code="sandbox_unavailable") from None
    run_id = uuid.uuid4().hex[:16]
    model = run_models(request, gateway, body.model)(run_id)
    setup = body.agent_setup(request.app.state.engine.registry)
    agent = Agent(model, env, setup.config, hooks=setup.hooks, run_id=run_id,
                  services=for_caller(request.app.state.services.tools, model))
    agent.listeners.append(agent_listener(request.app.state.services.events, principal.tenant,
                                          body.model))
    try:
        run = manager.start(principal.tenant, agent, body.task, model)
    except RunLimit as exc:
        await asyncio.to_thread(env.close)  # a pooled sandbox goes back, not held unused
        raise too_many_runs(exc) from None
    if not body.stream:
        return {"id": run.id, "status": "running"}
    return _stream(request, run.id, 0, cancel_on_hangup=True)


def _environment(request: Request, tenant: str, root: Path, body: RunRequest) -> Environment:
    """The run's environment on the backend it asked for, from this server's backends bound
    to the caller (the pool backend takes its sandboxes from the fleet, for this tenant)."""
    backends = request.app.state.services.backends.for_caller(tenant)
    return local_environment(root, body.sandbox, body.network, backend=body.backend,
                             backends=backends)


def _stream(request: Request, run_id: str, after: int,
            cancel_on_hangup: bool) -> StreamingResponse:
    manager, tenant = runs_of(request), principal_of(request).tenant
    return StreamingResponse(_sse(manager, tenant, run_id, after, cancel_on_hangup),
                             media_type="text/event-stream",
                             headers={"X-Agent-Run-Id": run_id, "cache-control": "no-store"})


async def _sse(manager: RunManager, tenant: str, run_id: str, after: int,
               cancel_on_hangup: bool) -> AsyncIterator[str]:
    """The run's events numbered above `after`, then new ones as they are stored, until the
    run has ended (`run_end`, or `interrupted` when its replica died). When the client that
    started the run hangs up, the run is cancelled (its running command is killed): nobody
    is left to see the result, and the CPU it holds is shared. Runs started with stream=false
    are not tied to a connection, and a watcher (`GET .../events`) that leaves cancels
    nothing."""

    async def read(after: int) -> tuple[Events, bool]:
        tail = await asyncio.to_thread(manager.tail, tenant, run_id, after)
        if tail is None:  # forgotten meanwhile (pruned): nothing more to say
            return [], True
        # the status is read first, so a run no longer running has all its events here
        ended = tail.status != "running" or bool(tail.events) and tail.events[-1][1]["type"] in ENDS
        return tail.events, ended

    wake = manager.watch(run_id)
    ended = False
    try:
        async for line in follow(read, wake, after, POLL_S, KEEPALIVE):
            yield line
        ended = True
        yield "data: [DONE]\n\n"
    finally:
        manager.unwatch(run_id, wake)
        if not ended and cancel_on_hangup:  # not awaited: this task is being cancelled
            asyncio.get_running_loop().run_in_executor(None, manager.cancel, tenant, run_id)


def _tail(request: Request, run_id: str, after: int = 0) -> Tail:
    tail = runs_of(request).tail(principal_of(request).tenant, run_id, after)
    if tail is None:
        raise run_not_found("agent run", run_id)
    return tail


@router.get("/v1/agent/runs/{run_id}")
def get_run(run_id: str, request: Request) -> dict[str, Any]:
    tail = _tail(request, run_id)
    events = [event for _, event in tail.events]
    return {"id": run_id, "status": status_of(tail.status, events),
            "result": result_of(events), "transcript": events}


@router.get("/v1/agent/runs/{run_id}/events")
async def watch_run(run_id: str, request: Request,
                    last_event_id: str | None = Header(None)) -> StreamingResponse:
    """The run's events as server-sent events, from the first or after `Last-Event-ID`:
    reattach after a disconnect, watch a run started with stream=false, or watch from
    another replica than the one running it."""
    after = resume_after(last_event_id)
    await asyncio.to_thread(_tail, request, run_id, after)  # 404 before the stream starts
    return _stream(request, run_id, after, cancel_on_hangup=False)


@router.post("/v1/agent/runs/{run_id}/cancel")
def cancel_run(run_id: str, request: Request) -> dict[str, Any]:
    """Stop the run whichever replica runs it (another replica's run stops within
    `runs.CANCEL_POLL_S` plus its current step's kill)."""
    tail = _tail(request, run_id)
    running = runs_of(request).cancel(principal_of(request).tenant, run_id)
    return {"id": run_id, "status": status_of(tail.status, [e for _, e in tail.events]),
            "cancel_requested": running}
