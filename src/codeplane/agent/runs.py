"""The server's agent runs: each belongs to a tenant, runs on a thread of its own, and always
ends with a `run_end` event and a terminal status.

With `records` (a server's database, `records.py`) every event is stored as it happens, so
any replica shows and streams any run, the per-tenant cap counts every replica's runs, and a
cancel asked of any replica reaches the owner (which polls for it every `CANCEL_POLL_S`).
Without records (tests, tools) the events stay in memory. A running run is never evicted:
only finished runs age out, oldest first, past `keep_finished` per tenant.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from sqlalchemy.exc import SQLAlchemyError

from codeplane.agent.loop import Agent, Event, RunResult
from codeplane.agent.records import RunRecords, RunTaken
from codeplane.core.chat import ChatModel
from codeplane.core.wakeups import Wakeups
from codeplane.storage import DatabaseError

log = logging.getLogger("codeplane.agent")
JOIN_S = 10.0  # how long close() waits for a cancelled run's thread
CANCEL_POLL_S = 0.5  # how often the owner looks for cancels asked of other replicas
ENDS = ("run_end", "interrupted")  # the events after which a run has nothing more to say
RESULT_FIELDS = tuple(f.name for f in dataclasses.fields(RunResult))


class RunLimit(Exception):
    """The tenant already has its maximum of running runs."""


@dataclasses.dataclass
class Tail:
    """What a watcher reads: the run's status and its events numbered above a point."""
    status: str
    events: list[tuple[int, Event]]


def result_of(events: list[Event]) -> dict | None:
    """The run's result, as the `run_end` event that ends its transcript states it."""
    if events and events[-1]["type"] == "run_end":
        return {k: events[-1].get(k) for k in RESULT_FIELDS}
    return None


def status_of(status: str, events: list[Event]) -> str:
    """A recorded status, unless the transcript already ended (its end event is written
    before the record's status, and says the same)."""
    if events and events[-1]["type"] in ENDS:
        return events[-1].get("status") or status
    return status


class Run:
    """One run of this replica: its agent, thread, and events (kept here for a server
    without records; stored in them with one sequence number per event otherwise)."""

    def __init__(self, agent: Agent, tenant: str, records: RunRecords | None = None,
                 notify: Callable[[str], None] | None = None) -> None:
        self.agent, self.tenant, self.records = agent, tenant, records
        self.notify = notify
        self.events: list[Event] = []
        self.result: RunResult | None = None
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        agent.listeners.append(self.publish)

    @property
    def id(self) -> str:
        return self.agent.run_id

    def publish(self, event: Event) -> None:
        """Record an event (in the database first, when there is one) and wake this
        replica's watchers. A storage failure cancels the run rather than leave a
        transcript with a hole; a slot taken by an `interrupted` verdict stops it too."""
        with self.lock:
            self.events.append(event)
            if self.records is not None:
                try:
                    self.records.append(self.id, len(self.events), event)
                except RunTaken:
                    log.warning("agent run %s was declared interrupted; stopping", self.id)
                    self.agent.cancel.set()
                except (DatabaseError, SQLAlchemyError):
                    log.exception("agent run %s: event not stored; cancelling", self.id)
                    self.agent.cancel.set()
        if self.notify is not None:
            self.notify(self.id)

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
        self._wakeups = Wakeups()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._poller: threading.Thread | None = None

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
        run = Run(agent, tenant, self.records, self._wakeups.wake)
        with self._lock:
            self._admit(tenant, claim=run.id)
            finished = [r for r in self._runs.values() if r.tenant == tenant and r.result]
            for old in finished[: max(0, len(finished) + 1 - self.keep_finished)]:
                del self._runs[old.id]
            self._runs[run.id] = run
            if self.records is not None and self._poller is None:
                self._poller = threading.Thread(target=self._poll_cancels,
                                                name="agent-cancels", daemon=True)
                self._poller.start()
        run.thread = threading.Thread(target=self._work, args=(run, task, model),
                                      name=f"agent-{run.id}", daemon=True)
        run.thread.start()
        return run

    def _work(self, run: Run, task: str, model: ChatModel) -> None:
        run.work(task, model)
        if self.records is not None:
            result = run.result
            try:
                self.records.finish(run.id, result.status if result else "error",
                                    result.error if result else "ended without a result")
            except (DatabaseError, SQLAlchemyError):  # its run_end event says how it ended
                log.exception("agent run %s: final status not stored", run.id)

    def get(self, tenant: str, run_id: str) -> Run | None:
        """This replica's run, if it exists and belongs to `tenant` (another tenant's run
        is missing)."""
        with self._lock:
            run = self._runs.get(run_id)
        return run if run is not None and run.tenant == tenant else None

    def tail(self, tenant: str, run_id: str, after: int = 0) -> Tail | None:
        """The run's status and events numbered above `after`, whichever replica runs it;
        None if `tenant` has no such run."""
        if self.records is not None:
            found = self.records.tail(tenant, run_id, after)
            return Tail(*found) if found is not None else None
        run = self.get(tenant, run_id)
        if run is None:
            return None
        with run.lock:
            events = list(enumerate(run.events[after:], start=after + 1))
        return Tail(run.status(), events)

    def cancel(self, tenant: str, run_id: str) -> bool:
        """Ask the tenant's run to stop, wherever it runs: here at once, on another replica
        within `CANCEL_POLL_S` (the owner polls the flag). False if it is not running."""
        run = self.get(tenant, run_id)
        if run is not None and run.result is None:
            run.agent.cancel.set()
        if self.records is not None:
            return self.records.request_cancel(tenant, run_id)
        return run is not None and run.result is None

    def _poll_cancels(self) -> None:
        """The owner's side of a cancel asked of another replica."""
        while not self._closed.wait(CANCEL_POLL_S):
            with self._lock:
                running = {r.id: r for r in self._runs.values() if r.result is None}
            if not running:
                continue
            try:
                flagged = self.records.cancelled(list(running))
            except (DatabaseError, SQLAlchemyError):
                log.exception("polling agent-run cancels failed; retrying")
                continue
            for run_id in flagged:
                running[run_id].agent.cancel.set()

    # -- watchers: woken at once by this replica's runs, polling for other replicas' -------

    def watch(self, run_id: str) -> asyncio.Event:
        return self._wakeups.watch(run_id)

    def unwatch(self, run_id: str, wake: asyncio.Event) -> None:
        self._wakeups.unwatch(run_id, wake)

    def close(self) -> None:
        """Cancel every running run and wait a little for each to write its `run_end`."""
        self._closed.set()
        with self._lock:
            runs = list(self._runs.values())
        for run in runs:
            run.agent.cancel.set()
        deadline = time.monotonic() + JOIN_S
        for run in runs:
            if run.thread is not None:
                run.thread.join(max(0.0, deadline - time.monotonic()))
