"""The sandbox service: workspaces made copy-on-write from a cached base checkout of a repo at
a ref, warm pools per (repo, commit) refilled in the background, quotas per tenant, and the
reaper's records so a crash leaves nothing behind after the next start.

The API other compartments use is two calls: `acquire(tenant, repo, ref) -> Sandbox` (a warm
one from the pool when there is one, else made now) and `release(id)` (everything removed).
A `Sandbox` is a directory (`sandbox.workspace`) plus the existing `BwrapRunner` over it
(`sandbox.runner()`), so callers run commands exactly as agent runs do.

Layout under `server_dir/fleet/`: `bases/<key>/` (a checkout per repo and commit, shared
read-only by every sandbox of it), `sandboxes/<id>/` (one per sandbox; the tree is
`sandboxes/<id>/ws`) and `records/<id>.json` (the reaper's). With `records` (the server
database, `records.py`) each sandbox also has a shared record, so every replica lists a
tenant's sandboxes and shows where each lives; only the owning replica can work in one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from codeplane.config import FleetSettings
from codeplane.core.errors import APIError
from codeplane.sandbox import clone, reaper, treegit, urlfetch
from codeplane.sandbox.cgroups import SandboxCgroup
from codeplane.sandbox.pool import PooledWorkspace
from codeplane.sandbox.records import SandboxRecords
from codeplane.sandbox.runner import BwrapRunner, CommandResult, Limits, SandboxUnavailable
from codeplane.sandbox.workspace import Workspace
from codeplane.storage import DatabaseError

T = TypeVar("T")
log = logging.getLogger("codeplane.fleet")


class FleetError(Exception):
    """A request the fleet refuses; `status` is the HTTP status the routes answer with."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code

    def to_api(self) -> APIError:
        """This refusal as the API's error envelope (a bad ref names the `ref` param)."""
        param = "ref" if self.code in ("invalid_ref", "unknown_ref") else None
        return APIError(self.status, str(self), code=self.code, param=param,
                        type="server_error" if self.status >= 500 else "invalid_request_error")


@dataclass
class Sandbox:
    id: str
    repo: str
    ref: str
    commit: str
    path: Path  # the sandbox's own directory; the tree is path/"ws"
    strategy: str
    created: float = field(default_factory=time.time)
    tenant: str | None = None  # None while it waits in a pool
    holder: str = "api"  # who uses it: "api", "agent run", "background <run id>"
    # every process of the sandbox, whoever runs it (the API, an agent run), in one cgroup
    # with the fleet's limits
    cgroup: SandboxCgroup = field(default_factory=SandboxCgroup, repr=False)
    _runner: BwrapRunner | None = field(default=None, repr=False)

    @property
    def workspace(self) -> Path:
        return self.path / "ws"

    def runner(self) -> BwrapRunner:
        """The bubblewrap runner over this workspace, probed once on first use."""
        if self._runner is None:
            self._runner = BwrapRunner(self.workspace, cgroup=self.cgroup)
        return self._runner

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "repo": self.repo, "ref": self.ref, "commit": self.commit,
                "strategy": self.strategy, "created": self.created, "holder": self.holder,
                "workspace": str(self.workspace)}


@dataclass
class Pool:
    target: int
    source: Path  # what its sandboxes are cloned from (a URL's local mirror)
    ready: deque[Sandbox] = field(default_factory=deque)
    hits: int = 0
    misses: int = 0


class Fleet:
    """Every sandbox of one server. Thread-safe: routes run on a thread pool."""

    def __init__(self, server_dir: Path, settings: FleetSettings | None = None,
                 repo_urls: list[str] | None = None,
                 records: SandboxRecords | None = None) -> None:
        self.settings = settings or FleetSettings()
        self.shared = records  # the database's records of every replica's sandboxes
        self.repo_urls = list(repo_urls or [])  # serve.repo_urls: what may be fetched
        self.root = server_dir / "fleet"
        self.bases = self.root / "bases"
        self.boxes = self.root / "sandboxes"
        self.records = self.root / "records"
        self.remotes = self.root / "remotes"  # bare mirrors of repos fetched by URL
        for directory in (self.bases, self.boxes, self.records, self.remotes):
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.owner = reaper.Owner.me()
        self.reaped = reaper.reap_orphans(self.records, self.boxes)
        self._sweep_partial_bases()
        self.strategy = clone.choose(self.root, self.settings.strategy)
        self._lock = threading.Lock()
        self._base_locks: dict[str, threading.Lock] = {}
        self._live: dict[str, Sandbox] = {}
        self._pending: dict[str, int] = {}  # sandboxes being made now, per tenant
        self._pools: dict[tuple[str, str], Pool] = {}
        self._fetched: dict[str, float] = {}  # URL -> monotonic time of its last fetch
        # API commands run here, never on the server's request threads (a command can take
        # minutes); `_execs` counts each tenant's running and waiting ones
        self._exec_pool = ThreadPoolExecutor(self.settings.exec_workers,
                                             thread_name_prefix="fleet-exec")
        self._execs: dict[str, int] = {}
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._filler = threading.Thread(target=self._fill, name="fleet-pool", daemon=True)
        self._filler.start()
        if any(self.reaped.values()):
            log.warning("reaped after a crash: %s", self.reaped)

    # --- the API other compartments use -------------------------------------------------

    def acquire(self, tenant: str, repo: Path | str, ref: str = "HEAD",
                holder: str = "api") -> Sandbox:
        """A sandbox of `repo` (a git directory or bundle, or a URL policy allows) at `ref`
        for `tenant`: warm from the pool if one is ready, else made now. FleetError on a
        quota, a bad ref, or a URL refused or not fetched."""
        with self._lock:
            self._check_quota(tenant)  # before a fetch: a tenant at its quota costs nothing
        source = self.source(repo)
        commit = resolve(source, ref)
        key = (str(repo), commit)
        with self._lock:
            self._check_quota(tenant)
            pool = self._pools.setdefault(key, Pool(self.settings.pool_size, source))
            box = pool.ready.popleft() if pool.ready else None
            if box is not None:
                pool.hits += 1
                box.tenant, box.ref, box.holder = tenant, ref, holder
                self._live[box.id] = box
            else:
                pool.misses += 1
                self._check_capacity()
                self._pending[tenant] = self._pending.get(tenant, 0) + 1  # holds its slot
            self._wake.notify()
        if box is not None:
            if self.shared is not None:
                self.shared.assign(box.id, tenant, ref, holder)
            return box
        try:
            return self._make(source, str(repo), ref, commit, tenant, holder)
        except clone.CloneError as exc:
            raise FleetError(503, f"could not make the sandbox: {exc}", "clone_failed") from None
        finally:
            with self._lock:
                self._pending[tenant] -= 1

    def open(self, tenant: str, repo: Path | str, ref: str = "HEAD",
             network: bool = False) -> Workspace:
        """`acquire` as a `Workspace` (the agent's tools run on it unchanged); its `close()`
        releases the sandbox. What the `pool` backend (`pool.py`) opens."""
        return PooledWorkspace(self, self.acquire(tenant, repo, ref, "agent run"),
                               network=network)

    def release(self, sandbox_id: str) -> None:
        """Remove a sandbox: processes, mounts, directory, record. Unknown ids are a no-op."""
        with self._lock:
            box = self._live.pop(sandbox_id, None)
        if box is not None:
            self._destroy(box)

    # --- tenant-scoped lookups for the routes -------------------------------------------

    def get(self, tenant: str, sandbox_id: str) -> Sandbox:
        """The tenant's sandbox on this host; another tenant's is reported as absent (404),
        not as 403; one on another replica is a 409 naming it (410 once that one died)."""
        with self._lock:
            box = self._live.get(sandbox_id)
        if box is None or box.tenant != tenant:
            record = self._record(tenant, sandbox_id)
            if record["state"] == "gone":
                raise FleetError(410, f"sandbox {sandbox_id!r} is gone: the server holding it "
                                      "stopped", "sandbox_gone")
            raise FleetError(409, f"sandbox {sandbox_id!r} lives on server replica "
                                  f"{replica_label(record['owner'])}; send its requests there",
                             "sandbox_elsewhere")
        if self.shared is not None:
            self.shared.touch(sandbox_id)
        return box

    def list(self, tenant: str) -> list[Sandbox]:
        """The tenant's sandboxes on this host."""
        with self._lock:
            return [b for b in self._live.values() if b.tenant == tenant]

    def listed(self, tenant: str) -> list[dict[str, Any]]:
        """What the API lists: the tenant's sandboxes on every replica (this host's alone
        without the database), each with its state and replica."""
        if self.shared is None:
            return [self.view(b) for b in self.list(tenant)]
        return [self._record_view(r) for r in self.shared.list(tenant)]

    def describe(self, tenant: str, sandbox_id: str) -> dict[str, Any]:
        """One sandbox of the tenant as the API shows it, whichever replica holds it."""
        with self._lock:
            box = self._live.get(sandbox_id)
        if box is not None and box.tenant == tenant:
            return self.view(box)
        return self._record_view(self._record(tenant, sandbox_id))

    def _record(self, tenant: str, sandbox_id: str) -> dict[str, Any]:
        """The tenant's shared record of a sandbox; 404 when there is none (or no database:
        then only this host's sandboxes exist)."""
        record = self.shared.get(tenant, sandbox_id) if self.shared is not None else None
        if record is None:
            raise FleetError(404, f"no sandbox {sandbox_id!r}", "sandbox_not_found")
        return record

    def forget(self, tenant: str, sandbox_id: str) -> None:
        """Release the tenant's sandbox here, or drop the record of one that is gone;
        FleetError for one another live replica holds (only its host can remove it)."""
        try:
            box = self.get(tenant, sandbox_id)
        except FleetError as exc:
            if exc.status != 410 or not self.shared.forget(tenant, sandbox_id):
                raise
            return
        self.release(box.id)

    def view(self, box: Sandbox) -> dict[str, Any]:
        replica = replica_label(self.shared.replica.id) if self.shared is not None else None
        return {**box.describe(), "state": "active", "replica": replica}

    def _record_view(self, record: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            box = self._live.get(record["id"])
        if box is not None:
            return self.view(box)
        return {"id": record["id"], "repo": record["repo"], "ref": record["ref"],
                "commit": record["commit_sha"], "strategy": record["backend"],
                "created": record["created"], "holder": record["holder"],
                "state": record["state"], "replica": replica_label(record["owner"]),
                "last_used": record["last_used"]}

    def stats(self, tenant: str) -> dict[str, Any]:
        """What `tenant` may know of the fleet: totals over every pool (sizes, hits, hit
        rate: numbers only), and per pool only for repos the tenant holds a sandbox of (a
        pool's repo path or URL is another tenant's business)."""
        with self._lock:
            mine = {b.repo for b in self._live.values() if b.tenant == tenant}
            pools = [{"repo": repo, "commit": commit, **_pool_numbers([p])}
                     for (repo, commit), p in self._pools.items() if repo in mine]
            return {"strategy": self.strategy.name, "sandboxes": self._count(),
                    "totals": {"pools": len(self._pools),
                               **_pool_numbers(list(self._pools.values()))},
                    "pools": pools, "reaped_at_start": self.reaped}

    def start_exec(self, box: Sandbox, command: str,
                   timeout: float | None = None) -> Future[CommandResult]:
        """`exec` on the fleet's own workers; FleetError now if the command is malformed or
        the tenant already runs `max_execs_per_tenant` commands (429)."""
        if "\0" in command:
            raise FleetError(400, "the command contains a NUL byte", "invalid_command")
        return self._start(box, self.exec, box, command, timeout)

    def start_diff(self, box: Sandbox) -> Future[str]:
        """`diff` on the same workers under the same cap: it runs git in the sandbox, a
        command like any other, and a request thread must not wait on it."""
        return self._start(box, self.diff, box)

    def _start(self, box: Sandbox, fn: Callable[..., T], *args: Any) -> Future[T]:
        tenant = box.tenant or ""
        with self._lock:
            running = self._execs.get(tenant, 0)
            if running >= self.settings.max_execs_per_tenant:
                raise FleetError(429, f"tenant runs {running} commands; the limit is "
                                      f"{self.settings.max_execs_per_tenant} at once",
                                 "exec_quota_exceeded")
            self._execs[tenant] = running + 1
        try:
            future = self._exec_pool.submit(fn, *args)
        except RuntimeError:  # the fleet is closing
            self._exec_done(tenant)
            raise FleetError(503, "the server is shutting down", "sandbox_unavailable") from None
        future.add_done_callback(lambda _: self._exec_done(tenant))
        return future

    def _exec_done(self, tenant: str) -> None:
        with self._lock:
            self._execs[tenant] -= 1
            if not self._execs[tenant]:
                del self._execs[tenant]

    def exec(self, box: Sandbox, command: str, timeout: float | None = None) -> CommandResult:
        """A shell command in the sandbox, bounded by the fleet's limits and the tenant's
        remaining disk quota."""
        s = self.settings
        limits = Limits(timeout=min(timeout or s.max_timeout, s.max_timeout),
                        cpu_seconds=s.cpu_seconds, memory_bytes=s.memory_bytes,
                        processes=s.processes,
                        disk_bytes=max(1, self._disk_left(box.tenant or "")),
                        output_bytes=64 << 10)
        try:
            return box.runner().run(command, box.workspace, limits)
        except SandboxUnavailable as exc:  # overload or a broken host: the client may retry
            raise FleetError(503, str(exc), "sandbox_unavailable") from None

    def check_write(self, box: Sandbox, size: int) -> None:
        """Refuse a file write that would take the tenant past its disk quota."""
        if size > self.settings.max_file_bytes:
            raise FleetError(413, f"file is {size} bytes; the limit is "
                                  f"{self.settings.max_file_bytes}", "file_too_large")
        if size > self._disk_left(box.tenant or ""):
            raise FleetError(507, "the tenant's sandbox disk quota is used up",
                             "disk_quota_exceeded")

    def diff(self, box: Sandbox) -> str:
        """The sandbox's changes against its commit, untracked files included, as a patch.
        git runs inside the sandbox over a private repository (`treegit.py`): the tree,
        its `.git/config` included, is the tenant's."""
        try:
            change = treegit.diff(box.runner(), box.workspace, box.commit,
                                  self.settings.max_file_bytes)
        except SandboxUnavailable as exc:
            raise FleetError(503, str(exc), "sandbox_unavailable") from None
        except treegit.TreeGitError as exc:
            raise FleetError(422, f"diff failed: {exc}", "diff_failed") from None
        if change.patch is None:
            raise FleetError(413, f"the diff is {change.size} bytes; the limit is "
                                  f"{self.settings.max_file_bytes}. What changed:\n"
                                  f"{change.summary}", "diff_too_large")
        return change.patch

    def close(self) -> None:
        """Stop refilling and remove every sandbox this server made, pooled ones included."""
        self._exec_pool.shutdown(wait=False, cancel_futures=True)  # running ones die below
        with self._lock:
            self._closed = True
            self._wake.notify_all()
            boxes = list(self._live.values())
            boxes += [b for p in self._pools.values() for b in p.ready]
            self._live.clear()
            self._pools.clear()
        self._filler.join(timeout=60)
        for box in boxes:
            self._destroy(box)

    # --- internals ----------------------------------------------------------------------

    def _count(self) -> int:
        return (len(self._live) + sum(len(p.ready) for p in self._pools.values())
                + sum(self._pending.values()))

    def _check_quota(self, tenant: str) -> None:
        held = sum(1 for b in self._live.values() if b.tenant == tenant)
        held += self._pending.get(tenant, 0)
        if held >= self.settings.max_per_tenant:
            raise FleetError(429, f"tenant holds {held} sandboxes; the limit is "
                                  f"{self.settings.max_per_tenant}", "sandbox_quota_exceeded")

    def _check_capacity(self) -> None:
        if self._count() >= self.settings.max_sandboxes:
            raise FleetError(503, "the host is at its sandbox capacity", "fleet_full")

    def _disk_left(self, tenant: str) -> int:
        used = sum(_disk_added(b) for b in self.list(tenant))
        return self.settings.disk_per_tenant - used

    def source(self, repo: Path | str) -> Path:
        """Where `repo`'s sandboxes are cloned from: a path as it is; a URL (checked against
        `repo_urls`) as its local mirror, fetched when older than `fetch_ttl`, one fetch per
        URL at a time."""
        if isinstance(repo, Path):
            return repo
        try:
            url = urlfetch.check(repo, self.repo_urls)
        except urlfetch.URLRefused as exc:
            raise FleetError(exc.status, str(exc), exc.code) from None
        key = hashlib.sha256(url.encode()).hexdigest()[:24]
        mirror = self.remotes / f"{key}.git"
        with self._lock:
            lock = self._base_locks.setdefault(f"url:{key}", threading.Lock())
        with lock:
            fetched = self._fetched.get(url)
            if fetched is None or time.monotonic() - fetched > self.settings.fetch_ttl \
                    or not mirror.is_dir():
                try:
                    urlfetch.fetch(url, mirror, self._tmp(self.remotes, key),
                                 self.settings.fetch_bytes, self.settings.fetch_timeout)
                except urlfetch.FetchFailed as exc:
                    if exc.status == 413 or not mirror.is_dir():
                        raise FleetError(exc.status, str(exc), exc.code) from None
                    # the server is down or slow: the last fetch still serves (until the
                    # next TTL), rather than no sandbox at all
                    log.warning("refetch of %s failed, using the cached mirror: %s", url, exc)
                self._fetched[url] = time.monotonic()
        return mirror

    def _make(self, source: Path, repo: str, ref: str, commit: str,
              tenant: str | None, holder: str = "api") -> Sandbox:
        base = self.base(source, commit)
        sandbox_id = "sb_" + secrets.token_hex(8)
        box = Sandbox(id=sandbox_id, repo=repo, ref=ref, commit=commit,
                      path=self.boxes / sandbox_id, strategy=self.strategy.name, tenant=tenant,
                      holder=holder, cgroup=SandboxCgroup(self.settings.memory_bytes,
                                                          self.settings.processes))
        reaper.Record(box.id, str(box.path), self.owner).write(self.records)
        try:
            self.strategy.make(base, box.path)
            if self.shared is not None:
                self.shared.add(box.id, tenant, self.strategy.name, repo, ref, commit, holder)
        except BaseException:
            self._destroy(box)
            raise
        with self._lock:
            if tenant is not None:
                self._live[box.id] = box
        return box

    def _destroy(self, box: Sandbox) -> None:
        reaper.reap(box.path)
        (self.records / f"{box.id}.json").unlink(missing_ok=True)
        if self.shared is not None:
            self.shared.remove(box.id)

    def base(self, repo: Path, commit: str) -> Path:
        """The cached checkout of repo at commit, built once (under a per-key lock) into a
        temporary directory named for its owner, then renamed into place. `--no-local`: the
        objects arrive as one pack of what the commits need, so the base shares no file with
        the repository and borrows nothing through alternates (git inside a sandbox, which
        sees only its own tree, finds every object)."""
        key = hashlib.sha256(f"{repo}\0{commit}".encode()).hexdigest()[:24]
        final = self.bases / key
        with self._lock:
            lock = self._base_locks.setdefault(key, threading.Lock())
        with lock:
            if final.is_dir():
                return final
            tmp = self._tmp(self.bases, key)
            clone.teardown(tmp)
            clone.run_checked(["git", *clone.SAFE_GIT, "clone", "--quiet", "--no-local",
                               "--no-checkout", "--", str(repo), str(tmp)])
            clone.run_checked(["git", *clone.SAFE_GIT, "-C", str(tmp), "checkout", "--quiet",
                               "--detach", commit])
            os.replace(tmp, final)
            return final

    def _tmp(self, parent: Path, key: str) -> Path:
        """A directory being built, named for its owner so a restart can tell it is dead."""
        return parent / f".tmp-{self.owner.pid}-{self.owner.start}-{key}"

    def _sweep_partial_bases(self) -> None:
        for tmp in [*self.bases.glob(".tmp-*"), *self.remotes.glob(".tmp-*")]:
            pid, start = tmp.name.split("-")[1:3]
            if not reaper.Owner(int(pid), int(start)).alive():
                try:
                    reaper.reap(tmp)
                except OSError as exc:  # logged; the next start tries again
                    log.error("could not remove %s left by a dead server: %s", tmp, exc)

    def _fill(self) -> None:
        """Background: top every pool up to its target, one sandbox at a time."""
        while True:
            with self._lock:
                while not self._closed and (want := self._wanted()) is None:
                    self._wake.wait(timeout=5)
                if self._closed:
                    return
            key, pool = want
            try:
                box = self._make(pool.source, key[0], "HEAD", key[1], tenant=None)
            except (clone.CloneError, OSError, DatabaseError) as exc:
                log.warning("pool refill for %s failed: %s", key[0], exc)
                with self._lock:
                    self._pools.pop(key, None)  # asked again, it is rebuilt
                continue
            with self._lock:
                pool = self._pools.get(key)
                if pool is None or self._closed:
                    orphan = box
                else:
                    pool.ready.append(box)
                    orphan = None
            if orphan is not None:
                self._destroy(orphan)

    def _wanted(self) -> tuple[tuple[str, str], Pool] | None:
        if self._count() >= self.settings.max_sandboxes:
            return None
        for key, pool in self._pools.items():
            if len(pool.ready) < pool.target:
                return key, pool
        return None


def replica_label(replica_id: str) -> str:
    """A replica as tenants see it: a stable opaque label (its id names the host and pid,
    which are the operator's business)."""
    return "r-" + hashlib.sha256(replica_id.encode()).hexdigest()[:12]


def _pool_numbers(pools: list[Pool]) -> dict[str, Any]:
    hits, misses = sum(p.hits for p in pools), sum(p.misses for p in pools)
    return {"target": sum(p.target for p in pools), "ready": sum(len(p.ready) for p in pools),
            "hits": hits, "misses": misses, "hit_rate": round(hits / max(1, hits + misses), 3)}


def resolve(repo: Path, ref: str) -> str:
    """The commit `ref` names in `repo` (a git directory or bundle); FleetError otherwise.
    The ref is passed after --end-of-options, so `--upload-pack=...` is a name, not a flag."""
    if not ref or ref.startswith("-") or "\0" in ref or len(ref) > 256:
        raise FleetError(400, f"invalid ref {ref!r}", "invalid_ref")
    if repo.is_file():  # a bundle: its heads are listed without unpacking it
        out = _git(["bundle", "list-heads", str(repo)], repo.parent)
        for line in out.splitlines():
            sha, _, name = line.partition(" ")
            if name in (ref, f"refs/heads/{ref}", f"refs/tags/{ref}") or sha == ref:
                return sha
        raise FleetError(400, f"ref {ref!r} is not in the bundle", "unknown_ref")
    return _git(["rev-parse", "--verify", "--quiet", "--end-of-options", f"{ref}^{{commit}}"],
                repo).strip()


def _git(args: list[str], cwd: Path) -> str:
    proc = subprocess.run(["git", *clone.SAFE_GIT, *args], cwd=cwd, capture_output=True,
                          text=True, timeout=60, check=False,
                          env={**clone.git_env(), "GIT_CEILING_DIRECTORIES": str(cwd.parent)})
    if proc.returncode != 0:
        raise FleetError(400, f"not a git repository or unknown ref in {cwd.name}: "
                              f"{proc.stderr.strip()[:300] or 'no such commit'}", "unknown_ref")
    return proc.stdout


def _disk_added(box: Sandbox) -> int:
    """Bytes this sandbox added: its overlay upper layer, or its whole tree otherwise.
    `du` rather than `os.walk`, which recurses on Python 3.11 (a 1,000-deep directory raised
    RecursionError) and cannot reach past PATH_MAX; du does both."""
    top = box.path / "upper" if (box.path / "upper").is_dir() else box.workspace
    done = subprocess.run(["du", "-s", "-x", "-B1", "--", str(top)], capture_output=True,
                          text=True, timeout=300, check=False)
    try:  # an unreadable entry makes du fail but still print the total of the rest
        return int(done.stdout.split()[0])
    except (IndexError, ValueError):
        return 0

