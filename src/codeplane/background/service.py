"""Background agents: a run works in a pooled sandbox of the fleet, goes on after the request
that started it has returned, and ends with a commit on branch `codeplane/<id>` plus a patch.

The agent itself is the ordinary `Agent` started through the server's `RunManager` (same loop,
same per-tenant cap, same `run_end`); this module adds what outlives one agent run: a sandbox
held across turns, follow-up turns, the commit and patch, and a durable record (`store.py`)
that a restart can read. A supervisor thread per background run starts each turn, waits for it
and finishes the run, so a turn's end never blocks inside the agent's own event delivery.

The fleet (`sandbox/fleet.py`) is the one place that makes checkouts: a run acquires a
copy-on-write sandbox of (repo, ref) and releases it when the run ends or is deleted. What a
finished run keeps is its patch (in the store) and its branch, as a git bundle of
`base..codeplane/<id>` under `background/<id>/`; a follow-up on a finished run acquires a new
sandbox at the base and fetches that branch into it. A restart therefore keeps a finished run's
patch and branch and nothing else: the fleet's reaper removes every sandbox the dead process
held, and the store marks its unfinished runs interrupted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from codeplane.agent.env import Environment
from codeplane.agent.loop import Agent, AgentConfig, Event
from codeplane.agent.runs import Run, RunManager
from codeplane.background.store import Store
from codeplane.core.chat import ChatModel
from codeplane.core.wakeups import Wakeups
from codeplane.sandbox.fleet import Fleet, PooledWorkspace, Sandbox
from codeplane.sandbox.runner import Limits

log = logging.getLogger("codeplane.background")
GIT_TIMEOUT = 120.0
CLOSE_WAIT_S = 15.0  # how long shutdown waits for cancelled runs to record their end
COMMAND_TIMEOUT_S = 120.0  # per agent command, as for agent runs
# Host-side git over a tree the agent wrote: no hooks, no fsmonitor, a fixed identity. (The
# agent cannot write .git: its tools refuse it and the sandbox mounts it read-only.)
SAFE_GIT = ("-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false",
            "-c", "user.name=codeplane", "-c", "user.email=agent@codeplane.invalid",
            "-c", "commit.gpgsign=false")
ModelFactory = Callable[[str], ChatModel]  # agent run id -> the model client for that turn


class GitError(Exception):
    """A git step failed; the message says which and why."""


def git(cwd: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """Run git with the safe settings above; its stdout, or GitError with its stderr."""
    try:
        done = subprocess.run(["git", *SAFE_GIT, *args], cwd=cwd, capture_output=True, check=False,
                              text=True, timeout=GIT_TIMEOUT, env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        raise GitError(f"git {args[0]} took longer than {GIT_TIMEOUT:.0f}s") from None
    if done.returncode != 0:
        raise GitError(f"git {args[0]} failed: {done.stderr.strip()[:500]}")
    return done.stdout


def working_diff(dest: Path, base: str) -> str:
    """Everything changed in the checkout since `base`, new files included, as a diff; a
    scratch index outside the tree keeps the checkout's own index untouched."""
    with tempfile.TemporaryDirectory(prefix="codeplane-index-") as scratch:
        env = {"GIT_INDEX_FILE": str(Path(scratch) / "index")}
        git(dest, "read-tree", base, env=env)
        git(dest, "add", "-A", env=env)
        return git(dest, "diff", "--cached", base, env=env)


def commit_result(dest: Path, branch: str, base: str, message: str) -> tuple[str | None, str]:
    """Commit the checkout's changes on `branch`: (commit or None if nothing changed, the
    patch from `base` in `git format-patch` form, empty when nothing changed)."""
    git(dest, "checkout", "--quiet", "-B", branch)
    git(dest, "add", "-A")
    if git(dest, "status", "--porcelain"):
        git(dest, "commit", "--quiet", "-m", message)
    head = git(dest, "rev-parse", "HEAD").strip()
    if head == base:
        return None, ""
    return head, git(dest, "format-patch", "--stdout", f"{base}..{head}")


def keep_branch(dest: Path, branch: str, base: str, bundle: Path) -> None:
    """Save `branch` (its commits since `base`) as a bundle file: the branch outlives the
    sandbox it was made in, and `git fetch BUNDLE BRANCH` brings it into any clone."""
    bundle.parent.mkdir(parents=True, exist_ok=True)
    git(dest, "bundle", "create", "--quiet", str(bundle), branch, f"^{base}")


def restore_branch(dest: Path, branch: str, bundle: Path) -> None:
    """Check out a kept branch in a fresh sandbox of its base (a follow-up on a finished
    run continues from its result, and its patch then covers every turn)."""
    git(dest, "fetch", "--quiet", "--no-tags", str(bundle), f"{branch}:{branch}")
    git(dest, "checkout", "--quiet", branch)


@dataclass
class Live:
    """What only this process knows about a running background run."""
    tenant: str
    repo: Path | str  # a path, or a URL the fleet fetches
    box: Sandbox | None  # the run's sandbox while it runs; released when it ends
    base: str
    task: str
    model: ModelFactory
    config: AgentConfig
    pending: list[str] = field(default_factory=list)
    run: Run | None = None
    cancelled: bool = False
    turns: int = 0
    last_diff: str = ""
    running: bool = True
    thread: threading.Thread | None = None


class BackgroundService:
    """Every background run of one server. Built once (`server/services.py`); on start-up
    any run a previous process left "running" is marked interrupted."""

    def __init__(self, server_dir: Path, runs: RunManager, fleet: Fleet,
                 settings: Any = None, store: Store | None = None) -> None:
        self.root = server_dir / "background"
        self.store = store or Store.open(self.root / "runs.db")
        self.runs, self.fleet, self.settings = runs, fleet, settings
        self.store.interrupt_unfinished()
        self._live: dict[str, Live] = {}
        self._wakeups = Wakeups()
        self._lock = threading.Lock()

    def launch(self, tenant: str, repo: Path | str, ref: str, task: str, model: str,
               factory: ModelFactory, config: AgentConfig) -> dict[str, Any]:
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
        live = Live(tenant, repo, box, box.commit, task, factory, config)
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
        box = self._sandbox(run_id, live)
        env = Environment(PooledWorkspace(self.fleet, box, release=False),
                          Limits(timeout=COMMAND_TIMEOUT_S))
        agent = Agent(model, env, live.config, settings=self.settings, run_id=agent_id)
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
            assert live.box is not None
            branch = f"codeplane/{run_id}"
            head, patch = commit_result(live.box.workspace, branch, live.base,
                                        f"codeplane agent: {live.task[:200]}")
            if head is not None:
                keep_branch(live.box.workspace, branch, live.base, self._bundle(run_id))
            self.store.update(run_id, commit_sha=head, patch=patch)
            self.record(run_id, {"type": "result", "branch": f"codeplane/{run_id}",
                                 "commit": head, "patch_bytes": len(patch)})
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

    def _on_event(self, run_id: str, live: Live, event: Event) -> None:
        """Store an agent event (without the bulky prompt copies); after a tool ran, a
        `diff` event when the checkout's changes moved."""
        slim = {k: v for k, v in event.items() if k not in ("messages", "tools")}
        self.record(run_id, slim)
        if event["type"] == "tool_result" and live.box is not None:
            diff = working_diff(live.box.workspace, live.base)
            if diff != live.last_diff:
                live.last_diff = diff
                self.record(run_id, {"type": "diff", "diff": diff})

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
            bundle = self._bundle(run_id)
            if bundle.is_file():
                restore_branch(box.workspace, f"codeplane/{run_id}", bundle)
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
