"""Keep git metadata out of the sandbox's reach: a git repository is configuration the host
executes (hooks, `core.fsmonitor`, `core.pager`, filters, aliases), so a sandboxed command that
can write one gets code run on the host the next time someone types `git status` there.

Before a command, every git directory in the workspace is mounted read-only: `.git`
directories at any depth, `.git` files (worktrees, submodules) and the gitdir they point to
when it lies inside the workspace, and directories git itself takes for a repository (a
`HEAD` beside `objects/` and `refs/`, or beside a `commondir` file naming where those live:
git's `is_git_directory`). When the workspace root has no `.git` (a folder of a monorepo, a
fresh project), an empty directory is mounted read-only in its place for the command's
lifetime, so `git init` there fails; an empty `.git` is not a repository to git, which keeps
looking in the parent directories as before.

After the command (when every process it started is dead) the workspace is walked again:
any git directory or `.git` entry that did not exist before is renamed aside
(`.git.codeplane-quarantine-<n>`; `HEAD` likewise for a repository-shaped directory), so git
no longer finds it and nothing the command wrote is deleted; and setuid/setgid bits are
removed from every regular file (a sandboxed root can set them on a file of the workspace,
which a local user of the host could then run).

The walk is iterative (Python 3.11's `os.walk` recurses and died on a 1,000-deep directory),
opens every directory without following a symlink and checks it is the one its parent
listed, and never raises: a walk that cannot finish (a path past PATH_MAX, a directory that
changed kind under it, more than `MAX_ENTRIES` entries) fails closed. The workspace is then
marked tainted: a file `codeplane-tainted` in its own git directory (made when there is
none), which commands cannot write, and which host code that would run git on the tree
checks (`tainted`) and refuses. The walk costs about as much as `find . -name .git` plus an
lstat per file.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable
from pathlib import Path

from codeplane.core.files import Refused, read_bytes

MAX_ENTRIES = 2_000_000  # a tree larger than this is not swept: the workspace is tainted
TAINT = "codeplane-tainted"  # the mark's name inside the workspace's git directory
_QUARANTINE = ".codeplane-quarantine"
_REPO_PARTS = ("HEAD", "objects", "refs", "config", "hooks", "info", "packed-refs",
               "commondir", "gitdir")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_SET_ID = stat.S_ISUID | stat.S_ISGID

Ident = tuple[int, ...]
Visit = Callable[[Path, int, dict[str, os.DirEntry]], Iterable[str]]


class GitGuard:
    """Read-only binds for one command, and the sweep that runs after it."""

    def __init__(self, workspace: Path) -> None:
        self.workspace = workspace
        self.before: dict[Path, Ident] = {}
        _walk(workspace, self._record)
        self.mask: Path | None = None

    def _record(self, path: Path, fd: int, entries: dict[str, os.DirEntry]) -> list[str]:
        found = _git_entries(path, fd, entries)
        self.before.update(found)
        return [n for n, e in entries.items() if n != ".git" and _is_dir(e)]

    def binds(self) -> list[str]:
        """bwrap arguments mounting every git directory read-only."""
        args: list[str] = []
        for path in sorted(self.before):
            if path.name == "HEAD":  # a repository-shaped directory: its parts (maybe the root)
                parts = [path.parent / p for p in _REPO_PARTS]
                args += [a for p in parts if p.exists() for a in ("--ro-bind", str(p), str(p))]
                target = _commondir_target(self.workspace, path.parent)
            else:
                if not path.is_symlink():  # a link is replaceable anyway: the sweep catches it
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
        """Rename aside every git entry the command created and strip setuid/setgid bits;
        taint the workspace if the walk cannot finish. A note saying what was done."""
        if self.mask is not None:
            try:
                self.mask.rmdir()
            except OSError:
                pass  # still in use by a concurrent command, or no longer empty: swept below
        sweep = _Sweep(self)
        problem = _walk(self.workspace, sweep.visit)
        notes = [_note("git metadata created inside the sandbox was renamed aside", sweep.moved,
                       self.workspace, "a repository written by a sandboxed command would run "
                       "its hooks and config on the host"),
                 _note("setuid/setgid bits were removed from", sweep.stripped, self.workspace,
                       "a file the sandbox marked so would run with its owner's rights on the "
                       "host")]
        if problem is not None:
            mark_tainted(self.workspace, problem)
            notes.append(f"[codeplane: the workspace could not be swept for git metadata "
                         f"({problem}); it is marked tainted, and the server refuses to run "
                         f"git on it or to use it as a repository]")
        return "\n".join(n for n in notes if n)


class _Sweep:
    """The after-command walk: what it renamed aside and what it stripped."""

    def __init__(self, guard: GitGuard) -> None:
        self.guard = guard
        self.known = set(guard.before.values())
        self.moved: list[Path] = []
        self.stripped: list[Path] = []

    def visit(self, path: Path, fd: int, entries: dict[str, os.DirEntry]) -> list[str]:
        enter = []
        for entry_path, ident in _git_entries(path, fd, entries).items():
            mask = self.guard.mask
            if ident in self.known or entry_path == mask and _empty_dir(entry_path):
                continue
            new = _set_aside(fd, entry_path)
            self.moved.append(new)
            if entry_path.name == ".git" and new.is_dir() and not new.is_symlink():
                enter.append(new.name)  # its files are swept for setuid bits too
        for name, entry in entries.items():
            if _is_dir(entry):
                if name != ".git":
                    enter.append(name)
            elif entry.is_file(follow_symlinks=False) and _strip_set_id(fd, name):
                self.stripped.append(path / name)
        return enter


def _walk(root: Path, visit: Visit) -> str | None:
    """Visit every directory under root, iteratively: `visit(path, fd, entries)` gets each
    directory's open fd and entries and returns the names of the subdirectories to enter.
    No symlink is followed, and a directory is entered only if it is still the one its
    parent listed. Never raises: the first reason the walk could not reach everything (the
    rest is still walked), or None."""
    try:
        st = os.lstat(root)
    except OSError as exc:
        return f"could not read the workspace: {exc.strerror}"
    pending = [(root, (st.st_dev, st.st_ino))]
    problem, count = None, 0
    while pending:
        path, ident = pending.pop()
        try:
            fd = os.open(path, _DIR_FLAGS)
        except FileNotFoundError:
            continue  # removed meanwhile (by a command still running): nothing to sweep there
        except OSError as exc:
            problem = problem or f"could not open {_rel(root, path)}: {exc.strerror}"
            continue
        try:
            here = os.fstat(fd)
            if (here.st_dev, here.st_ino) != ident:
                problem = problem or f"could not sweep {_rel(root, path)}: it changed meanwhile"
                continue
            with os.scandir(fd) as listing:
                entries = {e.name: e for e in listing}
            count += len(entries)
            if count > MAX_ENTRIES:
                return f"could not sweep more than {MAX_ENTRIES} entries"
            for name in visit(path, fd, entries):
                try:
                    child = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except OSError:
                    continue  # gone meanwhile
                if stat.S_ISDIR(child.st_mode):
                    pending.append((path / name, (child.st_dev, child.st_ino)))
        except OSError as exc:
            problem = problem or f"could not read {_rel(root, path)}: {exc.strerror}"
        finally:
            os.close(fd)
    return problem


def _git_entries(path: Path, fd: int, entries: dict[str, os.DirEntry]) -> dict[Path, Ident]:
    """The git entries of one directory -> their identity: a `.git` (its device and inode),
    and the directory itself, keyed by its HEAD, if git takes it for a repository (the
    inodes of HEAD, config and commondir: rewriting any of them is a new repository)."""
    found: dict[Path, Ident] = {}
    if "HEAD" in entries and ("commondir" in entries
                              or "objects" in entries and "refs" in entries):
        head = _ident(fd, "HEAD")
        found[path / "HEAD"] = (*head, *(_ident(fd, n)[1] if n in entries else 0
                                         for n in ("config", "commondir")))
    if ".git" in entries:
        found[path / ".git"] = _ident(fd, ".git")
    return found


def _ident(fd: int, name: str) -> tuple[int, int]:
    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
    return st.st_dev, st.st_ino


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


def _strip_set_id(fd: int, name: str) -> bool:
    """Remove the setuid/setgid bits of regular file `name` in fd; True if it had any."""
    try:
        if not os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode & _SET_ID:
            return False
        file_fd = os.open(name, _FILE_FLAGS, dir_fd=fd)
    except OSError:
        return False
    try:
        st = os.fstat(file_fd)
        if not stat.S_ISREG(st.st_mode) or not st.st_mode & _SET_ID:
            return False
        os.fchmod(file_fd, stat.S_IMODE(st.st_mode) & ~_SET_ID)
        return True
    except OSError:
        return False
    finally:
        os.close(file_fd)


def _gitdir_target(workspace: Path, entry: Path) -> Path | None:
    """The repository a `.git` file or symlink points to, when it lies in the workspace."""
    target = git_dir_of(entry.parent)
    if target is None or entry.is_dir() and not entry.is_symlink():
        return None
    return target if _inside(workspace, target) else None


def _commondir_target(workspace: Path, git_dir: Path) -> Path | None:
    """The common directory a repository-shaped directory names, when it lies in the
    workspace (and is not the directory itself)."""
    line = first_line(workspace, git_dir / "commondir")
    if line is None:
        return None
    target = Path(os.path.realpath(git_dir / line))
    return target if _inside(workspace, target) and target != git_dir else None


def git_dir_of(directory: Path) -> Path | None:
    """The real git directory `directory/.git` names: itself when it is a directory (or a
    symlink to one), the target of its `gitdir:` line when it is a file; None otherwise."""
    entry = directory / ".git"
    try:
        if entry.is_dir():
            return Path(os.path.realpath(entry))
        line = first_line(directory, entry) if entry.is_file() else None
    except OSError:
        return None
    if line is None or not line.startswith("gitdir:"):
        return None
    target = Path(os.path.realpath(directory / line[len("gitdir:"):].strip()))
    return target if target.is_dir() else None


def first_line(root: Path, path: Path) -> str | None:
    """The first line of a small regular file, through the resolver (no FIFO, no huge file,
    nothing outside root)."""
    try:
        data = read_bytes(root, path, 4096)
    except (OSError, Refused):
        return None
    return data.decode(errors="replace").partition("\n")[0].strip()


def _inside(workspace: Path, target: Path) -> bool:
    return target != workspace and workspace in target.parents and target.is_dir()


def _empty_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(path.lstat().st_mode) and not any(path.iterdir())
    except OSError:
        return False


def _set_aside(fd: int, path: Path) -> Path:
    """Rename `path` (an entry of the directory fd is open on) to a free quarantine name."""
    n = 0
    while True:
        name = f"{path.name}{_QUARANTINE}-{n}"
        try:
            os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            os.rename(path.name, name, src_dir_fd=fd, dst_dir_fd=fd)
            return path.with_name(name)
        n += 1


def _rel(root: Path, path: Path) -> str:
    rel = str(path.relative_to(root)) if path != root else "."
    return rel if len(rel) <= 120 else f"{rel[:60]}...{rel[-40:]} ({len(rel)} characters)"


def _note(what: str, paths: list[Path], workspace: Path, why: str) -> str:
    if not paths:
        return ""
    names = ", ".join(_rel(workspace, p) for p in paths[:10])
    more = f" and {len(paths) - 10} more" if len(paths) > 10 else ""
    return f"[codeplane: {what} ({names}{more}): {why}]"


# ---------------------------------------------------------------- taint

def mark_tainted(workspace: Path, reason: str) -> None:
    """Record that `workspace` could not be swept, in its own git directory (commands mount
    it read-only, so none can clear the mark); without one, a `.git` directory holding only
    the mark is made, which git does not take for a repository."""
    git_dir = git_dir_of(workspace)
    if git_dir is None:
        root_git = workspace / ".git"
        if os.path.lexists(root_git):  # a broken .git file or link: kept, renamed aside
            fd = os.open(workspace, _DIR_FLAGS)
            try:
                _set_aside(fd, root_git)
            finally:
                os.close(fd)
        root_git.mkdir()
        git_dir = root_git
    fd = os.open(git_dir / TAINT, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as mark:
        mark.write(reason[:2000] + "\n")


def tainted(directory: Path) -> str | None:
    """Why `directory` was marked tainted (the sweep after a command could not finish), or
    None. The mark stays until an operator removes it (`.git/codeplane-tainted`)."""
    git_dir = git_dir_of(directory)
    if git_dir is None or not os.path.lexists(git_dir / TAINT):
        return None
    return first_line(git_dir, git_dir / TAINT) or "its sweep could not finish"
