"""Copy-on-write workspaces: how a sandbox's tree is made from a cached base checkout.

Four strategies, tried in the order `bench/fleet.py` measured them on this host class (ext4,
root): an overlayfs mount (a mount syscall: milliseconds and no data copied, whatever the
tree's size; needs CAP_SYS_ADMIN), `cp --reflink=always` (shared extents; needs btrfs/XFS,
refused by ext4), `git clone --shared` of the base (objects shared through alternates, the
work tree written out: cost grows with the tree), and a full copy (the baseline). `choose`
probes each on a tiny tree on the fleet's own filesystem and keeps the first that works, so
a host without root or without reflinks falls back instead of failing.

Every strategy builds `dest/ws` (the tree a sandbox works in) and nothing outside `dest`;
`teardown` undoes it, so the reaper can remove a sandbox knowing only its directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Protocol


class CloneError(RuntimeError):
    """A strategy could not make a workspace (its stderr says why)."""


def run_checked(argv: list[str], cwd: Path | None = None) -> str:
    """stdout of a trusted program (git, cp, mount); CloneError with its stderr."""
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300,
                          check=False, env={**os.environ, "GIT_TERMINAL_PROMPT": "0",
                                            "LC_ALL": "C"})
    if proc.returncode != 0:
        raise CloneError(f"{' '.join(argv[:3])}: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


class Strategy(Protocol):
    name: str

    def make(self, base: Path, dest: Path) -> None: ...


class Overlay:
    """An overlayfs mount: the base is the read-only lower layer, writes land in dest/upper."""

    name = "overlay"

    def make(self, base: Path, dest: Path) -> None:
        for part in ("upper", "work", "ws"):
            (dest / part).mkdir(parents=True)
        options = f"lowerdir={base},upperdir={dest / 'upper'},workdir={dest / 'work'}"
        run_checked(["mount", "-t", "overlay", "codeplane-fleet", "-o", options, str(dest / "ws")])


class Reflink:
    """Shared extents: a copy whose blocks are shared until written (btrfs, XFS)."""

    name = "reflink"

    def make(self, base: Path, dest: Path) -> None:
        dest.mkdir(parents=True)
        run_checked(["cp", "-a", "--reflink=always", "--", str(base), str(dest / "ws")])


class SharedClone:
    """`git clone --shared`: objects borrowed from the base, the work tree written out."""

    name = "git-shared"

    def make(self, base: Path, dest: Path) -> None:
        dest.mkdir(parents=True)
        commit = run_checked(["git", "-C", str(base), "rev-parse", "HEAD"]).strip()
        run_checked(["git", "clone", "--quiet", "--shared", "--no-checkout", "--", str(base),
              str(dest / "ws")])
        run_checked(["git", "-C", str(dest / "ws"), "checkout", "--quiet", "--detach", commit])


class FullCopy:
    """Every byte copied: the baseline every other strategy is measured against."""

    name = "copy"

    def make(self, base: Path, dest: Path) -> None:
        dest.mkdir(parents=True)
        shutil.copytree(base, dest / "ws", symlinks=True)


STRATEGIES: tuple[type, ...] = (Overlay, Reflink, SharedClone, FullCopy)


def by_name(name: str) -> Strategy:
    for kind in STRATEGIES:
        if kind.name == name:
            return kind()
    raise ValueError(f"unknown clone strategy {name!r}; one of "
                     f"{', '.join(k.name for k in STRATEGIES)} or auto")


def choose(scratch: Path, wanted: str = "auto") -> Strategy:
    """The named strategy, or (auto) the first in measured order that works on `scratch`'s
    filesystem: probed on a one-file git repository, then torn down."""
    if wanted != "auto":
        return by_name(wanted)
    probe = scratch / f".probe-{os.getpid()}"
    teardown(probe)
    base = probe / "base"
    base.mkdir(parents=True)
    (base / "f").write_text("probe\n")
    try:
        run_checked(["git", "-c", "user.name=codeplane", "-c", "user.email=fleet@localhost", "init",
              "--quiet", str(base)])
        run_checked(["git", "-C", str(base), "-c", "user.name=codeplane", "-c",
              "user.email=fleet@localhost", "commit", "--quiet", "--allow-empty", "-m", "p"])
        for kind in STRATEGIES:
            try:
                kind().make(base, probe / kind.name)
                return kind()
            except (CloneError, OSError):
                continue
        raise CloneError("no clone strategy works here")  # FullCopy failing: disk is broken
    finally:
        teardown(probe)


def mounts_under(root: Path) -> list[Path]:
    """Mount points at or below `root` (deepest first), from this mount namespace's table."""
    found = []
    prefix = str(root)
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as table:
        for line in table:
            point = _unescape(line.split()[4])
            if point == prefix or point.startswith(prefix + "/"):
                found.append(Path(point))
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\ooo octal."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def teardown(dest: Path) -> None:
    """Unmount whatever is mounted under dest (lazily if busy), then delete it."""
    for point in mounts_under(dest):
        subprocess.run(["umount", "-l", str(point)], capture_output=True, check=False,
                       timeout=60)
    shutil.rmtree(dest, ignore_errors=True)
    if dest.exists():  # rmtree skipped something (an immutable file, a busy mount)
        raise OSError(f"could not remove {dest}")
