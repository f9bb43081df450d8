"""Keep git metadata out of the sandbox's reach: a git repository is configuration the host
executes (hooks, `core.fsmonitor`, `core.pager`, aliases), so a sandboxed command that can
write one gets code run on the host the next time someone types `git status` there.

Before a command, every git directory in the workspace is mounted read-only: `.git`
directories at any depth, `.git` files (worktrees, submodules) and the gitdir they point to
when it lies inside the workspace, and bare-repository-shaped directories (git treats a
directory holding HEAD, objects/ and refs/ as a repository). When the workspace root has no
`.git` (a folder of a monorepo, a fresh project), an empty directory is mounted read-only in
its place for the command's lifetime, so `git init` there fails; an empty `.git` is not a
repository to git, which keeps looking in the parent directories as before.

After the command (when every process it started is dead) the workspace is walked again and
any git directory or `.git` entry that did not exist before is renamed aside
(`.git.codeplane-quarantine-<n>`; `HEAD` likewise for a bare-shaped directory): git no longer
finds it, and nothing the command wrote is deleted. The walk costs about as much as
`find . -name .git`; it is what makes nested `git init`s safe, which no mount can prevent.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from codeplane.sandbox.files import Refused, read_bytes

_QUARANTINE = ".codeplane-quarantine"
_BARE = ("HEAD", "objects", "refs")
_BARE_PARTS = (*_BARE, "config", "hooks", "info", "packed-refs")


class GitGuard:
    """Read-only binds for one command, and the sweep that runs after it."""

    def __init__(self, workspace: Path) -> None:
        self.workspace = workspace
        self.before = _git_entries(workspace)
        self.mask: Path | None = None

    def binds(self) -> list[str]:
        """bwrap arguments mounting every git directory read-only."""
        args: list[str] = []
        for path in sorted(self.before):
            if path.name == "HEAD":  # a bare-shaped directory: its parts (it may be the root)
                parts = [path.parent / p for p in _BARE_PARTS]
                args += [a for p in parts if p.exists() for a in ("--ro-bind", str(p), str(p))]
                continue
            if not path.is_symlink():  # a link is replaceable anyway: the sweep catches that
                args += ["--ro-bind", str(path), str(path)]
            target = _gitdir_target(self.workspace, path)
            if target is not None:
                args += ["--ro-bind", str(target), str(target)]
        root_git = self.workspace / ".git"
        if root_git not in self.before:
            try:
                root_git.mkdir()
                self.mask = root_git
                args += ["--ro-bind", str(root_git), str(root_git)]
            except FileExistsError:
                pass  # appeared since the walk (a concurrent command's mask): swept after
        return args

    def neutralise(self) -> str:
        """Rename aside every git entry the command created; a note saying what was moved."""
        if self.mask is not None:
            try:
                self.mask.rmdir()
            except OSError:
                pass  # still in use by a concurrent command, or no longer empty: swept below
        moved = []
        for path, ident in sorted(_git_entries(self.workspace).items()):
            if ident in self.before.values() or path == self.mask and _empty_dir(path):
                continue
            moved.append(_set_aside(path))
        if not moved:
            return ""
        names = ", ".join(str(m.relative_to(self.workspace)) for m in moved)
        return (f"[codeplane: git metadata created inside the sandbox was renamed aside "
                f"({names}): a repository written by a sandboxed command would run its hooks "
                f"and config on the host]")


def _git_entries(workspace: Path) -> dict[Path, tuple[int, ...]]:
    """Every `.git` entry and bare-shaped directory (keyed by its HEAD) under workspace ->
    its identity: (device, inode), plus the config file's inode for a bare-shaped one."""
    found: dict[Path, tuple[int, ...]] = {}
    # os.walk never follows symlinks; a symlink named .git is listed in dirnames or filenames
    for dirpath, dirnames, filenames in os.walk(workspace):
        if "HEAD" in filenames or "HEAD" in dirnames:
            names = set(dirnames) | set(filenames)
            if all(n in names for n in _BARE):
                here = Path(dirpath)
                config = here / "config"
                found[here / "HEAD"] = (*_ident(here / "HEAD"),
                                        _ident(config)[1] if os.path.lexists(config) else 0)
        if ".git" in dirnames or ".git" in filenames:
            found[Path(dirpath, ".git")] = _ident(Path(dirpath, ".git"))
            if ".git" in dirnames:
                dirnames.remove(".git")
    return found


def _ident(path: Path) -> tuple[int, int]:
    st = path.lstat()
    return st.st_dev, st.st_ino


def _gitdir_target(workspace: Path, entry: Path) -> Path | None:
    """The repository a `.git` file or symlink points to, when it lies in the workspace."""
    try:
        if entry.is_symlink():
            target = Path(os.path.realpath(entry))
        elif entry.is_file():
            data = read_bytes(workspace, entry, 4096)  # the resolver: no FIFO, no huge file
            line = data.decode(errors="replace").partition("\n")[0]
            if not line.startswith("gitdir:"):
                return None
            target = Path(os.path.realpath(entry.parent / line[len("gitdir:"):].strip()))
        else:
            return None
    except (OSError, Refused):
        return None
    inside = target != workspace and workspace in target.parents
    return target if inside and target.is_dir() else None


def _empty_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(path.lstat().st_mode) and not any(path.iterdir())
    except OSError:
        return False


def _set_aside(path: Path) -> Path:
    n = 0
    while True:
        target = path.with_name(f"{path.name}{_QUARANTINE}-{n}")
        if not os.path.lexists(target):
            os.rename(path, target)
            return target
        n += 1
