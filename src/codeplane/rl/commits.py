"""Localisation from real work: a commit's change request -> the files (and functions) it
changed.

A task is one commit of a public git history that is a change request by the search
benchmark's rule (rl/changes.py: the message's first paragraph is a request in words, not a
chore; 1-4 non-test Python files modified). The policy is asked what a user asks the product's
agent - the request, then "Which files would this change touch? Answer with their paths." -
in a snapshot of the commit's PARENT (the code before the change). The answer is the files the
commit modified and, for partial credit, the functions and classes whose lines it changed
(Python's `ast` on the parent's file: the innermost definition around each changed line).

Reward (`score`): F1 between the `.py` paths the final answer names and the changed files,
plus `FUNCTION_CREDIT` x the share of changed functions the answer names x the answer's file
precision (naming every function of the repository earns next to nothing), capped at 1. Success (reward 1)
needs exactly the changed files.

Repositories are git directories: a path (a bare mirror or a clone), `owner/name` (found
under `[tasks] mirrors` as `owner+name/repo`, else cloned from GitHub), or an https URL
(cloned). Clones and snapshots live under `~/.codeplane/rl/commits/<repo>/`; a snapshot is the
parent's tree exported once with `git archive` into `tarfile`'s `data` filter (no links or
paths out of the cache, no device files), nothing checked out, nothing of the repository run.
The split is by repository, and no benchmark repository may be named (`check_split`).
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from codeplane.rl import changes
from codeplane.rl.tasks import sample_tasks
from codeplane.sandbox.clone import SAFE_GIT, git_env

INSTRUCTION = "{request}\n\nWhich files would this change touch? Answer with their paths."
FUNCTION_CREDIT = 0.25  # the most that naming the changed functions adds to the file F1
MAX_SNAPSHOT_BYTES = 256 << 20  # a parent tree larger than this is not exported
_NAMED_PATH = re.compile(r"(?<![\w./-])(?:\./)?([\w.-][\w./-]*\.pyi?)(?![\w/])")
_OWNER_NAME = re.compile(r"^[\w.-]+/[\w.-]+$")
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@", re.MULTILINE)
Definition = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef

# Every repository a benchmark reads (bench/search, bench/apply's sets, bench/tab's and
# bench/agent's sdists, by project name, bench/nextedit's HELDOUT, HELDOUT2 and HELDOUT3):
# never a source of training or held-out tasks.
# tests/rl/test_commits.py checks this list against the benchmarks' own.
BENCHMARK_REPOSITORIES = frozenset({
    "pallets/click", "pallets/flask", "pallets/jinja", "psf/requests", "encode/httpx",
    "marshmallow-code/marshmallow", "python-attrs/attrs", "python-poetry/tomlkit",
    "delgan/loguru", "suor/funcy", "textualize/rich", "hynek/structlog", "jd/tenacity",
    "jpadilla/pyjwt", "more-itertools/more-itertools", "msiemens/tinydb",
    "pallets/itsdangerous", "pallets/markupsafe", "pytest-dev/pluggy",
    "python/typing_extensions", "tkem/cachetools", "jmespath/jmespath.py",
    "seperman/deepdiff", "alecthomas/voluptuous", "jab/bidict",
    "erikrose/parsimonious", "jazzband/prettytable", "pylons/webob", "scrapy/w3lib",
    "jazzband/tablib", "alir3z4/html2text", "pyeve/cerberus", "hgrecco/pint",
    "grahamdumpleton/wrapt", "sloria/environs", "jsonpickle/jsonpickle",
    "simplejson/simplejson", "madzak/python-json-logger", "jquast/wcwidth",
    "psf/cachecontrol", "rubik/radon", "aio-libs/yarl"})
BENCHMARK_PROJECTS = frozenset({
    "h11", "werkzeug", "jinja2", "markdown", "sqlparse", "humanize", "pyparsing", "pyflakes",
    "mistune", "boltons", "parso", "python-dotenv", "colorama", "tomli", "docopt",
    "asttokens", *(r.split("/")[1] for r in BENCHMARK_REPOSITORIES)})


class CommitsError(ValueError):
    """A repository of the config cannot be read or named; the message says which."""


@dataclass(frozen=True)
class HistoryTask:
    """What a task made of a commit has, whatever its family: the request, where it was
    read, and the snapshot each episode copies."""

    id: str
    repo: str
    snapshot: str
    instruction: str
    commit: str
    parent: str
    request: str


@dataclass(frozen=True)
class CommitTask(HistoryTask):
    """One localisation task: `snapshot` is the parent's tree; `files` the changed source
    files, `symbols` the (path, qualified name) of the definitions whose lines the commit
    changed."""

    files: tuple[str, ...]
    symbols: tuple[tuple[str, str], ...]


def score(task: CommitTask, answer: str) -> float:
    """F1 of the named `.py` paths against the changed files, plus `FUNCTION_CREDIT` x the
    share of changed definitions named x the file precision; at most 1."""
    named = set(named_files(answer))
    right = len(named & set(task.files))
    if not right:
        return 0.0
    precision, recall = right / len(named), right / len(task.files)
    f1 = 2 * precision * recall / (precision + recall)
    share = (sum(_names(answer, qualname) for _, qualname in task.symbols) / len(task.symbols)
             if task.symbols else 0.0)
    return min(1.0, f1 + FUNCTION_CREDIT * precision * share)


def named_files(answer: str) -> list[str]:
    """The `.py` paths an answer names, in order, each once (what `score` rewards)."""
    return list(dict.fromkeys(m.removeprefix("./") for m in _NAMED_PATH.findall(answer or "")))


def _names(answer: str, qualname: str) -> bool:
    """Does the answer name this definition? Its qualified name, or its own name as a whole
    identifier (a dunder only qualified: "__init__" alone names no one)."""
    own = qualname.rsplit(".", 1)[-1]
    wanted = [qualname] if own.startswith("__") else [qualname, own]
    return any(re.search(rf"(?<![\w.]){re.escape(w)}(?!\w)", answer) for w in wanted)


def check_split(train: list[str], heldout: list[str]) -> None:
    """ValueError when the two lists share a repository or name a benchmark's."""
    names = {spec: repo_name(spec) for spec in [*train, *heldout]}
    shared = {names[s] for s in train} & {names[s] for s in heldout}
    if shared:
        raise ValueError(f"[tasks] train_repos and heldout_repos share {sorted(shared)}: the "
                         "split is by repository")
    benchmarks = sorted(s for s, n in names.items() if is_benchmark(n))
    if benchmarks:
        raise ValueError(f"[tasks] names benchmark repositories {benchmarks}: tasks come from "
                         "histories disjoint from every benchmark (rl/commits.py "
                         "BENCHMARK_REPOSITORIES)")


def is_benchmark(name: str) -> bool:
    """`owner/name`, `owner+name` or a PyPI project name that some benchmark reads."""
    owner_name = name.replace("+", "/").lower()
    return owner_name in BENCHMARK_REPOSITORIES or owner_name.split("/")[-1] in BENCHMARK_PROJECTS


def repo_name(spec: str) -> str:
    """The cache's name for a repository: `owner+name` for owner/name and URLs (a mirror's
    directory name, `owner+name/repo`, too), else the directory's name."""
    if "://" in spec:
        spec = urlsplit(spec).path.strip("/").removesuffix(".git")
    if _OWNER_NAME.match(spec) and not spec.startswith("."):
        return spec.replace("/", "+")
    path = Path(spec).expanduser()
    if path.name in ("repo", ".git"):
        path = path.parent
    if path.name == "repo":  # a mirror laid out as owner+name/repo/.git
        path = path.parent
    return path.name.removesuffix(".git")


def is_path(spec: str) -> bool:
    """A path entry: absolute, `~`, or starting with `./` or `../` (owner/name is not)."""
    return spec.startswith(("/", "~", "./", "../"))


def git_dir(spec: str, cache: Path, mirrors: Path | None) -> Path:
    """The git directory holding the history `spec` names; an owner/name not under
    `mirrors`, or a URL, is cloned once into the cache."""
    if is_path(spec):
        path = Path(spec).expanduser()
        found = path / ".git" if (path / ".git").is_dir() else path
        if not (found / "HEAD").is_file():
            raise CommitsError(f"{spec} is not a git repository")
        return found
    if mirrors is not None and _OWNER_NAME.match(spec):
        mirror = mirrors / repo_name(spec) / "repo"
        for found in (mirror / ".git", mirror):
            if (found / "HEAD").is_file():
                return found
    url = spec if "://" in spec else f"https://github.com/{spec}.git"
    if urlsplit(url).scheme != "https":
        raise CommitsError(f"{spec}: only https URLs are cloned")
    return _clone(url, cache / "commits" / repo_name(spec) / "history.git")


def _clone(url: str, dest: Path) -> Path:
    """A bare clone of `url`, made once (into a staging directory renamed when whole)."""
    if (dest / "HEAD").is_file():
        return dest
    staging = dest.with_name(dest.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["git", *SAFE_GIT, "-c", "protocol.allow=never", "-c",
                           "protocol.https.allow=always", "clone", "--bare", "--quiet",
                           "--no-recurse-submodules", "--", url, str(staging)],
                          capture_output=True, text=True, env=git_env(), check=False)
    if done.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise CommitsError(f"could not clone {url}: {done.stderr.strip()[-300:]}")
    staging.rename(dest)
    return dest


def commit_tasks(name: str, where: Path, cache: Path, newest: int) -> list[CommitTask]:
    """The change requests among the `newest` non-merge commits of the history in `where`
    (the repository `name`), as tasks whose snapshots are not exported yet (`export` does,
    for the tasks a run uses)."""
    tasks = []
    for change, request in change_requests(where, newest):
        try:
            symbols = changed_symbols(where, change)
        except subprocess.CalledProcessError:  # objects a partial mirror lacks
            continue
        tasks.append(CommitTask(
            f"{name}:{change.commit[:12]}", name, str(cache / "commits" / name / change.parent),
            INSTRUCTION.format(request=request), change.commit, change.parent, request,
            change.files, symbols))
    return tasks


def change_requests(where: Path, newest: int) -> Iterator[tuple[changes.Change, str]]:
    """Each commit among the `newest` that is a change request (rl/changes.py's rule), with
    its request: what the localisation and the fix families are both made of."""
    for change in changes.modified_commits(where, newest):
        try:
            request = changes.change_request(changes.message(where, change.commit))
        except subprocess.CalledProcessError:  # objects a partial mirror lacks
            continue
        if request:
            yield change, request


def changed_symbols(where: Path, change: changes.Change) -> tuple[tuple[str, str], ...]:
    """(path, qualified name) of the innermost definition around each line of the parent's
    files that the commit changed (an insertion counts for the definition it lands inside)."""
    out: dict[tuple[str, str], None] = {}
    for path in change.files:
        diff = changes.git(where, "diff", "-U0", "--no-ext-diff", "--no-textconv",
                           "--no-color", "--no-renames", change.parent, change.commit,
                           "--", path)
        try:
            tree = ast.parse(changes.git(where, "show", f"{change.parent}:{path}"))
        except (SyntaxError, ValueError):
            continue
        spans = _definitions(tree)
        for start, count in _HUNK.findall(diff):
            first = int(start)
            # a pure insertion (count 0) lands between lines `first` and `first + 1`
            lines = [first + 0.5] if count == "0" else range(first, first + int(count or 1))
            for line in lines:
                inner = [(lo, qual) for lo, hi, qual in spans if lo <= line <= hi]
                if inner:
                    out[(path, max(inner)[1])] = None
    return tuple(out)


def _definitions(tree: ast.Module) -> list[tuple[int, int, str]]:
    """(first line with decorators, last line, qualified name) of every function and class."""
    found: list[tuple[int, int, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, Definition):
                qual = f"{prefix}{child.name}"
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                found.append((first, child.end_lineno or child.lineno, qual))
                visit(child, qual + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def export(task: CommitTask, where: Path) -> None:
    """The task's snapshot, the parent's tree, exported from `where` once (`export_tree`)."""
    export_tree(where, task.parent, Path(task.snapshot))


def export_tree(where: Path, rev: str, dest: Path) -> None:
    """The tree of `rev` exported into `dest` once: `git archive` streamed into tarfile's
    `data` filter, in a staging directory renamed when whole. A tree over
    `MAX_SNAPSHOT_BYTES` raises CommitsError."""
    if dest.is_dir():
        return
    size = sum(int(line.split()[3]) for line in changes.git(
        where, "ls-tree", "-r", "-l", rev).splitlines() if line.split()[3] != "-")
    if size > MAX_SNAPSHOT_BYTES:
        raise CommitsError(f"{rev}: the tree is {size} bytes, over the limit")
    staging = dest.with_name(dest.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with subprocess.Popen(["git", *SAFE_GIT, "--git-dir", str(where), "archive",
                           "--format=tar", rev], stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, env=git_env()) as proc:
        assert proc.stdout is not None
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
            tar.extractall(staging, filter=_data_or_skip)
    if proc.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise CommitsError(f"git archive of {rev} failed")
    staging.rename(dest)


def _data_or_skip(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    """tarfile's `data` filter, leaving out a member it refuses (a link out of the tree)
    instead of failing the whole snapshot."""
    try:
        return tarfile.data_filter(member, dest)
    except tarfile.FilterError:
        return None


def load_commit_tasks(specs: list[str], cache: Path, newest: int, mirrors: Path | None,
                      limit: int, seed: int) -> list[CommitTask]:
    """At most `limit` tasks of the repositories (seeded sample), their snapshots exported.
    A task whose snapshot cannot be exported, or lacks the changed files (an `export-ignore`
    attribute in the repository), is dropped: its answer could not be found."""
    wheres = {repo_name(s): git_dir(s, cache, mirrors) for s in specs}
    tasks = [t for name, where in wheres.items() for t in commit_tasks(name, where, cache, newest)]
    chosen = []
    for task in sample_tasks(tasks, limit, seed):
        try:
            export(task, wheres[task.repo])
        except (CommitsError, subprocess.CalledProcessError):
            continue  # too large, or its tree not whole in the mirror
        if all((Path(task.snapshot) / f).is_file() for f in task.files):
            chosen.append(task)
    return chosen
