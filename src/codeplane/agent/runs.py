"""The server's agent runs: each belongs to a tenant, runs on a thread of its own, and always
ends with a `run_end` event and a terminal status.

Runs live in memory only (transcripts hold source code; the server persists none). A running
run is never evicted: only finished runs age out, oldest first, past `keep_finished` per
tenant. Concurrent running runs are capped per tenant, so one key cannot take every core; with
`records` (a server's database) the cap counts every replica's runs and each run's status is
shared (`records.py`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict

from codeplane.agent.loop import Agent, Event, RunResult
from codeplane.agent.records import RunRecords
from codeplane.core.chat import ChatModel

log = logging.getLogger("codeplane.agent")
JOIN_S = 10.0  # how long close() waits for a cancelled run's thread


class RunLimit(Exception):
    """The tenant already has its maximum of running runs."""


class Run:
    """One run's events (kept for GET and late subscribers) and its live subscribers."""

    def __init__(self, agent: Agent, tenant: str) -> None:
        self.agent, self.tenant = agent, tenant
        self.events: list[Event] = []
        self.result: RunResult | None = None
        self.subscribers: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = []
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        agent.listeners.append(self.publish)

    @property
    def id(self) -> str:
        return self.agent.run_id

    def publish(self, event: Event) -> None:
        """Record an event and hand it to every live subscriber; a subscriber whose event
        loop has closed (server shutting down) is dropped, never allowed to fail the run."""
        with self.lock:
            self.events.append(event)
            for sub in list(self.subscribers):
                try:
                    sub[0].call_soon_threadsafe(sub[1].put_nowait, event)
                except RuntimeError:
                    self.subscribers.remove(sub)

    def subscribe(self) -> tuple[list[Event], asyncio.Queue]:
        queue: asyncio.Queue = asyncio.Queue()
        with self.lock:
            self.subscribers.append((asyncio.get_running_loop(), queue))
            return list(self.events), queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        with self.lock:
            self.subscribers = [s for s in self.subscribers if s[1] is not queue]

    def status(self) -> str:
        return self.result.status if self.result else "running"

    def work(self, task: str, model: ChatModel) -> None:
        """The run's thread. `Agent.run` ends every run itself; this is the last net for a
        failure outside it (a listener raising while publishing `run_end`)."""
        try:
            self.result = self.agent.run(task)
        except Exception as exc:  # the run must end whatever failed
            log.exception("agent run %s failed outside the loop", self.id)
            self._fail(f"internal error: {type(exc).__name__}: {exc}")
        finally:
            model.close()
            self.agent.env.close()  # a pooled workspace goes back to its pool

    def _fail(self, error: str) -> None:
        agent = self.agent
        result = RunResult(self.id, "error", "", agent.steps, agent.calls_made,
                           agent.usage["prompt_tokens"], agent.usage["completion_tokens"],
                           0.0, agent.model.name, error=error)
        if not self.events or self.events[-1]["type"] != "run_end":
            self.publish({"type": "run_end", "run_id": self.id, "t": 0.0, **result.to_dict()})
        self.result = result


class RunManager:
    """Every agent run of this server, by tenant. Built once by the server (`close()` at
    shutdown cancels what still runs)."""

    def __init__(self, max_running_per_tenant: int, keep_finished: int = 100,
                 records: RunRecords | None = None) -> None:
        self.max_running, self.keep_finished = max_running_per_tenant, keep_finished
        self.records = records
        self._runs: OrderedDict[str, Run] = OrderedDict()
        self._lock = threading.Lock()

    def admit(self, tenant: str) -> None:
        """RunLimit if the tenant is at its cap (checked again, atomically, by `start`)."""
        with self._lock:
            self._admit(tenant)

    def _admit(self, tenant: str, claim: str | None = None) -> None:
        """Check the cap; with `claim` (a run id) also record that run as running, in the
        same step as the shared count when there are records."""
        running = sum(1 for r in self._runs.values() if r.tenant == tenant and not r.result)
        if running < self.max_running and claim and self.records is not None:
            running = self.records.claim(tenant, claim, self.max_running) or 0
        if running >= self.max_running:
            raise RunLimit(f"this tenant already has {running} agent runs running (the "
                           f"server allows {self.max_running}: serve.max_runs_per_tenant); "
                           "wait for one to end or cancel one")

    def start(self, tenant: str, agent: Agent, task: str, model: ChatModel) -> Run:
        """Register and start a run; RunLimit if the tenant is at its cap. Finished runs
        of the tenant past `keep_finished` are forgotten, oldest first; running ones never."""
        run = Run(agent, tenant)
        with self._lock:
            self._admit(tenant, claim=run.id)
            finished = [r for r in self._runs.values() if r.tenant == tenant and r.result]
            for old in finished[: max(0, len(finished) + 1 - self.keep_finished)]:
                del self._runs[old.id]
            self._runs[run.id] = run
        run.thread = threading.Thread(target=self._work, args=(run, task, model),
                                      name=f"agent-{run.id}", daemon=True)
        run.thread.start()
        return run

    def _work(self, run: Run, task: str, model: ChatModel) -> None:
        run.work(task, model)
        if self.records is not None:
            result = run.result
            self.records.finish(run.id, result.status if result else "error",
                                result.error if result else "ended without a result")

    def get(self, tenant: str, run_id: str) -> Run | None:
        """The run, if it exists and belongs to `tenant` (another tenant's run is missing)."""
        with self._lock:
            run = self._runs.get(run_id)
        return run if run is not None and run.tenant == tenant else None

    def close(self) -> None:
        """Cancel every running run and wait a little for each to write its `run_end`."""
        with self._lock:
            runs = list(self._runs.values())
        for run in runs:
            run.agent.cancel.set()
        deadline = time.monotonic() + JOIN_S
        for run in runs:
            if run.thread is not None:
                run.thread.join(max(0.0, deadline - time.monotonic()))
