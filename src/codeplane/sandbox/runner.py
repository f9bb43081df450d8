"""Command runners: `BwrapRunner` (the default) and `HostRunner` (only behind --no-sandbox).

A bubblewrap sandbox mounts the workspace read-write (its `.git` read-only), the system
read-only, a private /tmp and /dev, a fresh /proc, and unshares every namespace (so no network
unless asked). Limits come
from `prlimit` (CPU seconds, address space, file size, open files) plus a pids cgroup per
command, because the kernel exempts uid 0 from RLIMIT_NPROC: as root only the pids controller
contains a fork bomb. A wall-clock timeout SIGKILLs the process group, every pid in the cgroup,
and (through --die-with-parent and the pid namespace) everything the command started.

Output is merged stdout+stderr; the first and last halves of `output_bytes` are kept with a note
of what was omitted, and a command printing more than `drain_bytes` is killed.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

_GRACE = 0.5  # seconds to keep reading after the command exits (descendants may hold the pipe)


class SandboxUnavailable(RuntimeError):
    """No sandbox can be created here; callers fail closed instead of running bare."""


@dataclass(frozen=True)
class Limits:
    timeout: float = 120.0
    cpu_seconds: int = 300
    memory_bytes: int = 4 << 30
    processes: int = 256
    file_bytes: int = 1 << 30
    open_files: int = 1024
    output_bytes: int = 32 << 10
    drain_bytes: int = 64 << 20
    network: bool = False


@dataclass
class CommandResult:
    command: str
    exit_code: int | None
    output: str
    seconds: float
    killed: str | None = None  # "timeout" | "output" | "cancelled"
    truncated: bool = False
    sandboxed: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Runner(Protocol):
    sandboxed: bool

    def run(self, command: str, cwd: Path, limits: Limits,
            cancel: threading.Event | None = None) -> CommandResult: ...

    def describe(self) -> dict[str, Any]: ...


class BwrapRunner:
    """Commands in a bubblewrap sandbox rooted at one workspace."""

    sandboxed = True

    def __init__(self, workspace: Path, bwrap: str | None = None) -> None:
        self.workspace = workspace.resolve()
        self.bwrap = bwrap or shutil.which("bwrap")
        self.check()

    def check(self) -> None:
        """Probe once: raise SandboxUnavailable with the reason and the way out."""
        hint = "install bubblewrap (apt-get install bubblewrap) or pass --no-sandbox to run " \
               "commands unsandboxed on the host"
        if not self.bwrap or not Path(self.bwrap).exists():
            raise SandboxUnavailable(f"bubblewrap (bwrap) is not installed; {hint}")
        if not shutil.which("prlimit"):
            raise SandboxUnavailable("prlimit (util-linux) is missing, so resource limits "
                                     "cannot be enforced; install util-linux")
        if os.geteuid() == 0 and _pids_cgroup_base() is None:
            raise SandboxUnavailable("running as root without a writable pids cgroup, so "
                                     "process limits (fork bombs) cannot be enforced; run as "
                                     "a normal user or pass --no-sandbox")
        probe = subprocess.run(self._argv("true", self.workspace, Limits()), env=_env(),
                               capture_output=True, timeout=20, check=False)
        if probe.returncode != 0:
            reason = probe.stderr.decode(errors="replace").strip() or f"exit {probe.returncode}"
            raise SandboxUnavailable(f"bubblewrap cannot create a sandbox here ({reason}); "
                                     f"{hint}")

    def run(self, command: str, cwd: Path, limits: Limits,
            cancel: threading.Event | None = None) -> CommandResult:
        return supervise(self._argv(command, cwd, limits), command, self.workspace, _env(),
                         limits, cancel, sandboxed=True)

    def describe(self) -> dict[str, Any]:
        return {"runner": "bwrap", "bwrap": self.bwrap, "workspace": str(self.workspace)}

    def _argv(self, command: str, cwd: Path, limits: Limits) -> list[str]:
        args = [str(self.bwrap), "--die-with-parent", "--new-session", "--unshare-all",
                "--cap-drop", "ALL"]
        if limits.network:
            args.append("--share-net")
        for top in ("/usr", "/etc", "/opt"):
            if Path(top).is_dir():
                args += ["--ro-bind", top, top]
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
            if Path(top).is_symlink():
                args += ["--symlink", os.readlink(top), top]
            elif Path(top).is_dir():
                args += ["--ro-bind", top, top]
        for prefix in sorted({sys.base_prefix, sys.prefix}):  # the Python tests run with
            if not prefix.startswith("/usr"):
                args += ["--ro-bind", prefix, prefix]
        args += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
                 "--bind", str(self.workspace), str(self.workspace),
                 *_readonly_git(self.workspace),
                 "--chdir", str(cwd), "--setenv", "HOME", "/tmp"]
        return args + ["--", "/bin/sh", "-c", command]


def _readonly_git(workspace: Path) -> list[str]:
    """`.git` read-only, as Codex does: a hook planted there would later run on the host."""
    git = workspace / ".git"
    return ["--ro-bind", str(git), str(git)] if git.is_dir() and not git.is_symlink() else []


class HostRunner:
    """Commands straight on the host: same limits and timeout, no isolation."""

    sandboxed = False

    def __init__(self, workspace: Path) -> None:
        self.workspace = workspace.resolve()

    def run(self, command: str, cwd: Path, limits: Limits,
            cancel: threading.Event | None = None) -> CommandResult:
        env = {**_env(), "HOME": os.environ.get("HOME", "/tmp")}
        return supervise(["/bin/sh", "-c", command], command, cwd, env, limits, cancel,
                         sandboxed=False)

    def describe(self) -> dict[str, Any]:
        return {"runner": "host", "workspace": str(self.workspace)}


def supervise(argv: list[str], command: str, cwd: Path, env: dict[str, str], limits: Limits,
              cancel: threading.Event | None, sandboxed: bool) -> CommandResult:
    """Run argv under limits; collect capped output; kill everything on timeout/cancel."""
    cgroup = _PidsCgroup.create(limits.processes)
    prefix = cgroup.wrapper() if cgroup else []
    argv = prefix + _prlimit(limits) + argv
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    capture = _Capture(limits.output_bytes)
    killed = None
    try:
        killed = _pump(proc, capture, limits, cancel, start, cgroup)
    finally:
        _kill(proc, cgroup)
        proc.wait()
        proc.stdout.close()
        if cgroup:
            cgroup.remove()
    code = None if killed else proc.returncode
    return CommandResult(command=command, exit_code=code, output=capture.text(),
                         seconds=round(time.monotonic() - start, 3), killed=killed,
                         truncated=capture.omitted > 0, sandboxed=sandboxed)


def _pump(proc: subprocess.Popen, capture: _Capture, limits: Limits,
          cancel: threading.Event | None, start: float, cgroup: _PidsCgroup | None) -> str | None:
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    killed: str | None = None
    exited_at: float | None = None
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            now = time.monotonic()
            if killed is None:
                if cancel is not None and cancel.is_set():
                    killed = "cancelled"
                elif now - start >= limits.timeout:
                    killed = "timeout"
                elif capture.total > limits.drain_bytes:
                    killed = "output"
                if killed:
                    _kill(proc, cgroup)
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > _GRACE:
                return killed
            if sel.select(timeout=0.05):
                try:
                    chunk = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not chunk:
                    proc.wait()
                    return killed
                capture.add(chunk)


def _kill(proc: subprocess.Popen, cgroup: _PidsCgroup | None) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if cgroup:
        cgroup.kill()


def _prlimit(limits: Limits) -> list[str]:
    return ["prlimit", f"--cpu={limits.cpu_seconds}", f"--as={limits.memory_bytes}",
            f"--nproc={limits.processes}", f"--fsize={limits.file_bytes}",
            f"--nofile={limits.open_files}", "--core=0", "--"]


def _env() -> dict[str, str]:
    path = f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"
    return {"PATH": path, "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8", "TERM": "dumb",
            "PAGER": "cat", "GIT_PAGER": "cat", "PYTHONDONTWRITEBYTECODE": "1"}


class _Capture:
    """Keeps the first and last halves of `limit` bytes and counts what falls between."""

    def __init__(self, limit: int) -> None:
        self.half = max(limit // 2, 1)
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    @property
    def omitted(self) -> int:
        return max(self.total - len(self.head) - len(self.tail), 0)

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.half - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            del self.tail[:-self.half]

    def text(self) -> str:
        if not self.omitted:
            return (self.head + self.tail).decode(errors="replace")
        note = f"\n[... {self.omitted} bytes of output omitted ...]\n"
        return self.head.decode(errors="replace") + note + self.tail.decode(errors="replace")


def _pids_cgroup_base() -> Path | None:
    """A writable pids-controller directory (cgroup v1 `pids` or v2 with pids delegated)."""
    for base, v2 in ((Path("/sys/fs/cgroup/pids"), False), (Path("/sys/fs/cgroup"), True)):
        if not (base / "cgroup.procs").exists():
            continue
        if v2 and "pids" not in _read(base / "cgroup.subtree_control").split():
            continue
        parent = base / "codeplane-sandbox"
        try:
            parent.mkdir(exist_ok=True)
            if v2 and "pids" not in _read(parent / "cgroup.subtree_control").split():
                (parent / "cgroup.subtree_control").write_text("+pids")
        except OSError:
            continue
        return parent
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


class _PidsCgroup:
    """One pids cgroup per command; the wrapper joins it before exec, so no child escapes."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def create(cls, max_pids: int) -> _PidsCgroup | None:
        base = _pids_cgroup_base()
        if base is None:
            return None
        path = base / f"cmd-{uuid.uuid4().hex[:12]}"
        try:
            path.mkdir()
            (path / "pids.max").write_text(str(max_pids))
        except OSError:
            return None
        return cls(path)

    def wrapper(self) -> list[str]:
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs")]

    def kill(self) -> None:
        for pid in _read(self.path / "cgroup.procs").split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, PermissionError, ValueError):
                pass

    def remove(self) -> None:
        deadline = time.monotonic() + 2
        while True:
            self.kill()
            try:
                self.path.rmdir()
                return
            except OSError:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.02)
