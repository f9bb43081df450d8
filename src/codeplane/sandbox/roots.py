"""Which directories a tenant's agent runs, sandboxes and background runs may work on (the
server's workspace-roots policy), and what a request may name as a repository.

Roots per tenant, one rule: while `[serve] tenant_roots` is empty, every tenant's roots are
`[serve] workspace_roots` (a laptop, a one-team server: as before). Once it names a tenant,
each keyed tenant has exactly its own entry (none when it is not named) and `workspace_roots`
are the keyless local tenant's alone, so a key made for a new tenant never opens anything.

A repository is a directory under the tenant's roots that git takes for a repository without
leaving them: a work tree whose `.git` is a directory (or a `gitdir:` file naming one), or a
bare repository. Its git directory, its common directory (`commondir`), the object
directories it borrows (`objects/info/alternates`, followed as git follows them) and every
top-level entry of those (a symlinked `objects/` included) must resolve under the same roots,
and neither it nor a directory above it up to its root may be tainted (`gitguard.tainted`:
a sweep after a sandboxed command could not finish there). Otherwise git on the host would
read another repository (another tenant's, the server's) through a file a sandbox wrote.
A repository may also be a `.bundle` file under the roots, or a URL (checked by the fleet
against `serve.repo_urls`).
"""

from __future__ import annotations

import os
from pathlib import Path

from codeplane.config import ServeSettings
from codeplane.core.errors import APIError
from codeplane.core.files import Refused, read_bytes
from codeplane.core.principal import LOCAL_TENANT
from codeplane.sandbox import urlfetch
from codeplane.sandbox.gitguard import first_line, git_dir_of, tainted

_ALTERNATES_DEPTH = 5  # git follows alternates of alternates this deep


class Roots:
    """One tenant's workspace roots and the checks of what a request names under them."""

    def __init__(self, paths: list[Path], tenant: str | None = None) -> None:
        self.paths = paths
        self.tenant = tenant  # set when the tenant was looked up in tenant_roots

    @classmethod
    def of(cls, serve: ServeSettings, tenant: str) -> Roots:
        """The roots of `tenant` under the rule above."""
        if not serve.tenant_roots or tenant == LOCAL_TENANT:
            return cls(list(serve.workspace_roots))
        return cls(list(serve.tenant_roots.get(tenant, [])), tenant)

    def directory(self, path: str, param: str = "path") -> Path:
        """`path` resolved (symlinks included) if it is a directory under one of the roots."""
        self._top(path, param)
        real = Path(os.path.realpath(path))
        try:
            is_dir = real.is_dir()
        except OSError as exc:
            raise APIError(400, f"path {path!r}: {exc.strerror}", param=param) from None
        if not is_dir:
            raise APIError(400, f"workspace {path} is not a directory", param=param)
        return real

    def repository(self, path: str, param: str = "repo") -> Path:
        """A directory under the roots that is a git repository lying wholly under them and
        not tainted; APIError otherwise."""
        real = self.directory(path, param)
        git_dir = _git_dir(real)
        if git_dir is None:
            raise APIError(400, f"{path} is not a git repository", code="not_a_repository",
                           param=param)
        for part in _parts(git_dir):
            if self._root_of(part) is None:
                raise APIError(403, f"repository {path} leads outside the workspace roots "
                                    f"(through {part.name!r} in its git directory): git would "
                                    "read a repository that is not yours",
                               code="outside_workspace_roots", param=param)
        top = self._root_of(real)
        for directory in (real, *real.parents):
            reason = tainted(directory)
            if reason is not None:
                raise APIError(409, f"{directory} is tainted ({reason}): a sandboxed command "
                                    "left a tree the server could not check for git metadata; "
                                    "an operator clears it by cleaning the tree and removing "
                                    f"{directory}/.git/codeplane-tainted",
                               code="workspace_tainted", param=param)
            if directory == top:
                break
        return real

    def repo(self, value: str) -> Path | str:
        """What a request names as its repo: a URL as it is (the fleet checks it against
        `serve.repo_urls` and fetches it), a `.bundle` file under the roots, or a checked
        repository directory."""
        if urlfetch.is_url(value):
            return value
        path = Path(value)
        if path.suffix == ".bundle" and path.is_absolute():
            real = self.directory(str(path.parent), "repo") / path.name
            if not real.is_file() or real.is_symlink():
                raise APIError(400, f"bundle {value} is not a regular file", param="repo")
            return real
        return self.repository(value)

    def _top(self, path: str, param: str) -> Path:
        """The root `path` lies under; 403 (naming this tenant's roots only) otherwise."""
        if not self.paths:
            raise self._none(param)
        if not Path(path).is_absolute():
            raise APIError(400, f"path {path!r} must be absolute", param=param)
        top = self._root_of(Path(os.path.realpath(path)))
        if top is None:
            allowed = ", ".join(str(r) for r in self.paths)
            raise APIError(403, f"path {path!r} is outside the workspace roots ({allowed})",
                           code="outside_workspace_roots", param=param)
        return top

    def _root_of(self, real: Path) -> Path | None:
        for root in self.paths:
            top = Path(os.path.realpath(root.expanduser()))
            if real == top or top in real.parents:
                return top
        return None

    def _none(self, param: str) -> APIError:
        if self.tenant is not None:
            return APIError(403, f"tenant {self.tenant!r} has no workspace roots on this "
                                 f"server: an operator names them in codeplane.toml, "
                                 f"`[serve.tenant_roots]` `{self.tenant} = [\"/srv/code\"]`. "
                                 "Or run the agent on your machine with `codeplane agent`",
                            code="no_workspace_roots", param=param)
        return APIError(403, "server-side agent runs are off: no workspace roots are "
                             "configured. An operator enables them by naming the directories "
                             "runs may work under: `workspace_roots = [\"/srv/code\"]` in the "
                             "[serve] section of codeplane.toml (or CODEPLANE_SERVE__WORKSPACE_"
                             "ROOTS='[\"/srv/code\"]'). Or run the agent on your machine with "
                             "`codeplane agent`", code="no_workspace_roots", param=param)


def _git_dir(directory: Path) -> Path | None:
    """The git directory git would use for `directory` (a work tree or a bare repository),
    found as git finds it but never outside `directory` itself."""
    if os.path.lexists(directory / ".git"):
        return git_dir_of(directory)
    if (directory / "HEAD").is_file() and not (directory / "HEAD").is_symlink():
        return directory
    return None


def _parts(git_dir: Path) -> list[Path]:
    """Every path git reads a repository through: its git and common directories, their
    top-level entries (resolved), and the object directories it borrows."""
    common = git_dir
    line = first_line(git_dir, git_dir / "commondir")
    if line:
        common = Path(os.path.realpath(git_dir / line))
    parts = [git_dir, common]
    for directory in {git_dir, common}:
        try:
            parts += [Path(os.path.realpath(e.path)) for e in os.scandir(directory)]
        except OSError:
            continue  # not a directory: git will refuse it
    return parts + _alternates(common / "objects")


def _alternates(objects: Path) -> list[Path]:
    """The object directories `objects` borrows, and theirs, as deep as git follows."""
    found: list[Path] = []
    pending = [(objects, 0)]
    while pending:
        directory, depth = pending.pop()
        try:  # through the resolver: a FIFO planted there cannot block the server
            text = read_bytes(directory, Path("info/alternates"), 64 << 10).decode(
                errors="replace")
        except (OSError, Refused):
            continue
        for line in text.splitlines()[:100]:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            target = Path(os.path.realpath(directory / line))
            found.append(target)
            if depth < _ALTERNATES_DEPTH:
                pending.append((target, depth + 1))
    return found
