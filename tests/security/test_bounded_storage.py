"""What a background run stores is bounded (audit 2026-11-28, M6: the whole diff after every
tool call, uncapped: a 30 MB file touched five times stored 187 MB of events)."""

from __future__ import annotations

import subprocess

import httpx
from test_background import API, _events, ended, launch
from test_fleet import git_repo
from upstreams.scripted import caller, run_server

DIFF_BYTES, PATCH_BYTES = 32 << 10, 64 << 10
BIG = "seq 1 200000 > big.txt"  # 1.3 MB of text: far past both quotas


def test_diff_events_and_the_patch_stay_within_the_runs_quota(scripted, tmp_path):
    repo = git_repo(tmp_path / "roots" / "repo", {"a.py": "A = 1\n"})
    home = tmp_path / "home"
    home.mkdir()
    (home / "codeplane.toml").write_text(
        f"[background]\ndiff_bytes = {DIFF_BYTES}\npatch_bytes = {PATCH_BYTES}\n")
    live = run_server(home, scripted.url, workspace_roots=[str(repo.parent)])
    try:
        steps = [{"calls": [("run_terminal_cmd", {"command": "echo small > small.txt"})]},
                 {"calls": [("run_terminal_cmd", {"command": BIG})]}]
        steps += [{"calls": [("run_terminal_cmd", {"command": f"echo {i} >> big.txt"})]}
                  for i in range(4)]
        scripted.script = [*steps, {"content": "done"}]
        run = launch(live, repo, max_steps=10)
        got = ended(live, run["id"])
        assert got["status"] == "completed" and got["commit_sha"], got
        diffs = [e for _, e in _events(live, run["id"]) if e["type"] == "diff"]
        assert "+small" in diffs[0]["diff"]  # under the quota: the diff itself
        stored = sum(len(e["diff"]) for e in diffs)
        assert stored <= DIFF_BYTES + len(diffs) * 4096, stored
        assert "big.txt" in diffs[-1]["diff"] and diffs[-1]["omitted_bytes"] > DIFF_BYTES
        patch = httpx.get(f"{live.url}{API}/{run['id']}/patch", headers=caller(live))
        assert patch.status_code == 413, patch.text[:300]
        assert patch.json()["error"]["code"] == "patch_too_large"
        result = next(e for _, e in _events(live, run["id"]) if e["type"] == "result")
        assert result["patch_bytes"] > PATCH_BYTES and result["patch_omitted"]
        # the branch bundle holds the whole result
        bundle = live.app.state.services.background.root / run["id"] / "branch.bundle"
        clone = tmp_path / "clone"
        subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True)
        subprocess.run(["git", "fetch", "-q", str(bundle), f"{got['branch']}:b"], cwd=clone,
                       check=True)
        big = subprocess.run(["git", "show", "b:big.txt"], cwd=clone, check=True,
                             capture_output=True, text=True).stdout
        assert big.splitlines()[-5:] == ["200000", "0", "1", "2", "3"]
    finally:
        live.stop()
