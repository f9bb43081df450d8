"""Change requests in a git history: which commits are a request in words and which source
files they changed.

One rule, shared by the search benchmark's localisation set (bench/search/build.py) and RL's
commits family (rl/commits.py), so "a change request" means the same in what is trained and
in what is measured: a single-parent commit that modifies a few existing non-test Python
files (`MIN_FILES`..`MAX_FILES`) and whose message's first paragraph has at least
`MIN_WORDS` words and no chore (a release, a typo, formatting, docs, tests, CI ...). The
rule is kept exactly as the measured sets were built with it (docs/search.md); a change to
it changes those sets.

Git runs over the history only (`log`, `show`): no checkout, no hook, no system or global
config (`sandbox.clone.git_env`), nothing from the repository executed.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from codeplane.sandbox.clone import SAFE_GIT, git_env

CHORE = re.compile(r"\b(bump|release|version|changelog|typo|merge|pre-commit|lint|format|"
                   r"formatting|ci|workflow|docs?|readme|sphinx|tox|flake8|black|ruff|mypy|"
                   r"deprecat\w*|test\w*|coverage|copyright|license|update \w+ requirements)\b",
                   re.IGNORECASE)
SOURCE = re.compile(r"\.pyi?$")
MIN_FILES, MAX_FILES = 1, 4
MIN_WORDS = 4


@dataclass(frozen=True)
class Change:
    """A commit, its only parent, and the non-test source files it modified (sorted); also
    the test source files it modified or added and the non-test source files it added,
    deleted or renamed (the fix family asks for a commit that changes one source file and
    its tests, nothing else of the code)."""

    commit: str
    parent: str
    files: tuple[str, ...]
    tests: tuple[str, ...] = ()
    other_sources: tuple[str, ...] = ()


def git(git_dir: Path, *args: str) -> str:
    """stdout of `git --git-dir git_dir ARGS` (CalledProcessError with stderr on failure)."""
    return subprocess.run(["git", *SAFE_GIT, "--git-dir", str(git_dir), *args], check=True,
                          capture_output=True, text=True, env=git_env()).stdout


def is_test(path: str) -> bool:
    """Test code by its path: wider than the product's `indexing.rank.is_test` (it counts
    `testing/` and `typing_tests/`), as the benchmark's measured sets were built."""
    parts = path.split("/")
    return any(p in ("tests", "test", "testing", "testsuite", "typing_tests")
               for p in parts[:-1]) or parts[-1].startswith("test_") or parts[-1] == "conftest.py"


def first_paragraph(message: str) -> str:
    """A commit message's first paragraph on one line, without a trailing "(#123)"."""
    text = message.strip().split("\n\n", 1)[0]
    return re.sub(r"\s*\(#\d+\)\s*$", "", " ".join(text.split()))


def change_request(message: str) -> str | None:
    """The message's first paragraph when it is a request in words, not a chore."""
    query = first_paragraph(message)
    return None if len(query.split()) < MIN_WORDS or CHORE.search(query) else query


def modified_commits(git_dir: Path, newest: int, rev: str = "HEAD") -> list[Change]:
    """The `newest` non-merge commits up to `rev` that modify `MIN_FILES`..`MAX_FILES`
    existing non-test source files (added, deleted and renamed files are not "modified":
    there is no before and after of the same path to localise)."""
    log = git(git_dir, "log", "--no-merges", "-n", str(newest), "--format=@@%H %P",
              "--name-status", rev)
    out = []
    for block in log.split("@@")[1:]:
        head, *changes = block.strip().splitlines()
        sha, *parents = head.split()
        modified = [c.split("\t")[-1] for c in changes if c.startswith("M\t")]
        files = sorted(p for p in modified if SOURCE.search(p) and not is_test(p))
        if len(parents) == 1 and MIN_FILES <= len(files) <= MAX_FILES:
            sources = [(c[0], c.split("\t")[-1]) for c in changes if SOURCE.search(c)]
            out.append(Change(
                sha, parents[0], tuple(files),
                tuple(sorted(p for s, p in sources if s in "MA" and is_test(p))),
                tuple(sorted(p for s, p in sources if s not in "M" and not is_test(p)))))
    return out


def message(git_dir: Path, commit: str) -> str:
    """The commit's full message."""
    return git(git_dir, "log", "-1", "--format=%B", commit)
