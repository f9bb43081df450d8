"""Memory and pids cgroups for sandboxes, on cgroup v1 or v2.

A sandbox (a fleet `Sandbox`, or the workspace of a local agent run: one `BwrapRunner`) has one
cgroup holding every process of every command it runs at once, so its memory limit bounds them
together with their private /tmp (a tmpfs: its pages are charged to the memory cgroup of the
process that writes them), and its pids limit bounds all their processes and threads. Each
command runs in a leaf below it, so a timeout kills that command's processes and no other's.
The sandbox's cgroup exists while commands run: made when the first starts (with the
sandbox's limits, or else that command's), removed when the last one ends (nothing to clean up
after an idle sandbox).

Where they go (`find_layout`, a pure function of the cgroup tree, so the v2 rules are tested on
fake trees on a v1 host):
- cgroup v1 (one hierarchy per controller): `<root>/memory/codeplane-sandbox/` and
  `<root>/pids/codeplane-sandbox/`; as a normal user only if an operator made those
  directories and gave them to the server's user;
- cgroup v2 as root: `<root>/codeplane-sandbox/`, with memory and pids enabled in the
  `cgroup.subtree_control` of the root and of that directory;
- cgroup v2 as a normal user: only below the server's own cgroup, when it is delegated to the
  server's user (systemd `Delegate=yes`): the server first moves itself into a leaf
  `codeplane-server` (v2 lets a cgroup hand controllers to its children only while it holds
  no process itself), then sandboxes go under `codeplane-sandbox` next to it.
Elsewhere there is no cgroup, and `describe()` says what bounds a sandbox instead.

Directories are named `sb-<pid>-<start>-<random>` after the server that made them, so the
first use in a process removes those of servers that died (`_sweep`).
"""

from __future__ import annotations

import functools
import os
import re
import secrets
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from codeplane.core.procs import start_ticks

ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("memory", "pids")
PARENT = "codeplane-sandbox"  # the directory sandbox cgroups are made in
SERVER_LEAF = "codeplane-server"  # v2, delegated: where the server moves itself
_REMOVE_SECONDS = 2.0  # how long removal keeps killing stragglers before giving up
_NAME = re.compile(r"sb-(\d+)-(\d+)-[0-9a-f]+")
# the memory limit, and swap kept within it where the host accounts swap (best effort)
_MEMORY = {"v1": ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"),
           "v2": ("memory.max", "memory.swap.max")}


@dataclass(frozen=True)
class Layout:
    """Where this host's sandbox cgroups go, as `find_layout` found it."""

    version: str  # "v1", "v2", or "none"
    parents: tuple[tuple[str, Path], ...] = ()  # (controller, where sandbox cgroups are made)
    enable: tuple[Path, ...] = ()  # v2: subtree_control files that need the controllers
    vacate: Path | None = None  # v2 delegated: the leaf the server moves itself into first
    note: str = ""  # what was found, and what is missing

    @property
    def controllers(self) -> list[str]:
        return [name for name, _ in self.parents]

    def dirs(self) -> list[Path]:
        """The distinct parent directories (v1: one per controller; v2: one for both)."""
        return list(dict.fromkeys(path for _, path in self.parents))


def find_layout(root: Path = ROOT, self_cgroup: str | None = None,
                euid: int | None = None) -> Layout:
    """Where sandbox cgroups can go in the tree mounted at `root`, for a process of `euid`
    whose /proc/self/cgroup reads `self_cgroup`. Reads the tree, never writes it."""
    euid = os.geteuid() if euid is None else euid
    v1 = {name: root / name for name in CONTROLLERS if (root / name / "cgroup.procs").is_file()}
    if v1:
        return _v1_layout(v1, euid)
    for mount in (root, root / "unified"):  # v2 alone, or v2 next to empty v1 mounts
        if (mount / "cgroup.controllers").is_file():
            text = read_or_empty(Path("/proc/self/cgroup")) if self_cgroup is None else self_cgroup
            return _v2_layout(mount, _own_v2_path(text), euid)
    return Layout("none", note=f"no cgroup hierarchy is mounted at {root}")


def _v1_layout(mounts: dict[str, Path], euid: int) -> Layout:
    parents = tuple((name, mount / PARENT) for name, mount in mounts.items()
                    if euid == 0 or _owned(mount / PARENT, euid))
    missing = [name for name in CONTROLLERS if name not in dict(parents)]
    note = "cgroup v1"
    if missing:
        note += (f"; no usable {' or '.join(missing)} hierarchy (as a normal user: an operator "
                 f"makes <mount>/<controller>/{PARENT} and gives it to this user)")
    return Layout("v1" if parents else "none", parents, note=note)


def _v2_layout(mount: Path, own: str, euid: int) -> Layout:
    if euid == 0:
        top, vacate = mount, None
    else:  # only a subtree delegated to this user: our own cgroup
        top = mount / own.lstrip("/")
        if not all(_owned(top / name, euid) for name in ("cgroup.procs",
                                                          "cgroup.subtree_control")):
            return Layout("none", note=f"cgroup v2, but this process's cgroup {own} is not "
                                       "delegated to its user (run the server under systemd "
                                       "with Delegate=yes, or as root)")
        vacate = top / SERVER_LEAF
    available = read_or_empty(top / "cgroup.controllers").split()
    names = [name for name in CONTROLLERS if name in available]
    if not names:
        return Layout("none", note=f"cgroup v2 at {top} offers neither memory nor pids")
    parent = top / PARENT
    missing = [name for name in CONTROLLERS if name not in names]
    note = "cgroup v2" + (f"; {top} offers no {' or '.join(missing)}" if missing else "")
    return Layout("v2", tuple((name, parent) for name in names),
                  enable=(top / "cgroup.subtree_control", parent / "cgroup.subtree_control"),
                  vacate=vacate, note=note)


def _own_v2_path(text: str) -> str:
    """This process's cgroup in the v2 hierarchy (the `0::` line of /proc/self/cgroup)."""
    for line in text.splitlines():
        if line.startswith("0::"):
            return line[3:] or "/"
    return "/"


def _owned(path: Path, euid: int) -> bool:
    try:
        return path.stat().st_uid == euid
    except OSError:
        return False


def read_or_empty(path: Path) -> str:
    """A small kernel file's text; "" if it is absent or unreadable."""
    try:
        return path.read_text()
    except OSError:
        return ""


def prepare(layout: Layout) -> Layout:
    """Make `layout` usable: the server into its leaf (v2 delegated), the controllers enabled,
    the parent directories made, and what dead servers left removed. The layout, or a "none"
    one that says what failed."""
    if not layout.parents:
        return layout
    try:
        if layout.vacate is not None:
            layout.vacate.mkdir(exist_ok=True)
            (layout.vacate / "cgroup.procs").write_text(str(os.getpid()))
        for control in layout.enable:
            control.parent.mkdir(exist_ok=True)
            if not set(layout.controllers) <= set(read_or_empty(control).split()):
                control.write_text(" ".join(f"+{name}" for name in layout.controllers))
        for parent in layout.dirs():
            parent.mkdir(exist_ok=True)
    except OSError as exc:
        return Layout("none", note=f"{layout.note}, but it cannot be used here: {exc}")
    for parent in layout.dirs():
        _sweep(parent)
    return layout


@functools.cache
def current() -> Layout:
    """This host's layout, prepared on first use in this process."""
    return prepare(find_layout())


def describe() -> dict[str, Any]:
    """What `codeplane doctor` reports: the hierarchy in use, where sandbox cgroups go, and
    what bounds a sandbox's memory and processes on this host."""
    layout = current()
    names = layout.controllers
    if "pids" in names:
        pids = "per sandbox (pids cgroup)"
    elif os.geteuid() == 0:  # the kernel exempts root from RLIMIT_NPROC: runner.py refuses
        pids = "none: sandboxes are refused (root without a pids cgroup)"
    else:
        pids = "per user (RLIMIT_NPROC: every process of the server's user counts)"
    memory = ("per sandbox (memory cgroup: all its processes and its /tmp)" if "memory" in names
              else "per process (address space, prlimit --as) and /tmp's size")
    return {"hierarchy": layout.version,
            "cgroups": {name: str(path) for name, path in layout.parents},
            "memory": memory, "pids": pids, "note": layout.note}


@functools.cache
def _owner(pid: int) -> str:
    return f"{pid}-{start_ticks(pid)}"


def _sweep(parent: Path) -> None:
    """Remove the sandbox cgroups of servers that are no longer running."""
    try:
        children = [child for child in parent.iterdir() if _NAME.fullmatch(child.name)]
    except OSError:
        return
    for child in children:
        pid, start = _NAME.fullmatch(child.name).groups()
        if start_ticks(int(pid)) == int(start):
            continue
        try:
            leaves = [leaf for leaf in child.iterdir() if leaf.is_dir()]
        except OSError:  # another process swept it first
            continue
        _remove([*leaves, child])


def _remove(dirs: list[Path]) -> None:
    """rmdir each cgroup in order, killing what is still in it until it is empty; one that
    stays busy past the deadline (a process stuck in the kernel) is left, and so are the
    rest (a sandbox's cgroup is made again, with its limits, when its next command starts)."""
    deadline = time.monotonic() + _REMOVE_SECONDS
    for path in dirs:
        while True:
            _kill_all(path)
            try:
                path.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.02)


def _kill_all(path: Path) -> None:
    if (path / "cgroup.kill").is_file():  # v2 (Linux 5.14): the kernel kills them all at once
        try:
            (path / "cgroup.kill").write_text("1")
            return
        except OSError:
            pass
    for pid in read_or_empty(path / "cgroup.procs").split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, PermissionError, ValueError):
            pass


class SandboxCgroup:
    """The cgroup of one sandbox. Thread-safe: the commands of one sandbox may run at once."""

    def __init__(self, memory_bytes: int | None = None, pids: int | None = None,
                 layout: Layout | None = None) -> None:
        """Limits given here are the sandbox's; without them, the first command's apply."""
        self.memory_bytes, self.pids = memory_bytes, pids
        self.memory_limit = 0  # the limit in force while commands run
        self._layout = layout  # None: this host's, found when the first command starts
        self.name = f"sb-{_owner(os.getpid())}-{secrets.token_hex(6)}"
        self._lock = threading.Lock()
        self._running = 0

    @property
    def layout(self) -> Layout:
        return self._layout or current()

    def enter(self, memory_bytes: int, pids: int) -> CommandCgroup | None:
        """A leaf for the next command; None where this host has no cgroup for sandboxes.
        OSError where it has one that cannot be made (callers fail closed)."""
        layout = self.layout
        if not layout.parents:
            return None
        with self._lock:
            if self._running == 0:
                self._make(layout, self.memory_bytes or memory_bytes, self.pids or pids)
            self._running += 1
        tag = f"cmd-{secrets.token_hex(6)}"
        command = CommandCgroup(self, [d / self.name / tag for d in layout.dirs()],
                                _oom_counter(layout, self.name, tag))
        try:
            for leaf in command.leaves:
                leaf.mkdir()
        except OSError:
            self.leave(command)
            raise
        command.oom_before = command.oom_kills()
        return command

    def leave(self, command: CommandCgroup) -> None:
        """Kill and remove the command's leaf; the sandbox's cgroup goes with its last one."""
        _remove(command.leaves)
        with self._lock:
            self._running -= 1
            if self._running == 0:
                _remove([d / self.name for d in self.layout.dirs()])

    def _make(self, layout: Layout, memory_bytes: int, pids: int) -> None:
        self.memory_limit = memory_bytes
        try:
            self._limit(layout, memory_bytes, pids)
        except OSError:
            _remove([d / self.name for d in layout.dirs()])
            raise

    def _limit(self, layout: Layout, memory_bytes: int, pids: int) -> None:
        for name, parent in layout.parents:
            path = parent / self.name
            path.mkdir(exist_ok=True)
            if name == "pids":
                (path / "pids.max").write_text(str(pids))
                continue
            limit, swap = _MEMORY[layout.version]
            (path / limit).write_text(str(memory_bytes))
            if (path / swap).is_file():  # no swap past the limit (v1) or at all (v2)
                try:
                    (path / swap).write_text(str(memory_bytes if layout.version == "v1" else 0))
                except OSError:
                    pass


def _oom_counter(layout: Layout, name: str, tag: str) -> Path | None:
    """The file whose `oom_kill` line counts this command's processes the kernel killed at
    the memory limit: v1 counts in the leaf, v2 in the sandbox (its leaves have no memory
    files: they hand no controller down)."""
    parent = dict(layout.parents).get("memory")
    if parent is None:
        return None
    if layout.version == "v1":
        return parent / name / tag / "memory.oom_control"
    return parent / name / "memory.events"


@dataclass
class CommandCgroup:
    """One command's leaf (one per v1 hierarchy) below its sandbox's cgroup."""

    sandbox: SandboxCgroup
    leaves: list[Path]
    oom_file: Path | None
    oom_before: int = field(default=0)

    def wrapper(self) -> list[str]:
        """An argv prefix: a shell that moves itself into every leaf and then execs the
        command, so nothing the command starts runs outside them."""
        join = ('while [ "$1" != -- ]; do echo $$ > "$1/cgroup.procs" || exit 125; shift; '
                'done; shift; exec "$@"')
        return ["/bin/sh", "-c", join, "sh", *map(str, self.leaves), "--"]

    def kill(self) -> None:
        for leaf in self.leaves:
            _kill_all(leaf)

    def oom_kills(self) -> int:
        text = read_or_empty(self.oom_file) if self.oom_file else ""
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def out_of_memory(self) -> bool:
        """True if the kernel killed a process at the sandbox's memory limit meanwhile."""
        return self.oom_kills() > self.oom_before
