"""The `Workspace` every agent tool works on: files, commands, snapshots, one interface.

The agent, `codeplane tool`, the server's runs and RL environments see a workspace only
through this protocol, so a backend that keeps its files elsewhere (a pooled copy-on-write
sandbox, a microVM) runs every tool unchanged. Backends are chosen by name from the table in
`backends.py`, as mini-swe-agent chooses its environments; each is a class built with its
settings and the services it needs (`BackendServices`) by the caller's composition root.

Paths are absolute paths under `root` or relative to it; `root` is where commands see the
workspace. Local backends confine every host-side read and write through `core/files.py`
(no symlink or `..` leads out, no FIFO or device is opened). `exec` takes a shell command
(a string: runs with the workspace writable, its `.git` read-only) or a trusted program
(a list: runs over a read-only workspace, as ripgrep and ruff do).
"""

from __future__ import annotations

import difflib
import hashlib
import os
import stat as stat_module
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from codeplane.core import files
from codeplane.sandbox.runner import CommandResult, Limits, Runner

if TYPE_CHECKING:
    from codeplane.sandbox.fleet import Fleet, Sandbox

SNAPSHOT_FILE_BYTES = 64 << 20  # larger files are left out of a snapshot
DIFF_FILE_BYTES = 1 << 20  # a snapshot keeps the contents of files up to this size for diffs


class UnknownBackend(ValueError):
    """No backend of that name; the message lists the ones there are."""


@dataclass(frozen=True)
class FileStat:
    """What `stat` and `list` report about one name, without following a final symlink."""

    kind: str  # "file" | "dir" | "symlink" | "other"
    size: int = 0
    target: str | None = None  # a symlink's target, as written


@dataclass(frozen=True)
class Entry:
    name: str
    stat: FileStat


@dataclass
class Snapshot:
    """A content-hash manifest (workspace-relative path -> sha256, "link:TARGET" for a
    symlink) plus the contents of small files, so `diff` can show what changed."""

    hashes: dict[str, str] = field(default_factory=dict)
    blobs: dict[str, bytes] = field(default_factory=dict)  # sha256 -> content


class Workspace(Protocol):
    root: Path
    sandboxed: bool

    def real(self, path: Path) -> Path:
        """The canonical absolute path of `path`; files.Refused if it leads outside."""

    def read(self, path: Path, max_bytes: int) -> bytes:
        """A regular file's bytes (files.TooLarge past max_bytes, files.Refused for
        anything else, FileNotFoundError)."""

    def write(self, path: Path, data: bytes) -> None:
        """Replace or create a file (and its directories) atomically."""

    def remove(self, path: Path) -> None:
        """Delete a regular file."""

    def stat(self, path: Path) -> FileStat | None:
        """What is at `path` (None: nothing), not following a final symlink."""

    def list(self, path: Path) -> list[Entry]:
        """A directory's entries, sorted by name."""

    def exec(self, command: str | list[str], limits: Limits,
             cancel: threading.Event | None = None, stderr: bool = True) -> CommandResult:
        """A shell command (str, workspace writable) or a trusted program (argv list,
        workspace read-only; stdout, plus stderr if asked) under `limits`."""

    def snapshot(self) -> Snapshot:
        """The current content of every file outside `.git`."""

    def diff(self, since: Snapshot) -> str:
        """A unified diff from `since` to now."""

    def describe(self) -> dict[str, Any]:
        """What the run's metadata records about this workspace."""

    def close(self) -> None:
        """Give the workspace back (a pool reuses it; a local directory stays as it is)."""


class LocalWorkspace:
    """A directory on this machine; commands go through a runner (bubblewrap or the host)."""

    def __init__(self, root: Path, runner: Runner) -> None:
        self.root = Path(os.path.realpath(root))
        self.runner = runner
        self.sandboxed = runner.sandboxed

    def real(self, path: Path) -> Path:
        return files.confine(self.root, path)

    def read(self, path: Path, max_bytes: int) -> bytes:
        return files.read_bytes(self.root, path, max_bytes)

    def write(self, path: Path, data: bytes) -> None:
        files.write_atomic(self.root, path, data)

    def remove(self, path: Path) -> None:
        files.remove(self.root, path)

    def stat(self, path: Path) -> FileStat | None:
        """lstat of the name inside its real (confined) parent directory."""
        full = path if path.is_absolute() else self.root / path
        if Path(os.path.abspath(full)) == self.root:
            return FileStat("dir")
        try:
            st = os.lstat(self.real(full.parent) / full.name)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return _file_stat(st, lambda: os.readlink(self.real(full.parent) / full.name))

    def list(self, path: Path) -> list[Entry]:
        folder = self.real(path)
        with os.scandir(folder) as it:  # DirEntry.stat(follow_symlinks=False): no escape
            entries = [Entry(e.name, _file_stat(e.stat(follow_symlinks=False),
                                                lambda e=e: os.readlink(e.path)))
                       for e in it]
        return sorted(entries, key=lambda e: e.name)

    def exec(self, command: str | list[str], limits: Limits,
             cancel: threading.Event | None = None, stderr: bool = True) -> CommandResult:
        if isinstance(command, str):
            return self.runner.run(command, self.root, limits, cancel)
        return self.runner.exec(command, self.root, limits, stderr)

    def snapshot(self) -> Snapshot:
        return take_snapshot(self)

    def diff(self, since: Snapshot) -> str:
        return diff_snapshots(since, take_snapshot(self))

    def describe(self) -> dict[str, Any]:
        return {"root": str(self.root), "sandboxed": self.sandboxed, **self.runner.describe()}

    def close(self) -> None:
        """Nothing to give back: the directory is the caller's."""


def _file_stat(st: os.stat_result, target: Callable[[], str]) -> FileStat:
    if stat_module.S_ISLNK(st.st_mode):
        return FileStat("symlink", 0, target())
    if stat_module.S_ISDIR(st.st_mode):
        return FileStat("dir")
    return FileStat("file" if stat_module.S_ISREG(st.st_mode) else "other", st.st_size)


# ---------------------------------------------------------------- snapshots over any backend

def take_snapshot(ws: Workspace) -> Snapshot:
    """Walk the workspace through its own `list`/`read` (so any backend can use this),
    iteratively, skipping `.git` (git keeps its own history, and a diff of its objects says
    nothing) and, like a file that vanished, a folder that cannot be listed (one past
    PATH_MAX, one swapped for a symlink leading out)."""
    snap = Snapshot()
    pending = [Path(".")]
    while pending:
        folder = pending.pop()
        try:
            entries = ws.list(ws.root / folder)
        except (files.Refused, OSError):
            continue
        for entry in entries:
            rel = (folder / entry.name).as_posix().removeprefix("./")
            if entry.stat.kind == "dir" and entry.name != ".git":
                pending.append(folder / entry.name)
            elif entry.stat.kind == "symlink":
                snap.hashes[rel] = f"link:{entry.stat.target}"
            elif entry.stat.kind == "file" and entry.stat.size <= SNAPSHOT_FILE_BYTES:
                _add_file(ws, snap, rel)
    return snap


def _add_file(ws: Workspace, snap: Snapshot, rel: str) -> None:
    try:
        data = ws.read(ws.root / rel, SNAPSHOT_FILE_BYTES)
    except (files.Refused, OSError):  # changed kind or vanished while walking
        return
    digest = hashlib.sha256(data).hexdigest()
    snap.hashes[rel] = digest
    if len(data) <= DIFF_FILE_BYTES:
        snap.blobs[digest] = data


def diff_snapshots(old: Snapshot, new: Snapshot) -> str:
    """A unified diff (git's a/ b/ prefixes, /dev/null for added and deleted files);
    binary or large files get a one-line note, as `git diff` prints without --binary."""
    out = []
    for rel in sorted(set(old.hashes) | set(new.hashes)):
        before, after = old.hashes.get(rel), new.hashes.get(rel)
        if before == after:
            continue
        a = _text_of(old, before)
        b = _text_of(new, after)
        if a is None or b is None:
            out.append(f"Binary files a/{rel} and b/{rel} differ\n")
            continue
        lines = difflib.unified_diff(a.splitlines(True), b.splitlines(True),
                                     f"a/{rel}" if before else "/dev/null",
                                     f"b/{rel}" if after else "/dev/null")
        out += (ln if ln.endswith("\n") else f"{ln}\n\\ No newline at end of file\n"
                for ln in lines)
    return "".join(out)


def _text_of(snap: Snapshot, digest: str | None) -> str | None:
    """A file's text as the diff shows it ("" if absent); None for binary or unkept data."""
    if digest is None:
        return ""
    if digest.startswith("link:"):
        return digest + "\n"
    data = snap.blobs.get(digest)
    if data is None or b"\0" in data:
        return None
    return data.decode("utf-8", "replace")


# ---------------------------------------------------------------- backends

@dataclass(frozen=True)
class BackendServices:
    """What a backend may need from the program it runs in, given by that program's
    composition root (`server/services.py` for a server; nothing for `codeplane agent`, the
    tools or RL): a backend takes its services from here, never from ambient state."""

    fleet: Fleet | None = None  # the server's sandbox fleet (the pool backend)
    tenant: str | None = None  # the caller, whose quotas a pooled sandbox counts against
    sandbox: Sandbox | None = None  # one the caller holds: opened, never released, by the pool


class Backend(Protocol):
    """A workspace backend, built from its row of `backends.BACKENDS` as
    `cls(settings, services)` (settings: the row's pydantic model)."""

    def open(self, root: Path, network: bool) -> Workspace:
        """The workspace for `root`; `network`: whether its commands may reach the network."""
