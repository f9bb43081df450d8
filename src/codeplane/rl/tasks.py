"""Verifiable tasks from real public code: "where is X implemented? answer path:line".

A task is a repository snapshot (a directory; each episode works on a fresh copy of it), an
instruction and a verifier. The family here is made from Python sources: every function or
class with a docstring becomes "Which function or class <first docstring line>?", and the
reward is 1 when the answer names the right file and a line inside the definition, 0.5 for the
right file, 0 otherwise. It needs the product's search tools (grep, codebase_search,
read_file) and a small model can get better at it: the signal is dense (partial credit) and
the answer format is short.

Repositories come from PyPI sdists (`fetch_sdist`, cached under `~/.codeplane/rl/`); the
train/held-out split is by repository, so held-out success measures transfer to code the
policy never searched. Python's own `ast` finds the definitions: exact line spans for Python,
no grammar package to load (tree-sitter would be needed only for other languages).
"""

from __future__ import annotations

import ast
import hashlib
import itertools
import random
import re
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

ANSWER = re.compile(r"([\w./-]+\.py)\s*:\s*(\d+)")
MAX_SOURCE_BYTES = 256 << 10  # larger files are generated code, not something to search
# How the question is asked (`[tasks] instruction`). "search" leaves the search to the model;
# "grep" names the call, pattern included, so one grep and one answer solve it: code-small at
# base does not solve the "search" wording (it invents tool names; docs/rl.md has the counts),
# and a policy at 0 never sees a reward to learn from. What is verified is the same either way.
INSTRUCTIONS = {
    "search": ("Which {kind} in this repository is documented as \"{summary}\"? Find it with "
               "grep (search for a few words of that sentence), then answer with its "
               "path:line."),
    "grep": ("Which {kind} in this repository is documented as \"{summary}\"? Call grep with "
             "{{\"pattern\": \"{pattern}\"}}, then answer with the path:line of the match in a "
             ".py file."),
}
PATTERN_WORDS = 5  # enough words of the summary to match few lines, few enough to copy
_NOT_LITERAL = re.compile(r"[()\[\]*+?{}|^$\\\"`]")


@dataclass(frozen=True)
class Task:
    """One verifiable task. `snapshot` is the directory each episode copies; the answer is
    `path` (relative) and the definition's lines `start`..`end` (1-based, inclusive)."""

    id: str
    repo: str
    snapshot: str
    instruction: str
    path: str
    start: int
    end: int


def score(task: Task, answer: str) -> float:
    """1.0 for `path:line` inside the definition, 0.5 for the right file, else 0.0; the last
    `path:line` in the answer counts (models think aloud before answering)."""
    found = ANSWER.findall(answer or "")
    if not found:
        return 0.0
    path, line = found[-1]
    path = path.removeprefix("./")
    if path != task.path:
        return 0.0
    return 1.0 if task.start <= int(line) <= task.end else 0.5


def grep_pattern(summary: str) -> str:
    """The first words of `summary` (at most `PATTERN_WORDS`), up to the first one with regex
    syntax or a quote: the pattern the "grep" instruction names, a regex that matches itself
    and that the model can copy into JSON as it is."""
    words = list(itertools.takewhile(lambda w: not _NOT_LITERAL.search(w),
                                     summary.split()[:PATTERN_WORDS]))
    return " ".join(words) or summary.split()[0]


def locate_tasks(repo: str, root: Path, instruction: str = "search") -> list[Task]:
    """Every documented function and class under `root` as a task, sorted by id. A docstring
    line shared by two definitions is skipped: the answer must be unique to be verifiable.
    `instruction` picks the question's wording (`INSTRUCTIONS`)."""
    found: dict[str, list[Task]] = {}
    for file in sorted(root.rglob("*.py")):
        rel = file.relative_to(root).as_posix()
        if any(part.startswith(".") for part in file.relative_to(root).parts):
            continue
        for node, summary in _documented(file):
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            question = INSTRUCTIONS[instruction].format(kind=kind, summary=summary,
                                                        pattern=grep_pattern(summary))
            digest = hashlib.sha256(f"{repo}\0{rel}\0{node.name}".encode()).hexdigest()[:12]
            found.setdefault(summary, []).append(Task(
                f"{repo}:{digest}", repo, str(root), question, rel, node.lineno,
                node.end_lineno or node.lineno))
    return sorted((ts[0] for ts in found.values() if len(ts) == 1), key=lambda t: t.id)


def _documented(file: Path) -> list[tuple[ast.AST, str]]:
    """(definition, first docstring line) for documented functions and classes in `file`;
    nothing for files that are too large or do not parse."""
    if file.stat().st_size > MAX_SOURCE_BYTES:
        return []
    try:
        tree = ast.parse(file.read_bytes())
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            doc = ast.get_docstring(node) or ""
            summary = doc.strip().splitlines()[0].strip() if doc.strip() else ""
            if len(summary) >= 12 and not node.name.startswith("_"):
                out.append((node, summary))
    return out


def sample_tasks(tasks: list[Task], limit: int, seed: int) -> list[Task]:
    """At most `limit` tasks, the same ones for the same seed."""
    if len(tasks) <= limit:
        return list(tasks)
    return sorted(random.Random(seed).sample(tasks, limit), key=lambda t: t.id)


def fetch_sdist(spec: str, cache: Path) -> Path:
    """The unpacked source of `spec` ("name==version") under `cache/repos/`, downloaded once
    with pip (`--no-binary :all:`: the sdist, i.e. the code as its authors wrote it). Never
    called by tests: nothing downloads at test time."""
    name = spec.replace("==", "-")
    dest = cache / "repos" / name
    if dest.is_dir():
        return dest
    downloads = cache / "sdists"
    downloads.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:",
                    "--no-deps", "-d", str(downloads), spec], check=True)
    archives = sorted(downloads.glob(f"{name}.tar.gz")) or sorted(
        p for p in downloads.glob("*.tar.gz")
        if p.name.lower().replace("_", "-") == f"{name.lower().replace('_', '-')}.tar.gz")
    if not archives:
        raise FileNotFoundError(f"pip downloaded no sdist named {name}.tar.gz")
    staging = dest.with_name(dest.name + ".partial")
    with tarfile.open(archives[0]) as tar:
        tar.extractall(staging, filter="data")  # "data": no links or paths out of staging
    top = next(staging.iterdir())
    top.rename(dest)
    staging.rmdir()
    return dest
