"""Copy-on-write workspaces: how a sandbox's tree is made from a cached base checkout.

Four strategies, fastest first as `bench/fleet.py` measured them on this host class (ext4,
root; docs/fleet.md, "How a sandbox is made (measured)"): an overlayfs mount (one mount
syscall, no data copied, whatever the tree's size; needs CAP_SYS_ADMIN), `cp --reflink=always`
(shared extents; needs btrfs/XFS, refused by ext4), `git clone --local` of the base (objects
hard-linked, the work tree written out: cost grows with the tree), and a full copy (the
baseline). `choose` probes each on a tiny tree on the fleet's own filesystem and keeps the
first that works, so a host without root or without reflinks falls back instead of failing.

Every strategy builds `dest/ws` (the tree a sandbox works in) and nothing outside `dest`;
every object the tree's `.git` needs lies inside it (no alternates pointing at the base), so
git run inside the sandbox, which sees nothing but the tree, finds them all. `teardown` undoes
it, so the reaper can remove a sandbox knowing only its directory.

Copies and removals use coreutils (`cp -a`, `rm -rf`), not `shutil`: on Python 3.11
`shutil.copytree` and `shutil.rmtree` recurse, and a tree 1,000 directories deep (which any
sandboxed command can make) raised RecursionError; coreutils walk any depth, past PATH_MAX.

Host-side git here runs over the fleet's own bases and mirrors, or a repository under the
workspace roots, with no system or global config (`git_env`): an operator's `~/.gitconfig`
neither changes what is cloned nor disables git's own ownership check (`safe.directory`).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Protocol


class CloneError(RuntimeError):
    """A strategy could not make a workspace (its stderr says why)."""


# `git -c` settings for host-side git over a repository: nothing it may name runs
SAFE_GIT = ("-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null")


def git_env() -> dict[str, str]:
    """The environment of host-side git: no system or global config, no prompt."""
    return {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
            "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C"}


def run_checked(argv: list[str], cwd: Path | None = None) -> str:
    """stdout of a trusted program (git, cp, mount); CloneError with its stderr."""
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300,
                          check=False, env=git_env())
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
    """`git clone --local`: objects hard-linked from the base (not borrowed through
    alternates, which would name a path the sandbox cannot see), the work tree written out.
    The name is kept from when it cloned `--shared`: configs name it."""

    name = "git-shared"

    def make(self, base: Path, dest: Path) -> None:
        dest.mkdir(parents=True)
        commit = run_checked(["git", *SAFE_GIT, "-C", str(base), "rev-parse", "HEAD"]).strip()
        run_checked(["git", *SAFE_GIT, "clone", "--quiet", "--local", "--no-checkout", "--",
                     str(base), str(dest / "ws")])
        run_checked(["git", *SAFE_GIT, "-C", str(dest / "ws"), "checkout", "--quiet",
                     "--detach", commit])


class FullCopy:
    """Every byte copied: the baseline every other strategy is measured against."""

    name = "copy"

    def make(self, base: Path, dest: Path) -> None:
        dest.mkdir(parents=True)
        run_checked(["cp", "-a", "--reflink=never", "--", str(base), str(dest / "ws")])


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
        identity = ("-c", "user.name=codeplane", "-c", "user.email=fleet@localhost")
        run_checked(["git", *identity, "init", "--quiet", str(base)])
        run_checked(["git", "-C", str(base), *identity, "commit", "--quiet", "--allow-empty",
                     "-m", "p"])
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
    """Unmount whatever is mounted under dest (lazily if busy), then delete it, at any depth,
    never crossing into another filesystem (a mount that would not go)."""
    for point in mounts_under(dest):
        subprocess.run(["umount", "-l", str(point)], capture_output=True, check=False,
                       timeout=60)
    if not os.path.lexists(dest):
        return
    done = subprocess.run(["rm", "-rf", "--one-file-system", "--", str(dest)],
                          capture_output=True, text=True, check=False, timeout=3600)
    if os.path.lexists(dest):  # an immutable file, a busy mount
        raise OSError(f"could not remove {dest}: {done.stderr.strip()[-300:]}")
