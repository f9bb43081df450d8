"""Replayed-commit cases (`tab/replay.py`): the states between a commit's hunks, read from a
real git history built here."""

from __future__ import annotations

import subprocess
from pathlib import Path

from codeplane.tab.replay import cases_of

OLD = "".join(f"value{n} = compute({n})\n" for n in range(30))
NEW = OLD.replace("value3 = compute(3)", "value3 = measure(3)").replace(
    "value20 = compute(20)", "value20 = measure(20)")


def history(root: Path, hooks_marker: Path) -> Path:
    run = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost", "-C", str(root)]
    subprocess.run([*run[:5], "init", "-q", str(root)], check=True)
    (root / "m.py").write_text(OLD)
    subprocess.run([*run, "add", "m.py"], check=True)
    subprocess.run([*run, "commit", "-qm", "one"], check=True)
    (root / "m.py").write_text(NEW)
    subprocess.run([*run, "commit", "-qam", "two"], check=True)
    # a repository's own config must not run anything on the host that reads it
    hook = f"!touch {hooks_marker}"
    subprocess.run([*run, "config", "core.fsmonitor", hook], check=True)
    return root / ".git"


def test_a_two_hunk_commit_is_one_case_whose_answer_is_the_second_hunk(tmp_path):
    marker = tmp_path / "ran"
    repo = history(tmp_path / "r", marker)
    [case] = cases_of(repo, limit=5)
    assert case["path"] == "m.py"
    assert case["edits"] == [{"path": "m.py", "line": 3, "before": "value3 = compute(3)\n",
                              "after": "value3 = measure(3)\n"}]
    assert case["state"] == OLD.replace("value3 = compute(3)", "value3 = measure(3)")
    assert case["target"] == NEW
    assert case["line"] == 3 and case["target_lines"] == (20, 21)
    assert not marker.exists()
