"""The `microvm` workspace backend: commands run in a QEMU microVM, files stay on the host.

Stronger isolation than bubblewrap where the host allows it: a command runs under its own
guest kernel, so a kernel bug it exploits is the guest's, not the server's. The guest is
built on this machine from Debian packages, never downloaded (`guest_image`): the kernel
package's vmlinuz (unpacked to the ELF vmlinux, which QEMU boots through its PVH entry
without the decompressor), and an initramfs of busybox-static, the virtio/9p kernel modules
of that kernel, a minimal /etc (never shadow or keys; `runner._ETC`), `guest/init` and the
exec agent `guest/agent.py`. Both are cached under `$CODEPLANE_HOME/cache/microvm/`.

A VM (`MicroVM`) is `qemu-system-x86_64 -M microvm -nodefaults -no-user-config` with no
network device, QEMU's own seccomp sandbox on, and virtio-9p shares: the workspace
read-write (at the same path as on the host, `cache=none` so host-side writes are seen at
once) and the toolchain read-only (`/usr`, `/opt`, the Python prefix when outside /usr:
`readonly=on` is enforced by QEMU, not by the guest). Commands reach the guest's agent over
virtio-serial ports (vhost-vsock needs a host kernel module this machine's kernel lacks;
a serial port needs nothing from it), one command per port at a time.

Exec reuses the bubblewrap runner's supervisor: `MicroVMWorkspace.exec` runs the small
host-side `guest/bridge.py` under `runner.supervise`, so timeout, output cap, cancel, the
disk watchdog and the `.git` sweep are the same code; after every command the port is
resynchronised with a `kill` the guest acknowledges, which also ends whatever a killed
command left running. In the guest each command gets a cgroup (pids.max, memory.max), the
prlimit rlimits bwrap uses, and read-only binds of the workspace's git metadata.

KVM is required by default: under QEMU's TCG emulator a guest is much slower, and QEMU does
not treat TCG as a security boundary. `accel="tcg"` is for hosts whose KVM cannot run a
stock kernel (tests and benchmarks on such hosts say so).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import lzma
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from codeplane.sandbox.gitguard import GitGuard
from codeplane.sandbox.runner import (
    _ETC,
    CommandResult,
    Limits,
    SandboxUnavailable,
    _env,
    _prlimit,
    _Sandboxed,
    _Session,
    supervise,
)
from codeplane.sandbox.workspace import BackendServices, LocalWorkspace

log = logging.getLogger("codeplane.microvm")
GUEST = Path(__file__).parent / "guest"
MODULES = ("virtio_mmio", "virtio_console", "9pnet_virtio", "9p")  # and their dependencies
# QEMU's own seccomp filter: no exec, no setuid, no scheduler or resource tweaks
SECCOMP = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
RUN_PREFIX = "codeplane-vm-"  # a VM's sockets, logs, pid and owner: tempdir/codeplane-vm-*
PORTS = 4  # concurrent commands per VM
CMDLINE_MAX = 1900  # x86's kernel command line holds 2048 bytes; QEMU may append its own
BOOT_TIMEOUT = {"kvm": 30.0, "tcg": 300.0}  # seconds; TCG on a loaded host is slow
_XZ, _GZIP = b"\xfd7zXZ\x00", b"\x1f\x8b\x08"


class MicroVMUnavailable(SandboxUnavailable):
    """No microVM can run here (no usable KVM, QEMU or guest packages); the reason says
    which and how to get it."""


def kvm_problem() -> str | None:
    """Why KVM cannot run a stock Debian kernel on this host, or None if it can."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "/dev/kvm is missing or not accessible to this user (add it to group kvm)"
    hardware = any(Path(f"/sys/module/{m}").exists() for m in ("kvm_intel", "kvm_amd"))
    if Path("/sys/module/kvm_pvm").exists() and not hardware:
        return ("this host's KVM is kvm_pvm (nested virtualization without hardware support), "
                "which runs only PVM-enabled guest kernels: Debian's kernel hangs at its first "
                "instruction under it")
    return None


def unavailable() -> str | None:
    """Why the `microvm` backend (KVM only) cannot run here, or None if it can."""
    if problem := kvm_problem():
        return f"KVM is not usable: {problem}"
    if shutil.which("qemu-system-x86_64") is None:
        return "QEMU is not installed; apt-get install qemu-system-x86"
    try:
        _kernel_package()
        _static_busybox()
    except MicroVMUnavailable as exc:
        return str(exc)
    return None


# ---------------------------------------------------------------- the guest image

@dataclass(frozen=True)
class GuestImage:
    kernel: Path  # the uncompressed vmlinux (an ELF with a PVH entry point)
    initrd: Path  # an uncompressed newc cpio archive


def guest_image(cache: Path | None = None) -> GuestImage:
    """The kernel and initramfs for this host's newest Debian kernel package, built once and
    cached by a hash of everything that goes into them."""
    vmlinuz, modules = _kernel_package()
    busybox = _static_busybox()
    parts = [vmlinuz, busybox, *sorted(GUEST.iterdir()),
             *(p for p in (Path("/etc") / n for n in _ETC) if p.exists())]
    key = hashlib.sha256(repr([MODULES, *((str(p), p.stat().st_size, p.stat().st_mtime_ns)
                                          for p in parts)]).encode()).hexdigest()[:16]
    folder = (cache or _cache_dir()) / key
    image = GuestImage(folder / "vmlinux", folder / "initrd.cpio")
    if image.kernel.exists() and image.initrd.exists():
        return image
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=folder.parent))
    try:
        (staging / "vmlinux").write_bytes(_unpack_kernel(vmlinuz.read_bytes()))
        _write_initrd(staging / "initrd.cpio", busybox, modules)
        os.rename(staging, folder)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (image.kernel.exists() and image.initrd.exists()):  # not a concurrent build
            raise
    return image


def _cache_dir() -> Path:
    home = Path(os.environ.get("CODEPLANE_HOME") or "~/.codeplane").expanduser()
    return home / "cache" / "microvm"


def _kernel_package() -> tuple[Path, Path]:
    """The newest /boot/vmlinuz-* whose modules are installed (linux-image-amd64)."""
    found = sorted((p for p in Path("/boot").glob("vmlinuz-*")
                    if (Path("/lib/modules") / p.name.removeprefix("vmlinuz-")).is_dir()),
                   key=lambda p: p.stat().st_mtime)
    if not found:
        raise MicroVMUnavailable("no kernel package with its modules is installed; "
                                 "apt-get install linux-image-amd64")
    return found[-1], Path("/lib/modules") / found[-1].name.removeprefix("vmlinuz-")


def _static_busybox() -> Path:
    for candidate in (Path("/bin/busybox"), Path("/usr/bin/busybox")):
        if candidate.is_file() and b"ld-linux" not in candidate.read_bytes()[:8192]:
            return candidate
    raise MicroVMUnavailable("a statically linked busybox is needed for the guest; "
                             "apt-get install busybox-static")


def _unpack_kernel(vmlinuz: bytes) -> bytes:
    """The ELF kernel inside a bzImage (what the kernel tree's extract-vmlinux does): the
    payload is the first xz or gzip stream that decompresses to an ELF file."""
    for magic, unpack in ((_XZ, _unxz), (_GZIP, _gunzip)):
        start = vmlinuz.find(magic)
        while start >= 0:
            try:
                elf = unpack(vmlinuz[start:])
            except (lzma.LZMAError, zlib.error):
                elf = b""
            if elf.startswith(b"\x7fELF"):
                return elf
            start = vmlinuz.find(magic, start + 1)
    raise MicroVMUnavailable("cannot unpack the kernel (neither xz nor gzip inside)")


def _unxz(data: bytes) -> bytes:
    return lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(data)


def _gunzip(data: bytes) -> bytes:
    return zlib.decompressobj(wbits=31).decompress(data)


def _write_initrd(target: Path, busybox: Path, modules: Path) -> None:
    """Lay the guest's root out in a directory and pack it with busybox's cpio."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name in ("bb", "proc", "sys", "dev", "usr", "tmp", "etc", "modules"):
            (root / name).mkdir()
        shutil.copy2(busybox, root / "bb" / "busybox")
        shutil.copy2(GUEST / "init", root / "init")
        shutil.copy2(GUEST / "agent.py", root / "agent.py")
        for top in ("bin", "sbin", "lib", "lib32", "lib64"):  # merged /usr: the same links
            if Path(f"/{top}").is_symlink():
                (root / top).symlink_to(os.readlink(f"/{top}"))
        order = _module_order(modules)
        for rel in order:
            shutil.copy2(modules / rel, root / "modules" / Path(rel).name)
        (root / "modules" / "order").write_text("".join(f"{Path(r).name}\n" for r in order))
        _copy_etc(root / "etc")
        names = subprocess.run(["find", "."], cwd=root, capture_output=True, check=True).stdout
        with target.open("wb") as out:
            subprocess.run([str(busybox), "cpio", "-o", "-H", "newc"], cwd=root, input=names,
                           stdout=out, stderr=subprocess.DEVNULL, check=True)


def _module_order(modules: Path) -> list[str]:
    """The .ko files of MODULES with their dependencies first (from modules.dep)."""
    deps: dict[str, list[str]] = {}
    for line in (modules / "modules.dep").read_text().splitlines():
        name, _, rest = line.partition(":")
        deps[name] = rest.split()
    by_name = {Path(k).name.removesuffix(".ko"): k for k in deps}
    order: list[str] = []

    def add(rel: str) -> None:
        for dep in deps.get(rel, []):
            add(dep)
        if rel not in order:
            order.append(rel)

    for name in MODULES:
        if name not in by_name:
            raise MicroVMUnavailable(f"kernel module {name} is missing from {modules}")
        add(by_name[name])
    return order


def _copy_etc(etc: Path) -> None:
    """The same minimal /etc bubblewrap binds (no shadow, no keys, no credentials)."""
    for name in _ETC:
        source = Path("/etc") / name
        if source.is_dir() and not source.is_symlink():
            shutil.copytree(source, etc / name, symlinks=True, ignore_dangling_symlinks=True)
        elif source.exists():
            shutil.copy2(source, etc / name, follow_symlinks=True)


# ---------------------------------------------------------------- one VM

@dataclass(frozen=True)
class Share:
    path: Path
    writable: bool


def toolchain() -> list[Share]:
    """What a command may run, read-only: /usr (and /bin, /lib... when they are not
    links into it), /opt, and this Python's prefix when it lives elsewhere."""
    tops = [Path("/usr"), Path("/opt")]
    tops += [Path(f"/{t}") for t in ("bin", "sbin", "lib", "lib32", "lib64")
             if not Path(f"/{t}").is_symlink()]
    tops += [Path(p) for p in sorted({sys.base_prefix, sys.prefix}) if not p.startswith("/usr")]
    return [Share(p, writable=False) for p in tops if p.is_dir()]


class MicroVM:
    """A booted guest with its shares; `port()` lends a channel to its exec agent."""

    def __init__(self, workspace: Path, image: GuestImage, accel: str = "kvm",
                 memory_bytes: int = 1 << 30, tmp_bytes: int = 256 << 20, cpus: int = 1) -> None:
        if accel == "kvm" and (problem := kvm_problem()):
            raise MicroVMUnavailable(f"KVM is not usable: {problem}")
        qemu = shutil.which("qemu-system-x86_64")
        if qemu is None:
            raise MicroVMUnavailable("QEMU is not installed; apt-get install qemu-system-x86")
        self.run_dir = Path(tempfile.mkdtemp(prefix=RUN_PREFIX))
        (self.run_dir / "owner").write_text(str(os.getpid()))  # for reap_orphans
        shares = [*toolchain(), Share(workspace, writable=True)]
        argv = qemu_argv(qemu, self.run_dir, image, shares, accel, memory_bytes, tmp_bytes,
                          cpus)
        with open(self.run_dir / "qemu.log", "wb") as qemu_log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=qemu_log,
                                         start_new_session=True)
        self.ports: queue.Queue[socket.socket] = queue.Queue()
        # a workspace nobody closed still takes its VM down with it (and at exit)
        self._finalizer = weakref.finalize(self, _stop, self.proc, self.run_dir, self.ports)
        try:
            self._connect(BOOT_TIMEOUT[accel])
        except BaseException:
            self.close()
            raise

    def _connect(self, timeout: float) -> None:
        """Connect every port and wait for the agent to answer on each."""
        deadline = time.monotonic() + timeout
        for n in range(PORTS):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            while True:
                try:
                    sock.connect(str(self.run_dir / f"p{n}.sock"))
                    break
                except (FileNotFoundError, ConnectionRefusedError):
                    self._check_alive(deadline)
                    time.sleep(0.005)
            _resync(sock, deadline, self._check_alive)
            self.ports.put(sock)

    def _check_alive(self, deadline: float) -> None:
        if self.proc.poll() is not None or time.monotonic() > deadline:
            qemu_log = _read_tail(self.run_dir / "qemu.log").strip()
            console = _read_tail(self.run_dir / "console.log")
            what = "exited" if self.proc.poll() is not None else "did not answer in time"
            raise MicroVMUnavailable(f"the microVM {what}: {qemu_log} {console}".strip())

    @contextmanager
    def port(self) -> Iterator[tuple[socket.socket, str]]:
        """A free port for one command; resynchronised (and the command's leftovers killed)
        before anyone else gets it."""
        sock = self.ports.get()
        ident = uuid.uuid4().hex
        try:
            yield sock, ident
        finally:
            _resync(sock, time.monotonic() + 30, self._check_alive, ident)
            self.ports.put(sock)

    def close(self) -> None:
        """Kill QEMU and remove its sockets and logs."""
        self._finalizer()


def qemu_argv(qemu: str, run_dir: Path, image: GuestImage, shares: list[Share], accel: str,
               memory_bytes: int, tmp_bytes: int, cpus: int) -> list[str]:
    """QEMU's command line for a VM; what init mounts travels on the kernel's (`config`)."""
    config = [f"python - {os.path.realpath(sys.executable)}"]
    if any(share.writable for share in shares):  # /tmp first: a share living under /tmp (a
        config.append(f"tmp {tmp_bytes} -")  # workspace, a virtualenv) is mounted over it
    argv = [qemu, "-M", "microvm", "-accel", accel, "-cpu", "host" if accel == "kvm" else "max",
            "-m", f"{max(memory_bytes + tmp_bytes, 256 << 20) >> 20}M", "-smp", str(cpus),
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-sandbox", SECCOMP,
            "-kernel", str(image.kernel), "-initrd", str(image.initrd),
            "-serial", f"file:{run_dir / 'console.log'}",
            "-pidfile", str(run_dir / "qemu.pid")]
    for n, share in enumerate(shares):
        if "\n" in str(share.path) or "," in str(share.path):
            raise MicroVMUnavailable(f"cannot share {share.path!r} (comma or newline in path)")
        ro = "" if share.writable else ",readonly=on"
        argv += ["-fsdev", f"local,id=fs{n},path={share.path},security_model=none{ro}",
                 "-device", f"virtio-9p-device,fsdev=fs{n},mount_tag=fs{n}"]
        config.append(f"{'rw' if share.writable else 'ro'} fs{n} {share.path}")
    argv += ["-device", f"virtio-serial-device,max_ports={PORTS + 1}"]
    for n in range(PORTS):
        argv += ["-chardev", f"socket,id=p{n},path={run_dir / f'p{n}.sock'},server=on,wait=off",
                 "-device", f"virtserialport,chardev=p{n},name=codeplane.{n}"]
    encoded = base64.b64encode("".join(f"{line}\n" for line in config).encode()).decode()
    cmdline = f"console=ttyS0 quiet panic=-1 codeplane={encoded}"
    if accel == "tcg":  # no kvmclock, and microvm has no HPET or PM timer to calibrate by
        cmdline += f" tsc_early_khz={_host_tsc_khz()}"
    if len(cmdline) > CMDLINE_MAX:
        raise MicroVMUnavailable("the share paths are too long for the guest's kernel command "
                                 f"line ({len(cmdline)} > {CMDLINE_MAX} bytes)")
    return [*argv, "-append", cmdline]


def _host_tsc_khz() -> int:
    """The host's TSC frequency, which an emulated guest's TSC runs at (QEMU's TCG reads
    the host's counter)."""
    for line in _read(Path("/proc/cpuinfo")).splitlines():
        if line.startswith("cpu MHz"):
            return int(float(line.split(":")[1]) * 1000)
    return 2_000_000


def _resync(sock: socket.socket, deadline: float, check: Callable[[float], None],
            ident: str = "boot") -> None:
    """Ask the agent to kill command `ident` (if it still runs) and read (and drop)
    everything up to its ack: the port is then clean for the next command."""
    sock.sendall(json.dumps({"op": "kill", "id": ident}).encode() + b"\n")
    marker = b"\0codeplane-ack-" + ident.encode() + b"\n"
    seen = b""
    sock.settimeout(0.1)
    try:
        while marker not in seen:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                check(deadline)
                continue
            except OSError:
                chunk = b""
            if not chunk:  # QEMU went away: check() raises with its logs
                check(0)
            seen = seen[-len(marker):] + chunk
    finally:
        sock.settimeout(None)


def _read_tail(path: Path) -> str:
    return _read(path)[-1500:]


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _stop(proc: subprocess.Popen, run_dir: Path, ports: queue.Queue[socket.socket]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    while not ports.empty():
        ports.get_nowait().close()
    shutil.rmtree(run_dir, ignore_errors=True)


def reap_orphans() -> int:
    """Kill the VMs of processes that died without closing them (a SIGKILLed server) and
    remove their directories; how many were reaped. The QEMU pid is checked against its
    command line (which names the run directory), so a reused pid is never killed."""
    reaped = 0
    for run_dir in Path(tempfile.gettempdir()).glob(f"{RUN_PREFIX}*"):
        owner = _read(run_dir / "owner")
        if not owner.isdigit() or Path(f"/proc/{owner}").exists():
            continue
        pid = _read(run_dir / "qemu.pid").strip()
        cmdline = _read(Path(f"/proc/{pid}/cmdline")) if pid.isdigit() else ""
        if str(run_dir) in cmdline:
            os.kill(int(pid), signal.SIGKILL)
        shutil.rmtree(run_dir, ignore_errors=True)
        reaped += 1
    return reaped


# ---------------------------------------------------------------- the runner and workspace

NO_NETWORK = ("the microvm backend has no network device yet (QEMU's user-mode network would "
              "reach the host's loopback); use the bwrap backend for network access")


class _Port(_Session):
    """The supervisor's hooks for a read-only program: hand the bridge its port."""

    def __init__(self, fd: int) -> None:
        self.pass_fds = (fd,)


class _GuestRun(_Sandboxed):
    """A writable command: bubblewrap's disk watchdog and `.git` sweep, plus the port."""

    def __init__(self, workspace: Path, limits: Limits, guard: GitGuard, fd: int) -> None:
        super().__init__(workspace, limits, guard, None)
        self.pass_fds = (fd,)


class GuestRunner:
    """The `Runner` interface over a VM's exec agent."""

    sandboxed = True

    def __init__(self, vm: MicroVM, workspace: Path, accel: str) -> None:
        self.vm, self.workspace, self.accel = vm, workspace, accel

    def run(self, command: str, cwd: Path, limits: Limits,
            cancel: threading.Event | None = None) -> CommandResult:
        """A shell command with the workspace writable, its git metadata read-only."""
        guard = GitGuard(self.workspace)
        ro = guard.binds()[1::3]  # ["--ro-bind", src, dst, ...]: the same paths in the guest
        return self._exec(["/bin/sh", "-c", command], command, cwd, limits, cancel, True,
                          ro, lambda fd: _GuestRun(self.workspace, limits, guard, fd))

    def exec(self, argv: list[str], cwd: Path, limits: Limits,
             stderr: bool = False) -> CommandResult:
        """A trusted program over a read-only workspace."""
        return self._exec(argv, " ".join(argv), cwd, limits, None, stderr,
                          [str(self.workspace)], _Port)

    def _exec(self, argv: list[str], text: str, cwd: Path, limits: Limits,
              cancel: threading.Event | None, stderr: bool, ro: list[str],
              session: Callable[[int], _Session]) -> CommandResult:
        if limits.network:  # as bwrap without slirp4netns: refused, never silently dropped
            raise MicroVMUnavailable(NO_NETWORK)
        with self.vm.port() as (sock, ident):
            request = {"op": "run", "id": ident, "argv": _prlimit(limits) + argv,
                       "cwd": str(cwd), "env": _env(), "stderr": stderr,
                       "pids": limits.processes, "memory": limits.memory_bytes, "ro": ro}
            bridge = [sys.executable, "-I", "-S", str(GUEST / "bridge.py"),
                      str(sock.fileno()), json.dumps(request)]
            return supervise(bridge, text, self.workspace, {"PATH": "/usr/bin:/bin"},
                             limits, cancel, sandboxed=True, session=session(sock.fileno()))

    def describe(self) -> dict[str, Any]:
        return {"runner": "microvm", "accel": self.accel, "workspace": str(self.workspace)}


class MicroVMWorkspace(LocalWorkspace):
    """A directory on this machine whose commands run in a microVM of its own; file
    operations stay host-side through `core/files.py`, as for every local backend."""

    def __init__(self, root: Path, accel: str = "kvm", limits: Limits | None = None,
                 cpus: int = 1, image: GuestImage | None = None) -> None:
        limits = limits or Limits()
        if limits.network:
            raise MicroVMUnavailable(NO_NETWORK)
        root = Path(os.path.realpath(root))
        self.vm = MicroVM(root, image or guest_image(), accel, limits.memory_bytes,
                          limits.tmp_bytes, cpus)
        super().__init__(root, GuestRunner(self.vm, root, accel))

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "backend": "microvm"}

    def close(self) -> None:
        """Kill the VM (the directory is the caller's and stays)."""
        self.vm.close()


class MicroVMSettings(BaseModel):
    """The `microvm` backend's settings (its row of `backends.BACKENDS`)."""

    model_config = {"extra": "forbid"}
    accel: Literal["kvm", "tcg"] = Field(
        "kvm", description="tcg: QEMU's emulator, for hosts whose KVM cannot run a stock "
                           "kernel (slow, and QEMU does not treat it as a security boundary)")
    cpus: int = Field(1, ge=1, le=64, description="virtual CPUs per VM")
    memory_bytes: int = Field(4 << 30, ge=128 << 20, description="the guest's memory")
    tmp_bytes: int = Field(1 << 30, ge=1 << 20, description="the guest's /tmp (memory)")


class MicroVMBackend:
    """A VM of its own per workspace, booted when the workspace is opened; the VMs a killed
    process left running are reaped first."""

    def __init__(self, settings: MicroVMSettings, services: BackendServices) -> None:
        self.settings = settings

    def open(self, root: Path, network: bool) -> MicroVMWorkspace:
        reap_orphans()
        s = self.settings
        return MicroVMWorkspace(root, s.accel, Limits(network=network, memory_bytes=s.memory_bytes,
                                                      tmp_bytes=s.tmp_bytes), s.cpus)
