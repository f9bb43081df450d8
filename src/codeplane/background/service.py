"""Background agents: a run works in a pooled sandbox of the fleet, goes on after the request
that started it has returned, and ends with a commit on branch `codeplane/<id>` plus a patch.

The agent itself is the ordinary `Agent` started through the server's `RunManager` (same loop,
same per-tenant cap, same `run_end`); this module adds what outlives one agent run: a sandbox
held across turns, follow-up turns, the commit and patch, and a durable record (`records.py`)
that a restart can read. A supervisor thread per background run starts each turn, waits for it
and finishes the run, so a turn's end never blocks inside the agent's own event delivery.

The fleet (`sandbox/fleet.py`) is the one place that makes checkouts: a run acquires a
copy-on-write sandbox of (repo, ref) and releases it when the run ends or is deleted. What a
finished run keeps is its patch (in the store) and its branch, as a git bundle of
`base..codeplane/<id>` under `background/<id>/`; a follow-up on a finished run acquires a new
sandbox at the base and checks that branch out in it. A restart therefore keeps a finished
run's patch and branch and nothing else: the fleet's reaper removes every sandbox the dead
process held, and the store marks its unfinished runs interrupted.

Git never runs on the host over a run's tree: the tree is the tenant's (and the agent's), and
its `.git/config`, attributes or nested repositories would be configuration the host runs.
The diff after each tool call, the commit, the patch and the bundle are made inside the run's
sandbox (`sandbox/treegit.py`) and reach the host as data. A tree whose post-command sweep
could not finish (`gitguard.tainted`) is not committed: the run ends with an error saying so.
What a run stores is bounded (`[background]`: `diff_bytes` of diff events, then summaries;
`patch_bytes` of result patch, then the branch bundle alone).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from codeplane.agent.env import Environment
from codeplane.agent.loop import Agent, Event
from codeplane.agent.runs import Run, RunManager
from codeplane.agent.services import for_caller
from codeplane.agent.setup import AgentSetup
from codeplane.agent.toolset import ToolServices
from codeplane.background.records import BackgroundRecords
from codeplane.config import Settings
from codeplane.core import files
from codeplane.core.chat import ChatModel
from codeplane.core.wakeups import Wakeups
from codeplane.sandbox import Backends, gitguard, treegit
from codeplane.sandbox.fleet import Fleet, Sandbox
from codeplane.sandbox.runner import Limits
from codeplane.sandbox.treegit import TreeGitError

log = logging.getLogger("codeplane.background")
CLOSE_WAIT_S = 15.0  # how long shutdown waits for cancelled runs to record their end
COMMAND_TIMEOUT_S = 120.0  # per agent command, as for agent runs
ModelFactory = Callable[[str], ChatModel]  # agent run id -> the model client for that turn


class ResultRefused(Exception):
    """A run's tree cannot be committed (the message says why)."""


@dataclass
class Live:
    """What only this process knows about a running background run."""
    tenant: str
    repo: Path | str  # a path, or a URL the fleet fetches
    box: Sandbox | None  # the run's sandbox while it runs; released when it ends
    base: str
    task: str
    model: ModelFactory
    setup: AgentSetup
    pending: list[str] = field(default_factory=list)
    run: Run | None = None
    cancelled: bool = False
    turns: int = 0
    head: str | None = None  # the result committed so far (kept as the run's bundle)
    last_digest: str = ""  # of the last diff recorded: an unchanged tree records nothing
    diff_stored: int = 0  # bytes of diff events stored, against [background] diff_bytes
    running: bool = True
    thread: threading.Thread | None = None


class BackgroundService:
    """Every background run of one server. Built once (`server/services.py`); on start-up
    any run a previous process left "running" is marked interrupted."""

    def __init__(self, server_dir: Path, runs: RunManager, fleet: Fleet, backends: Backends,
                 settings: Settings, tools: ToolServices, store: BackgroundRecords | None = None) -> None:
        self.root = server_dir / "background"
        self.store = store or BackgroundRecords.open(self.root / "runs.db")
        self.runs, self.fleet, self.backends, self.settings = runs, fleet, backends, settings
        self.tools = tools  # the server's: every turn's tools reach its index and apply model
        self.quota = settings.background
        self.store.interrupt_unfinished()
        self._live: dict[str, Live] = {}
        self._wakeups = Wakeups()
        self._lock = threading.Lock()

    def launch(self, tenant: str, repo: Path | str, ref: str, task: str, model: str,
               factory: ModelFactory, setup: AgentSetup) -> dict[str, Any]:
        """Acquire a sandbox of `repo` at `ref` and start the first turn; returns the stored
        run at once. RunLimit (from the run manager) if the tenant is at its cap, FleetError
        if the fleet refuses (quota, unknown ref)."""
        self.runs.admit(tenant)
        run_id = uuid.uuid4().hex[:16]
        box = self.fleet.acquire(tenant, repo, ref, holder=f"background {run_id}")
        try:
            self.store.create({"id": run_id, "tenant": tenant, "repo": str(repo), "ref": ref,
                               "task": task, "model": model})
        except Exception:
            self.fleet.release(box.id)
            raise
        self.store.update(run_id, branch=f"codeplane/{run_id}")
        self.record(run_id, {"type": "checkout", "repo": str(repo), "ref": ref,
                             "commit": box.commit, "sandbox": box.id,
                             "strategy": box.strategy})
        live = Live(tenant, repo, box, box.commit, task, factory, setup)
        with self._lock:
            self._live[run_id] = live
        self._supervise(run_id, live, task)
        return self.store.get(tenant, run_id) or {}

    def _supervise(self, run_id: str, live: Live, task: str) -> None:
        """Start the first turn now (so a RunLimit reaches the caller), the rest on a thread."""
        try:
            live.run = self._turn(run_id, live, task)
        except Exception as exc:
            live.running = False
            self._release(live)
            self.store.update(run_id, status="error", error=f"could not start the agent: {exc}")
            self.record(run_id, {"type": "end", "status": "error", "error": str(exc)})
            raise
        live.thread = threading.Thread(target=self._follow, args=(run_id, live), daemon=True,
                                       name=f"background-{run_id}")
        live.thread.start()

    def _turn(self, run_id: str, live: Live, task: str) -> Run:
        live.turns += 1
        agent_id = f"{run_id}-{live.turns}"
        model = live.model(agent_id)
        box = self._sandbox(run_id, live)  # held across turns: its workspace releases nothing
        workspace = self.backends.for_caller(live.tenant, box).open(box.workspace, "pool")
        env = Environment(workspace, Limits(timeout=COMMAND_TIMEOUT_S))
        agent = Agent(model, env, live.setup.config, services=for_caller(self.tools, model),
                      run_id=agent_id, hooks=live.setup.hooks)
        agent.listeners.append(lambda event: self._on_event(run_id, live, event))
        self.record(run_id, {"type": "turn_start", "turn": live.turns, "task": task})
        return self.runs.start(live.tenant, agent, task, model)

    def _follow(self, run_id: str, live: Live) -> None:
        """Wait for each turn; run queued follow-ups; then commit, store the patch, end."""
        status, error = "error", None
        try:
            while True:
                assert live.run is not None and live.run.thread is not None
                live.run.thread.join()
                result = live.run.result
                status = result.status if result else "error"
                error = result.error if result else "the turn ended without a result"
                with self._lock:
                    follow_up = live.pending.pop(0) if live.pending and not live.cancelled \
                        else None
                if follow_up is None:
                    break
                live.run = self._turn(run_id, live, continuation(live.task, follow_up))
            if live.cancelled:
                status = "cancelled"
            self._commit(run_id, live)
        except Exception as exc:  # the run must end, whatever failed
            log.exception("background run %s failed", run_id)
            status, error = "error", f"{type(exc).__name__}: {exc}"
        self._release(live)
        self.store.update(run_id, status=status, error=error)
        self.record(run_id, {"type": "end", "status": status, "error": error})
        with self._lock:  # a follow-up sent while the result was committed is not lost
            late = live.pending.pop(0) if live.pending and not live.cancelled else None
            live.running = late is not None
        if late is not None:
            self.store.update(run_id, status="running", error=None)
            try:
                self._supervise(run_id, live, continuation(live.task, late))
            except Exception:  # recorded as the run's end by _supervise
                log.exception("background run %s: the follow-up could not start", run_id)

    def _commit(self, run_id: str, live: Live) -> None:
        """Commit the sandbox's tree on the run's branch (git runs inside the sandbox), keep
        the branch as a bundle and store the patch (up to `patch_bytes`) and a `result`
        event. ResultRefused for a tree its sweep marked tainted."""
        box = live.box
        assert box is not None
        reason = gitguard.tainted(box.workspace)
        if reason is not None:
            raise ResultRefused(f"the sandbox's tree is tainted ({reason}): nothing is "
                                "committed from it")
        tag = secrets.token_hex(6)
        previous = None
        if live.head is not None:  # a result made in an earlier sandbox of this run
            files.write_atomic(box.workspace, Path(f".codeplane-{tag}-in.bundle"),
                               self._bundle(run_id).read_bytes())
            previous = (live.head, f".codeplane-{tag}-in.bundle")
        branch = f"codeplane/{run_id}"
        result = treegit.commit(box.runner(), box.workspace, live.base, branch,
                                f"codeplane agent: {live.task[:200]}", tag, previous)
        patch, size = "", 0
        if result.bundle_file and result.patch_file:
            self._keep(box, result.bundle_file, self._bundle(run_id))
            patch, size = self._patch(box, result.patch_file)
        head = result.head if result.head != live.base else None
        live.head = head
        self.store.update(run_id, commit_sha=head, patch=patch)
        self.record(run_id, {"type": "result", "branch": branch, "commit": head,
                             "patch_bytes": size, "patch_omitted": patch is None})

    def _keep(self, box: Sandbox, name: str, bundle: Path) -> None:
        """Copy the branch bundle the sandbox wrote out of its tree, as bytes (bounded by
        the disk the tenant's sandboxes may use: the bundle is a compressed tree)."""
        bundle.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = bundle.with_name(f".{bundle.name}.{secrets.token_hex(4)}")
        files.copy_out(box.workspace, Path(name), tmp, self.fleet.settings.disk_per_tenant)
        os.replace(tmp, bundle)

    def _patch(self, box: Sandbox, name: str) -> tuple[str | None, int]:
        """The result patch the sandbox wrote (None past `patch_bytes`) and its size."""
        try:
            data = files.read_bytes(box.workspace, Path(name), self.quota.patch_bytes)
        except files.TooLarge as exc:
            return None, exc.size
        return data.decode("utf-8", "replace"), len(data)

    def _on_event(self, run_id: str, live: Live, event: Event) -> None:
        """Store an agent event (without the bulky prompt copies); after a tool ran, a
        `diff` event when the checkout's changes moved."""
        slim = {k: v for k, v in event.items() if k not in ("messages", "tools")}
        self.record(run_id, slim)
        if event["type"] == "tool_result" and live.box is not None:
            self._record_diff(run_id, live, live.box)

    def _record_diff(self, run_id: str, live: Live, box: Sandbox) -> None:
        """The tree's diff against the base, computed in the sandbox: stored whole while the
        run's `diff_bytes` allow it, else as a summary naming its size."""
        left = max(0, self.quota.diff_bytes - live.diff_stored)
        try:
            change = treegit.diff(box.runner(), box.workspace, live.base, left)
        except TreeGitError as exc:  # the run goes on; its events just miss this diff
            log.warning("background run %s: no diff after a tool call: %s", run_id, exc)
            return
        if change.digest == live.last_digest:
            return
        live.last_digest = change.digest
        if change.patch is not None:
            live.diff_stored += change.size
            self.record(run_id, {"type": "diff", "diff": change.patch})
            return
        note = (f"[codeplane: the diff is {change.size} bytes; this run has stored "
                f"{live.diff_stored} of its {self.quota.diff_bytes} bytes of diffs, so only "
                "a summary is kept. The result's branch holds every change.]\n")
        self.record(run_id, {"type": "diff", "diff": note + change.summary,
                             "omitted_bytes": change.size})

    def record(self, run_id: str, event: Event) -> int:
        """Store an event, stamped with the wall-clock time it was recorded (`at`): what
        a watcher's delay is measured from (bench/background.py)."""
        seq = self.store.append(run_id, {**event, "at": round(time.time(), 4)})
        self._wakeups.wake(run_id)
        return seq

    def watch(self, run_id: str) -> asyncio.Event:
        """A wake-up for the calling event loop, set whenever the run records an event (so
        a watcher reads the store as soon as there is something new, not on a timer)."""
        return self._wakeups.watch(run_id)

    def unwatch(self, run_id: str, wake: asyncio.Event) -> None:
        self._wakeups.unwatch(run_id, wake)

    def message(self, tenant: str, run_id: str, content: str) -> dict[str, Any] | None:
        """Queue a follow-up for after the current turn; on a run this process finished,
        start it again as a continuation in the same checkout (its patch then covers every
        turn). None if the run is not this process's: one interrupted by a restart has no
        model client left and a checkout in an unknown state."""
        with self._lock:
            live = self._live.get(run_id)
            if live is None or live.tenant != tenant:
                return None
            if live.running:
                live.pending.append(content)
                return {"queued": True}
        self.runs.admit(tenant)  # RunLimit before anything changes
        with self._lock:
            if live.running:  # a concurrent follow-up restarted it first
                live.pending.append(content)
                return {"queued": True}
            live.running, live.cancelled = True, False
        self.store.update(run_id, status="running", error=None)
        self._supervise(run_id, live, continuation(live.task, content))
        return {"queued": False}

    def cancel(self, tenant: str, run_id: str) -> bool:
        """Stop the current turn and drop queued follow-ups; False if nothing runs."""
        with self._lock:
            live = self._live.get(run_id)
            if live is None or live.tenant != tenant or not live.running:
                return False
            live.cancelled = True
            live.pending.clear()
        if live.run is not None:
            live.run.agent.cancel.set()
        return True

    def delete(self, tenant: str, run_id: str) -> bool:
        """Erase a finished run: its record, events, patch, kept branch and any sandbox (source
        code the server holds only for this run). False while it runs (cancel it first)."""
        with self._lock:
            live = self._live.get(run_id)
            if live is not None and live.running:
                return False
            self._live.pop(run_id, None)
        if live is not None:
            self._release(live)
        self.store.delete(run_id)
        shutil.rmtree(self.root / run_id, ignore_errors=True)
        return True

    def close(self) -> None:
        """Cancel what runs and wait (boundedly) for each to record its end, then close the
        store; a run still going after that is marked interrupted at the next start."""
        with self._lock:
            lives = [(i, live) for i, live in self._live.items() if live.running]
        for run_id, live in lives:
            self.cancel(live.tenant, run_id)
        deadline = time.monotonic() + CLOSE_WAIT_S
        for _, live in lives:
            if live.thread is not None:
                live.thread.join(max(0.0, deadline - time.monotonic()))
        self.store.close()

    def _bundle(self, run_id: str) -> Path:
        return self.root / run_id / "branch.bundle"

    def _sandbox(self, run_id: str, live: Live) -> Sandbox:
        """The run's sandbox; after the run ended (a follow-up), a new one at its base with
        the kept branch checked out. FleetError if the fleet refuses."""
        if live.box is None:
            box = self.fleet.acquire(live.tenant, live.repo, live.base,
                                     holder=f"background {run_id}")
            live.box = box
            if live.head is not None:
                name = f".codeplane-{secrets.token_hex(6)}-in.bundle"
                files.write_atomic(box.workspace, Path(name), self._bundle(run_id).read_bytes())
                treegit.check_out(box.runner(), box.workspace, live.base,
                                  f"codeplane/{run_id}", name)
            self.record(run_id, {"type": "checkout", "repo": str(live.repo), "ref": live.base,
                                 "commit": live.base, "sandbox": box.id,
                                 "strategy": box.strategy})
        return live.box

    def _release(self, live: Live) -> None:
        """Give the run's sandbox back to the fleet (everything in it is removed)."""
        box, live.box = live.box, None
        if box is not None:
            self.fleet.release(box.id)


def continuation(task: str, follow_up: str) -> str:
    """The task of a follow-up turn: the original task for context, then the instruction."""
    return (f"Earlier task (already worked on in this workspace): {task}\n\n"
            f"Follow-up instruction: {follow_up}")
