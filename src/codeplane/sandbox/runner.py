"""Command runners: `BwrapRunner` (the default) and `HostRunner` (only behind --no-sandbox).

A bubblewrap sandbox mounts the workspace read-write (every `.git` in it read-only, see
`gitguard.py`), the system read-only with a minimal /etc (no shadow, no ssh keys, a passwd of
its own), a private /dev, a fresh /proc with the host's kernel settings read-only and its
keyrings and timers hidden, and a private /tmp that is a size-limited tmpfs; every namespace
is unshared. Commands run as uid `SANDBOX_UID` of a user namespace of their own, mapped to the
server's uid (the only uid there: files they write belong to the server's user), with no
capabilities and no further user namespaces. Network, when asked for, is a user-mode stack
(slirp4netns) with the host's loopback disabled, so a sandboxed command cannot reach the server
or any other service bound to 127.0.0.1. Memory and processes are bounded per sandbox by a
cgroup (`cgroups.py`; the kernel exempts root from RLIMIT_NPROC, so as root the sandbox is
refused without a pids cgroup), CPU seconds, address space, file size and open files per
process by `prlimit`. `--fsize` bounds each file, not the disk, so a watchdog kills a command
once the workspace's filesystem has grown by more than `disk_bytes`. A wall-clock timeout
SIGKILLs the process group, every pid in the command's cgroup, and (through --die-with-parent
and the pid namespace) everything the command started.

Output is merged stdout+stderr; the first and last halves of `output_bytes` are kept with a note
of what was omitted, and a command printing more than `drain_bytes` is killed.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from codeplane.sandbox import cgroups
from codeplane.sandbox.gitguard import GitGuard

_GRACE = 0.5  # seconds to keep reading after the command exits (descendants may hold the pipe)
_NS_GET_USERNS = 0xB701  # ioctl: the user namespace that owns a namespace (linux/nsfs.h)
_DISK_POLL = 0.2  # seconds between two looks at the workspace's filesystem
# What programs need from /etc (dynamic linker, users, name resolution, TLS roots, the
# Debian alternatives symlinks, time zone, MIME and magic databases); never shadow, ssh, pip
# or apt credentials. Missing entries are skipped (--ro-bind-try).
_ETC = ("passwd", "group", "hosts", "hostname", "nsswitch.conf", "resolv.conf", "host.conf",
        "gai.conf", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "ssl", "ca-certificates",
        "ca-certificates.conf", "alternatives", "localtime", "timezone", "os-release",
        "debian_version", "lsb-release", "mime.types", "magic", "magic.mime", "protocols",
        "services", "networks", "gitconfig", "fonts", "terminfo", "perl", "python3",
        "python3.11", "python3.12", "python3.13", "mtab", "inputrc", "bash.bashrc", "profile",
        "environment", "locale.alias")
SANDBOX_UID = 1000  # the uid (and gid) commands run as, in a user namespace of their own
# the sandbox's own passwd and group: the host's user names are none of its business
_PASSWD = f"root:x:0:0:root:/root:/bin/sh\nsandbox:x:{SANDBOX_UID}:{SANDBOX_UID}::/tmp:/bin/sh\n" \
          "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
_GROUP = f"root:x:0:\nsandbox:x:{SANDBOX_UID}:\nnogroup:x:65534:\n"
# /proc entries that act on or describe the host, not the sandbox (the lists container
# runtimes use): kernel settings read-only (the sandbox's uid is the server's, and the kernel
# lets a sysctl's owner write it without any capability), the rest hidden. bwrap covers only
# irq and bus itself, and only when it can tell they are writable.
_PROC_READ_ONLY = ("sys", "sysrq-trigger", "irq", "bus", "fs")
_PROC_HIDDEN = ("kcore", "keys", "key-users", "timer_list", "timer_stats", "sched_debug",
                "latency_stats", "acpi", "asound", "scsi")


class SandboxUnavailable(RuntimeError):
    """No sandbox can be created here; callers fail closed instead of running bare."""


@dataclass(frozen=True)
class Limits:
    timeout: float = 120.0
    cpu_seconds: int = 300  # per process
    memory_bytes: int = 4 << 30  # the sandbox's (its cgroup), and each process's address space
    processes: int = 256  # the sandbox's (its pids cgroup), and RLIMIT_NPROC
    file_bytes: int = 1 << 30
    open_files: int = 1024
    output_bytes: int = 32 << 10
    drain_bytes: int = 64 << 20
    network: bool = False
    tmp_bytes: int = 1 << 30  # size of the private /tmp (a tmpfs: it is memory)
    disk_bytes: int = 8 << 30  # growth of the workspace's filesystem before the command dies


@dataclass
class CommandResult:
    command: str
    exit_code: int | None
    output: str
    seconds: float
    killed: str | None = None  # "timeout" | "output" | "cancelled" | "disk"
    truncated: bool = False
    sandboxed: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Runner(Protocol):
    sandboxed: bool

    def run(self, command: str, cwd: Path, limits: Limits,
            cancel: threading.Event | None = None) -> CommandResult: ...

    def exec(self, argv: list[str], cwd: Path, limits: Limits,
             stderr: bool = False) -> CommandResult: ...

    def describe(self) -> dict[str, Any]: ...


class _Session:
    """Hooks a runner adds around the generic supervisor (network setup, watchdogs, notes)."""

    pass_fds: tuple[int, ...] = ()

    def started(self, proc: subprocess.Popen) -> None:
        """Called right after the process is spawned."""

    def poll(self) -> str | None:
        """Called every loop turn; a kill reason, or None to keep going."""
        return None

    def close(self) -> str:
        """Called once everything the command started is dead; a note for the output."""
        return ""


class BwrapRunner:
    """Commands in a bubblewrap sandbox rooted at one workspace. The runner is the sandbox
    its commands share a cgroup in, unless it is given one: the runners of one fleet sandbox
    (with network and without) share the sandbox's."""

    sandboxed = True
    probe_seconds = 20.0  # a sandbox that cannot start in this long is reported unavailable

    def __init__(self, workspace: Path, bwrap: str | None = None, network: bool = False,
                 cgroup: cgroups.SandboxCgroup | None = None) -> None:
        self.workspace = workspace.resolve()
        self.bwrap = bwrap or shutil.which("bwrap")
        self.unshare = shutil.which("unshare")
        self.slirp = shutil.which("slirp4netns")
        self.scratch = _scratch_mountpoint()
        self.cgroup = cgroup or cgroups.SandboxCgroup()
        self.check(network)

    def check(self, network: bool = False) -> None:
        """Probe once: raise SandboxUnavailable with the reason and the way out."""
        hint = "install bubblewrap (apt-get install bubblewrap) or pass --no-sandbox to run " \
               "commands unsandboxed on the host"
        if not self.bwrap or not Path(self.bwrap).exists():
            raise SandboxUnavailable(f"bubblewrap (bwrap) is not installed; {hint}")
        if not shutil.which("prlimit") or not self.unshare or not shutil.which("mount"):
            raise SandboxUnavailable("prlimit, unshare or mount (util-linux) is missing, so "
                                     "resource limits cannot be enforced; install util-linux")
        if os.geteuid() == 0 and "pids" not in self.cgroup.layout.controllers:
            raise SandboxUnavailable("running as root without a writable pids cgroup, so "
                                     "process limits (fork bombs) cannot be enforced "
                                     f"({self.cgroup.layout.note}); run as a normal user or "
                                     "pass --no-sandbox")
        if network and not self.slirp:
            raise SandboxUnavailable("network access in the sandbox needs slirp4netns (a "
                                     "user-mode network stack that keeps the host's loopback "
                                     "unreachable); install it (apt-get install slirp4netns) "
                                     "or run without network")
        try:
            probe = subprocess.run(self._argv(["true"], self.workspace, Limits(),
                                              writable=False),
                                   env=_env(), capture_output=True, timeout=self.probe_seconds,
                                   check=False)
        except subprocess.TimeoutExpired:
            raise SandboxUnavailable(f"bubblewrap did not start a sandbox within "
                                     f"{self.probe_seconds:g} s (the host is overloaded); try "
                                     "again later") from None
        if probe.returncode != 0:
            reason = probe.stderr.decode(errors="replace").strip() or f"exit {probe.returncode}"
            raise SandboxUnavailable(f"bubblewrap cannot create a sandbox here ({reason}); "
                                     f"{hint}")

    def run(self, command: str, cwd: Path, limits: Limits,
            cancel: threading.Event | None = None) -> CommandResult:
        """A shell command with the workspace writable, its `.git`s protected."""
        if limits.network and not self.slirp:
            self.check(network=True)  # raises with the reason
        guard = GitGuard(self.workspace)
        session = _Sandboxed(self.workspace, limits, guard, self.slirp)
        argv = self._argv(["/bin/sh", "-c", command], cwd, limits, writable=True,
                          guard=guard, fds=session.fds())
        return supervise(argv, command, self.workspace, _env(), limits, cancel,
                         sandboxed=True, session=session, cgroup=self.cgroup)

    def exec(self, argv: list[str], cwd: Path, limits: Limits,
             stderr: bool = False) -> CommandResult:
        """A trusted host program (ripgrep, ruff) over a read-only workspace, stdout (and
        stderr if asked): whatever it reads, it runs inside the sandbox, never on the host."""
        limits = dataclasses.replace(limits, network=False)
        return supervise(self._argv(argv, cwd, limits, writable=False), " ".join(argv),
                         self.workspace, _env(), limits, None, sandboxed=True, stderr=stderr,
                         cgroup=self.cgroup)

    def describe(self) -> dict[str, Any]:
        return {"runner": "bwrap", "bwrap": self.bwrap, "workspace": str(self.workspace),
                "uid": SANDBOX_UID, "cgroups": self.cgroup.layout.version}

    def _argv(self, argv: list[str], cwd: Path, limits: Limits, writable: bool,
              guard: GitGuard | None = None, fds: tuple[int, int] | None = None) -> list[str]:
        args = [str(self.bwrap), "--die-with-parent", "--new-session", "--unshare-all",
                "--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
                *_no_nested_userns(str(self.bwrap), self.probe_seconds), "--cap-drop", "ALL"]
        if fds:  # network: bwrap reports the sandbox's pid, then waits until slirp is ready
            args += ["--info-fd", str(fds[0]), "--block-fd", str(fds[1])]
        for top in ("/usr", "/opt"):
            if Path(top).is_dir():
                args += ["--ro-bind", top, top]
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
            if Path(top).is_symlink():
                args += ["--symlink", os.readlink(top), top]
            elif Path(top).is_dir():
                args += ["--ro-bind", top, top]
        for name in _ETC:
            if name not in ("passwd", "group"):
                args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
        args += ["--ro-bind", f"{self.scratch}/etc/passwd", "/etc/passwd",
                 "--ro-bind", f"{self.scratch}/etc/group", "/etc/group"]
        # /tmp first, then what may live under it (a virtualenv, the workspace): a mount
        # made later hides whatever an earlier one put at the same place. /tmp and /dev/shm
        # share the sized tmpfs; bwrap's own tmpfs for / and /dev (unbounded) become
        # read-only at the end.
        args += ["--dev", "/dev", "--proc", "/proc", *self._proc_masks(),
                 "--bind", f"{self.scratch}/tmp", "/tmp",
                 "--bind", f"{self.scratch}/shm", "/dev/shm", "--remount-ro", "/dev"]
        for prefix in sorted({sys.base_prefix, sys.prefix}):  # the Python tests run with
            if not prefix.startswith("/usr"):
                args += ["--ro-bind", prefix, prefix]
        if argv[0].startswith("/") and not argv[0].startswith("/usr/"):
            args += ["--ro-bind", argv[0], argv[0]]  # the program itself, wherever it lives
        args += ["--bind" if writable else "--ro-bind", str(self.workspace), str(self.workspace)]
        args += guard.binds() if guard else []
        args += ["--remount-ro", "/", "--chdir", str(cwd), "--setenv", "HOME", "/tmp", "--",
                 *argv]
        return self._private_tmp(limits) + args

    def _proc_masks(self) -> list[str]:
        """After `--proc`: the host's kernel settings read-only (bound from the host's /proc:
        what a sysctl shows follows the reader's namespaces, not the mount), and what
        describes the host hidden (files behind /dev/null, directories behind an empty one)."""
        args = []
        for name in _PROC_READ_ONLY:
            if _exists(f"/proc/{name}"):
                args += ["--ro-bind", f"/proc/{name}", f"/proc/{name}"]
        for name in _PROC_HIDDEN:
            if _exists(f"/proc/{name}"):
                empty = f"{self.scratch}/empty" if Path(f"/proc/{name}").is_dir() else "/dev/null"
                args += ["--ro-bind", empty, f"/proc/{name}"]
        return args

    def _private_tmp(self, limits: Limits) -> list[str]:
        """A mount namespace of our own holding a tmpfs over the scratch directory: its tmp/
        and shm/ are bound as /tmp and /dev/shm, etc/ holds the sandbox's passwd and group,
        empty/ hides directories of /proc. Its size is `tmp_bytes`, at most the memory limit
        (it is memory; the sandbox's memory cgroup is charged for what is written). bwrap 0.8
        (Debian 12) has no --size for its own tmpfs; the namespace dies with the command, so
        nothing needs unmounting."""
        user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
        mount = 'mount -t tmpfs -o "size=$1,mode=755" codeplane-tmp "$2" && ' \
                'mkdir -m 1777 "$2/tmp" "$2/shm" "$2/empty" "$2/etc" && ' \
                'printf %s "$3" > "$2/etc/passwd" && printf %s "$4" > "$2/etc/group" && ' \
                'shift 4 && exec "$@"'
        size = min(limits.tmp_bytes, limits.memory_bytes)
        return [str(self.unshare), "--mount", "--propagation", "private", *user, "--",
                "/bin/sh", "-c", mount, "sh", str(size), str(self.scratch), _PASSWD, _GROUP]


@functools.cache
def _no_nested_userns(bwrap: str, timeout: float) -> list[str]:
    """`--disable-userns` where this bwrap has it (0.8; Ubuntu 22.04 ships 0.6, which still
    runs sandboxes, whose commands can then make user namespaces of their own)."""
    try:
        usage = subprocess.run([bwrap, "--help"], capture_output=True, text=True,
                               timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):  # the start-up probe reports what is wrong
        return []
    return ["--disable-userns"] if "--disable-userns" in usage.stdout + usage.stderr else []


@functools.cache
def _exists(path: str) -> bool:
    """Whether the host has this /proc entry (the kernel's build decides; it never changes)."""
    return Path(path).exists()


def _scratch_mountpoint() -> Path:
    """An empty host directory the private /tmp is mounted over (inside a private mount
    namespace only: on the host it stays empty)."""
    path = Path(tempfile.gettempdir()) / f"codeplane-sandbox-{os.geteuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    if path.is_symlink() or path.stat().st_uid != os.geteuid():
        raise SandboxUnavailable(f"{path} is not a directory owned by this user")
    return path


class _Sandboxed(_Session):
    """A writable sandbox run: the disk-quota watchdog, the `.git` guard and, when network
    is on, slirp4netns started on the sandbox's network namespace before the command runs."""

    def __init__(self, workspace: Path, limits: Limits, guard: GitGuard,
                 slirp: str | None) -> None:
        self.workspace, self.limits, self.guard = workspace, limits, guard
        self.disk_start = _disk_used(workspace)
        self.next_look = 0.0
        self.slirp_proc: subprocess.Popen | None = None
        self.pipes: tuple[int, int, int, int] | None = None
        if limits.network and slirp:
            self.slirp = slirp
            info_r, info_w = os.pipe()
            block_r, block_w = os.pipe()
            self.pipes = (info_r, info_w, block_r, block_w)
            self.pass_fds = (info_w, block_r)

    def fds(self) -> tuple[int, int] | None:
        return (self.pipes[1], self.pipes[2]) if self.pipes else None

    def started(self, proc: subprocess.Popen) -> None:
        if not self.pipes:
            return
        info_r, info_w, block_r, block_w = self.pipes
        self.pipes = None
        os.close(info_w)
        os.close(block_r)
        try:
            with os.fdopen(info_r, "rb") as info:
                pid = json.loads(info.read() or b"{}").get("child-pid")
            if pid:
                self.slirp_proc = _start_slirp(self.slirp, int(pid))
        finally:
            os.close(block_w)  # releases the command (bwrap exits if slirp failed to start)

    def poll(self) -> str | None:
        now = time.monotonic()
        if now < self.next_look:
            return None
        self.next_look = now + _DISK_POLL
        if _disk_used(self.workspace) - self.disk_start > self.limits.disk_bytes:
            return "disk"
        return None

    def close(self) -> str:
        for fd in self.pipes or ():  # the command never started
            os.close(fd)
        notes = [self.guard.neutralise()]
        if self.slirp_proc:
            self.slirp_proc.kill()
            self.slirp_proc.wait()
        elif self.limits.network:
            notes.append("[codeplane: the sandbox's network (slirp4netns) did not start; the "
                         "command ran without network]")
        return "\n".join(n for n in notes if n)


def _start_slirp(slirp: str, pid: int) -> subprocess.Popen | None:
    """slirp4netns on the sandbox's network namespace, without a path to the host's
    loopback (10.0.2.2 is not forwarded to 127.0.0.1); None if it did not come up.
    It starts once bwrap has set up the namespace's loopback: configuring both at once
    makes bwrap fail ("loopback: Failed RTM_NEWADDR").

    slirp4netns joins the user namespace that owns the network namespace, asked of the
    kernel (NS_GET_USERNS), never the sandbox process's own: with `--disable-userns` bwrap
    moves that process into a nested user namespace moments later, which has no say over
    the network namespace, and slirp4netns joining it fails with `setns(CLONE_NEWNET):
    Operation not permitted` (about 1 start in 30 before this)."""
    deadline = time.monotonic() + 10
    while "127.0.0.1" not in cgroups.read_or_empty(Path(f"/proc/{pid}/net/fib_trie")):
        if time.monotonic() > deadline or not Path(f"/proc/{pid}").exists():
            return None
        time.sleep(0.005)
    try:
        netns = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # the sandbox is already gone
        return None
    userns = fcntl.ioctl(netns, _NS_GET_USERNS)
    ready_r, ready_w = os.pipe()
    try:
        proc = subprocess.Popen([slirp, "--configure", "--mtu=65520", "--disable-host-loopback",
                                 "--ready-fd", str(ready_w), f"--userns-path=/proc/self/fd/{userns}",
                                 "--netns-type=path", f"/proc/self/fd/{netns}", "tap0"],
                                pass_fds=(ready_w, netns, userns), stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    finally:
        for fd in (ready_w, netns, userns):
            os.close(fd)
    with selectors.DefaultSelector() as sel:
        sel.register(ready_r, selectors.EVENT_READ)
        ready = bool(sel.select(timeout=10)) and os.read(ready_r, 1) == b"1"
    os.close(ready_r)
    if not ready:
        proc.kill()
        proc.wait()
        return None
    return proc


def _disk_used(path: Path) -> int:
    """Bytes in use on the filesystem holding `path` (ext4 counts delayed allocations)."""
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


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

    def exec(self, argv: list[str], cwd: Path, limits: Limits,
             stderr: bool = False) -> CommandResult:
        """The same trusted program as BwrapRunner.exec, on the host (--no-sandbox)."""
        env = {**_env(), "HOME": os.environ.get("HOME", "/tmp")}
        return supervise(argv, " ".join(argv), cwd, env, limits, None, sandboxed=False,
                         stderr=stderr)

    def describe(self) -> dict[str, Any]:
        return {"runner": "host", "workspace": str(self.workspace)}


_KILL_NOTES = {"disk": "[killed: the command grew the workspace's disk usage past its disk "
                       "quota of {disk} bytes]"}
_OOM_NOTE = ("[codeplane: the sandbox reached its memory limit of {memory} bytes (all its "
             "processes and /tmp together); the kernel killed a process]")


def supervise(argv: list[str], command: str, cwd: Path, env: dict[str, str], limits: Limits,
              cancel: threading.Event | None, sandboxed: bool,
              session: _Session | None = None, stderr: bool = True,
              cgroup: cgroups.SandboxCgroup | None = None) -> CommandResult:
    """Run argv under limits, in `cgroup` (the sandbox's; by default one of its own); collect
    capped output; kill everything on timeout/cancel or when the session's watchdog says so."""
    session = session or _Session()
    cgroup = cgroup or cgroups.SandboxCgroup()
    start = time.monotonic()
    capture = _Capture(limits.output_bytes)
    killed = None
    proc = leaf = None
    try:
        leaf = _enter(cgroup, limits)
        prefix = leaf.wrapper() if leaf else []
        proc = subprocess.Popen(prefix + _prlimit(limits) + argv, cwd=cwd, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT if stderr else subprocess.DEVNULL,
                                start_new_session=True, pass_fds=session.pass_fds)
        session.started(proc)
        killed = _pump(proc, capture, limits, cancel, start, leaf, session)
    finally:
        if proc is not None:
            _kill(proc, leaf)
            proc.wait()
            proc.stdout.close()
        notes = [session.close()]
        if leaf:
            if leaf.out_of_memory():
                notes.append(_OOM_NOTE.format(memory=cgroup.memory_limit))
            cgroup.leave(leaf)
    if killed in _KILL_NOTES:
        capture.add(b"\n" + _KILL_NOTES[killed].format(disk=limits.disk_bytes).encode())
    note = "\n".join(n for n in notes if n)
    if note:
        capture.add(f"\n{note}".encode())
    code = None if killed else proc.returncode
    return CommandResult(command=command, exit_code=code, output=capture.text(),
                         seconds=round(time.monotonic() - start, 3), killed=killed,
                         truncated=capture.omitted > 0, sandboxed=sandboxed)


def _enter(cgroup: cgroups.SandboxCgroup, limits: Limits) -> cgroups.CommandCgroup | None:
    """The command's leaf in its sandbox's cgroup; a host whose cgroups cannot be made now
    refuses the command (it would run unbounded) rather than run it."""
    try:
        return cgroup.enter(limits.memory_bytes, limits.processes)
    except OSError as exc:
        raise SandboxUnavailable(f"cannot make the sandbox's cgroup: {exc}") from None


def _pump(proc: subprocess.Popen, capture: _Capture, limits: Limits,
          cancel: threading.Event | None, start: float, cgroup: cgroups.CommandCgroup | None,
          session: _Session) -> str | None:
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
                else:
                    killed = session.poll()
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


def _kill(proc: subprocess.Popen, cgroup: cgroups.CommandCgroup | None) -> None:
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

