"""`POST /v1/agent/runs` (SSE stream of run events), `GET /v1/agent/runs/{id}`,
`POST /v1/agent/runs/{id}/cancel`.

A run executes the same `Agent` as the CLI on a thread of its own, talking to this server's own
OpenAI endpoint over loopback. Its events stay in memory only: transcripts hold source code,
and the server persists no source code (CONTRIBUTING: privacy boundary).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from codeplane.agent.env import ToolError, local_environment
from codeplane.agent.loop import Agent, AgentConfig, ChatModel, Event, RunResult
from codeplane.sandbox import SandboxUnavailable
from codeplane.core.errors import APIError, not_found

router = APIRouter()
MAX_RUNS = 100  # finished runs kept for GET; the oldest are forgotten
KEEPALIVE = 5.0  # seconds without an event before the stream sends a comment line


class RunRequest(BaseModel):
    task: str = Field(min_length=1)
    path: str = Field(min_length=1, description="workspace directory on the server machine")
    model: str = "code-medium"
    max_steps: int = Field(25, ge=1, le=200)
    max_tokens: int = Field(1024, ge=16, le=8192)
    sandbox: bool = True
    network: bool = False
    stream: bool = True


class Run:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.events: list[Event] = []
        self.result: RunResult | None = None
        self.subscribers: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = []
        self.lock = threading.Lock()
        agent.listeners.append(self.publish)

    def publish(self, event: Event) -> None:
        with self.lock:
            self.events.append(event)
            for loop, queue in self.subscribers:
                loop.call_soon_threadsafe(queue.put_nowait, event)

    def subscribe(self) -> tuple[list[Event], asyncio.Queue]:
        queue: asyncio.Queue = asyncio.Queue()
        with self.lock:
            self.subscribers.append((asyncio.get_running_loop(), queue))
            return list(self.events), queue

    def status(self) -> str:
        return self.result.status if self.result else "running"


def _runs(request: Request) -> OrderedDict[str, Run]:
    state = request.app.state
    if not hasattr(state, "agent_runs"):
        state.agent_runs = OrderedDict()
    return state.agent_runs


@router.post("/v1/agent/runs")
async def create_run(body: RunRequest, request: Request):
    root = Path(body.path).expanduser()
    try:
        env = await asyncio.to_thread(local_environment, root.resolve(), body.sandbox,
                                      body.network)  # the sandbox probe spawns bwrap
    except ToolError as exc:
        raise APIError(400, str(exc), param="path") from None
    except SandboxUnavailable as exc:
        raise APIError(503, f"refusing to run: {exc}", type="server_error",
                       code="sandbox_unavailable") from None
    model = ChatModel(str(request.base_url).rstrip("/") + "/v1", body.model)
    agent = Agent(model, env, AgentConfig(max_steps=body.max_steps, max_tokens=body.max_tokens),
                  settings=request.app.state.settings)
    run = Run(agent)
    runs = _runs(request)
    runs[agent.run_id] = run
    while len(runs) > MAX_RUNS:
        runs.popitem(last=False)
    backlog, queue = run.subscribe() if body.stream else ([], None)

    def work() -> None:
        try:
            run.result = agent.run(body.task)
        finally:
            model.close()

    threading.Thread(target=work, name=f"agent-{agent.run_id}", daemon=True).start()
    if not body.stream:
        return {"id": agent.run_id, "status": "running"}
    return StreamingResponse(_sse(run, backlog, queue), media_type="text/event-stream",
                             headers={"X-Agent-Run-Id": agent.run_id})


async def _sse(run: Run, backlog: list[Event], queue: asyncio.Queue) -> AsyncIterator[str]:
    """The run's events; a client that hangs up cancels the run (its running command is
    killed): nobody is left to see the result, and the CPU it holds is shared. Runs started
    with stream=false are not tied to a connection."""
    ended = False
    try:
        for event in backlog:
            yield f"data: {json.dumps(event, default=str)}\n\n"
        ended = bool(backlog) and backlog[-1]["type"] == "run_end"
        while not ended:
            try:
                event = await asyncio.wait_for(queue.get(), KEEPALIVE)
            except TimeoutError:  # a comment line: also how a hang-up is noticed under
                yield ": keep-alive\n\n"  # ASGI servers that report it only on send
                continue
            yield f"data: {json.dumps(event, default=str)}\n\n"
            ended = event["type"] == "run_end"
        yield "data: [DONE]\n\n"
    finally:
        if not ended:
            run.agent.cancel.set()


def _get(request: Request, run_id: str) -> Run:
    run = _runs(request).get(run_id)
    if run is None:
        raise not_found(f"agent run {run_id!r} does not exist", code="run_not_found",
                        param="run_id")
    return run


@router.get("/v1/agent/runs/{run_id}")
def get_run(run_id: str, request: Request) -> dict[str, Any]:
    run = _get(request, run_id)
    return {"id": run_id, "status": run.status(),
            "result": run.result.to_dict() if run.result else None,
            "transcript": list(run.events)}


@router.post("/v1/agent/runs/{run_id}/cancel")
def cancel_run(run_id: str, request: Request) -> dict[str, Any]:
    run = _get(request, run_id)
    run.agent.cancel.set()
    return {"id": run_id, "status": run.status(), "cancel_requested": True}
