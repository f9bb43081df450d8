"""Replayed commits: next-edit cases cut from a repository's history.

For a commit that changes a Python file in several small places (hunks), the first k hunks
are the user's recent edits, the cursor sits at the end of the k-th, and the answer is the
file after hunk k+1. One builder for the benchmark (`bench/nextedit.py`) and for the
next-edit adapter's training data, so the model is trained on the cases it is measured on
the shape of (issue 34). Git reads the repository with the host's safe settings: nothing its
config names runs.
"""

from __future__ import annotations

import subprocess
from difflib import SequenceMatcher
from pathlib import Path
from typing import TypedDict

from codeplane.sandbox.clone import SAFE_GIT, git_env

MAX_FILE_CHARS = 40_000
MAX_HUNK_LINES = 8
PER_FILE = 2  # cases per changed file, so one large commit does not fill a set


class Edit(TypedDict):
    path: str
    line: int
    before: str
    after: str


class Case(TypedDict):
    path: str
    state: str  # the file after the first k hunks
    target: str  # the file after hunk k+1
    edits: list[Edit]  # the first k hunks, oldest first
    line: int  # the cursor: the end of hunk k
    target_lines: tuple[int, int]  # hunk k+1's lines in `state`
    commit: str


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *SAFE_GIT, "--git-dir", str(repo), *args], check=True,
                          capture_output=True, text=True, env=git_env()).stdout


def hunks(old: list[str], new: list[str]) -> list[tuple[int, int, int, int]]:
    return [op[1:] for op in SequenceMatcher(None, old, new, autojunk=False).get_opcodes()
            if op[0] != "equal"]


def cases_of(repo: Path, limit: int, skip: int = 0) -> list[Case]:
    """Replayed-commit cases, newest commits first, after the newest `skip` commits."""
    out: list[Case] = []
    commits = git(repo, "rev-list", "--first-parent", "--no-merges", "HEAD").split()
    for commit in commits[skip:]:
        files = git(repo, "diff-tree", "--no-commit-id", "-r", "--name-only", "--diff-filter=M",
                    commit).split()
        for path in (f for f in files if f.endswith(".py")):
            try:
                old = git(repo, "show", f"{commit}^:{path}")
                new = git(repo, "show", f"{commit}:{path}")
            except (subprocess.CalledProcessError, UnicodeDecodeError):
                continue
            if len(old) > MAX_FILE_CHARS:
                continue
            out += file_cases(path, old, new, commit)[:PER_FILE]
            if len(out) >= limit:
                return out[:limit]
    return out


def file_cases(path: str, old: str, new: str, commit: str = "") -> list[Case]:
    a, b = old.splitlines(keepends=True), new.splitlines(keepends=True)
    found = hunks(a, b)
    if len(found) < 2 or any(i2 - i1 > MAX_HUNK_LINES or j2 - j1 > MAX_HUNK_LINES
                             for i1, i2, j1, j2 in found):
        return []
    cases: list[Case] = []
    for k in range(1, len(found)):
        # the state after hunks [0, k): b up to hunk k's start in b, then a from hunk k on
        i1, i2, j1, j2 = found[k]
        state = b[:j1] + a[i1:]
        target = b[:j2] + a[i2:]
        edits: list[Edit] = [{"path": path, "line": h[2], "before": "".join(a[h[0]:h[1]]),
                              "after": "".join(b[h[2]:h[3]])} for h in found[:k]]
        last = found[k - 1]
        line = max(last[3] - 1, last[2])
        cases.append({"path": path, "state": "".join(state), "target": "".join(target),
                      "edits": edits, "line": min(line, len(state) - 1 if state else 0),
                      "target_lines": (j1, j1 + i2 - i1), "commit": commit})
    return cases
