"""Fix from real work: a commit's change to one function removed again, its tests to pass.

A task is one commit of a public git history that is a change request by the search
benchmark's rule (rl/changes.py) and that (i) modifies exactly one function or method - of
the functions `ast` finds in its one modified non-test `.py` file, parent and commit, one
differs and none is added or removed; no other source file is added, deleted or renamed -
and (ii) modifies or adds test files such that at least one of their tests FAILS with the
parent's version of that function and PASSES with the commit's. The snapshot is the commit's
tree (so its tests are there) with that one function's source replaced by the parent's.
The policy is asked what a user asks the product's agent: the request, then which tests
fail ("The test tests/test_x.py::test_y fails. Fix the code so it passes.").

Reward (`verify`): 1 when those tests pass, run with pytest in the episode's sandbox, and no
test or test-configuration file (`PROTECTED`) differs from the snapshot's; else 0.

Building a task runs the repository's tests, so that happens in sandboxes too (testfix.py's
`sandboxed`: the same workspace backends the environment servers use), never on the host:
the commit's test files once on the snapshot, the failing ones once on the commit's tree.
The result (the failing tests, or none: no task) is cached next to the snapshot under
`~/.codeplane/rl/fixcommits/<repo>/`, so a commit is built once. Histories are read and
trees exported as the commits family does (rl/commits.py); the sandbox's python has pytest
and the packages of codeplane's own environment, and nothing is installed: a repository whose
tests need more makes no tasks.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import re
import shlex
import shutil
import stat
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from codeplane.agent.env import Environment
from codeplane.rl import changes
from codeplane.rl.commits import (
    CommitsError,
    HistoryTask,
    change_requests,
    export_tree,
    git_dir,
    repo_name,
)
from codeplane.rl.testfix import TEST_TIMEOUT, functions, sandboxed
from codeplane.sandbox import DEFAULT_BACKEND

SHOWN_TESTS = 3  # the instruction names at most this many failing tests
# files that decide what pytest runs and how (a changed one could make any test "pass")
PROTECTED = frozenset({"conftest.py", "pytest.ini", "pyproject.toml", "setup.cfg", "tox.ini",
                       "sitecustomize.py", "usercustomize.py"})
PYTEST = ("PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=src python -m pytest -q --tb=no --color=no "
          "--rootdir=. --continue-on-collection-errors -p no:cacheprovider -o addopts= ")
_OUTCOME = re.compile(r"^(PASSED|FAILED|ERROR|XPASS|XFAIL) (\S.*?::.+?)(?: - .*)?$",
                      re.MULTILINE)


@dataclass(frozen=True)
class FixCommitTask(HistoryTask):
    """One fix task: `snapshot` is the commit's tree with `function` of `path` as the
    parent had it; `tests` the pytest node ids that fail there and pass on the commit."""

    path: str
    function: str
    tests: tuple[str, ...]


def verify(task: FixCommitTask, env: Environment, repo: Path) -> float:
    """The verifier: 1.0 when the task's tests pass in the episode's sandbox and no test or
    test-configuration file differs from the snapshot's, else 0.0."""
    if protected_files(repo) != protected_files(Path(task.snapshot)):
        return 0.0
    results = pytest_results(env, task.tests) or {}
    return float(all(results.get(t) == "PASSED" for t in task.tests))


def pytest_results(env: Environment, args: tuple[str, ...], report: str = "A"
                   ) -> dict[str, str] | None:
    """Test outcomes (PASSED, FAILED, ERROR, XPASS, XFAIL) by node id, from one pytest run of
    `args` (files or node ids) in the environment's sandbox, with the repository's own
    addopts left out; `report` is pytest's -r letters ("A": every test, "fE": only failures
    and errors, which keeps a large file's output under the sandbox's cap). None when it
    timed out or its output was cut."""
    result = env.run(f"{PYTEST}-r{report} {' '.join(map(shlex.quote, args))}", TEST_TIMEOUT)
    if result.exit_code is None or result.killed or result.truncated:
        return None
    return {test: outcome for outcome, test in _OUTCOME.findall(result.output)}


def protected_files(root: Path) -> dict[str, str]:
    """Path -> digest of every test file (changes.is_test) and `PROTECTED` file under
    `root`. Only regular files are read, never through a link: a symlink or a FIFO the
    policy planted is recorded by its kind (a read of a FIFO would block the host)."""
    found = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != ".git"]
        for name in files:
            file = Path(folder) / name
            rel = file.relative_to(root).as_posix()
            if name in PROTECTED or changes.is_test(rel):
                found[rel] = _digest(file)
    return found


def _digest(file: Path) -> str:
    """sha256 of a regular file's bytes (streamed), else its kind."""
    mode = file.lstat().st_mode
    if not stat.S_ISREG(mode):
        return f"not a regular file: {stat.S_IFMT(mode):o}"
    fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with open(fd, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def changed_function(before: str, after: str) -> tuple[str, str] | None:
    """(qualified name, the parent's source of it) when exactly one function or method
    differs between the two versions of a file and none was added or removed."""
    try:
        old, new = _sources(before), _sources(after)
    except (SyntaxError, ValueError):
        return None
    changed = [q for q in old.keys() | new.keys() if old.get(q) != new.get(q)]
    if len(changed) != 1 or changed[0] not in old or changed[0] not in new:
        return None
    return changed[0], old[changed[0]]


def _sources(text: str) -> dict[str, str]:
    """Qualified name -> source lines (decorators included) of each function and method."""
    lines = text.splitlines(keepends=True)
    return {qual: "".join(lines[_first(node) - 1:node.end_lineno])
            for node, qual in functions(ast.parse(text))}


def _first(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    return min([node.lineno, *(d.lineno for d in node.decorator_list)])


def with_function(text: str, qualname: str, source: str) -> str:
    """`text` with the function `qualname`'s lines replaced by `source`."""
    node = next(n for n, q in functions(ast.parse(text)) if q == qualname)
    lines = text.splitlines(keepends=True)
    return "".join([*lines[:_first(node) - 1], source, *lines[node.end_lineno:]])


def instruction(request: str, tests: tuple[str, ...]) -> str:
    """The request, then which tests fail, as a user asks the product's agent."""
    shown = ", ".join(tests[:SHOWN_TESTS])
    more = f" and {len(tests) - SHOWN_TESTS} more" if len(tests) > SHOWN_TESTS else ""
    if len(tests) == 1:
        return f"{request}\n\nThe test {shown} fails. Fix the code so it passes."
    return f"{request}\n\nThe tests {shown}{more} fail. Fix the code so they pass."


def build(name: str, where: Path, change: changes.Change, request: str, home: Path,
          backend: str = DEFAULT_BACKEND) -> FixCommitTask | None:
    """The commit's task, or None; built once (tests run in sandbox), the result cached in
    `home/<commit>.json` next to the snapshot `home/<commit>`."""
    record = home / f"{change.commit}.json"
    if record.is_file():
        found = json.loads(record.read_text())
        return found and FixCommitTask(**{**found, "tests": tuple(found["tests"])})
    task = _build(name, where, change, request, home, backend)
    record.write_text(json.dumps(task and asdict(task)))
    return task


def _build(name: str, where: Path, change: changes.Change, request: str, home: Path,
           backend: str) -> FixCommitTask | None:
    """Test the commit's test files on the commit's tree with the parent's function, then
    the ones that failed on the commit's own tree; the snapshot is kept when some pass."""
    if len(change.files) != 1 or not change.tests or change.other_sources:
        return None
    path = change.files[0]
    after = changes.git(where, "show", f"{change.commit}:{path}")
    found = changed_function(changes.git(where, "show", f"{change.parent}:{path}"), after)
    if found is None:
        return None
    qualname, before = found
    snapshot = home / change.commit
    export_tree(where, change.commit, snapshot)
    (snapshot / path).write_text(with_function(after, qualname, before))
    try:
        fixed = _fixed_tests(snapshot, change.tests, backend, (path, after))
    except CommitsError:
        shutil.rmtree(snapshot)
        raise
    if not fixed:
        shutil.rmtree(snapshot)
        return None
    return FixCommitTask(f"{name}:{change.commit[:12]}", name, str(snapshot),
                         instruction(request, fixed), change.commit, change.parent, request,
                         path, qualname, fixed)


def _fixed_tests(snapshot: Path, tests: tuple[str, ...], backend: str,
                 commits_file: tuple[str, str]) -> tuple[str, ...]:
    """The tests of the commit's test files that fail on the snapshot (a whole file is run,
    only failures reported) and pass with the commit's file written back."""
    failing = tuple(t for t, r in _outcomes(snapshot, tests, backend, "fE").items()
                    if r in ("FAILED", "ERROR"))
    if not failing:
        return ()
    return tuple(t for t, r in _outcomes(snapshot, failing, backend, "A", commits_file).items()
                 if r == "PASSED")


def _outcomes(snapshot: Path, args: tuple[str, ...], backend: str, report: str,
              write: tuple[str, str] | None = None) -> dict[str, str]:
    """pytest's outcomes for `args` on a scratch copy of the snapshot (a test that writes
    into its repository leaves the snapshot as it was), one file first replaced if asked.
    A run cut short raises CommitsError: the commit is tried again next time, not cached."""
    scratch = snapshot.with_name(snapshot.name + ".run")
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(snapshot, scratch, symlinks=True)
    try:
        if write:
            (scratch / write[0]).write_text(write[1])
        with sandboxed(scratch, backend) as env:
            found = pytest_results(env, args, report)
        if found is None:
            raise CommitsError(f"{snapshot.name}: the tests timed out or printed too much")
        return found
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def load_fixcommit_tasks(specs: list[str], cache: Path, newest: int, mirrors: Path | None,
                         limit: int, seed: int, backend: str = DEFAULT_BACKEND
                         ) -> list[FixCommitTask]:
    """At most `limit` tasks of the repositories: their candidate commits in a seeded order,
    built (or read from the cache) until `limit` are tasks."""
    candidates = []
    for spec in specs:
        name, where = repo_name(spec), git_dir(spec, cache, mirrors)
        candidates += [(name, where, change, request) for change, request
                       in change_requests(where, newest)
                       if len(change.files) == 1 and change.tests]
    random.Random(seed).shuffle(candidates)
    tasks: list[FixCommitTask] = []
    for name, where, change, request in candidates:
        if len(tasks) >= limit:
            break
        home = cache / "fixcommits" / name
        home.mkdir(parents=True, exist_ok=True)
        try:
            task = build(name, where, change, request, home, backend)
        except (CommitsError, subprocess.CalledProcessError, UnicodeDecodeError):
            continue  # a tree too large or not whole in the mirror, a file not text
        if task:
            tasks.append(task)
    return sorted(tasks, key=lambda t: t.id)
