"""The host never reads git state a workspace wrote (audit 2026-11-28: C1, C2, H1), each attack
run for real: a real server on loopback, real sandboxes, a scripted model, real git. A marker
file outside every sandbox says whether anything ran on the host: a command that runs inside
a sandbox cannot write there (the path does not exist in its mount namespace)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import pytest
from test_background import API, _events, ended, launch
from test_fleet import git_repo
from upstreams.scripted import caller, run_server, wait_for

from codeplane.agent.env import local_environment
from codeplane.agent.tools import default_toolset
from codeplane.sandbox import BwrapRunner, Limits

execute = default_toolset().execute  # one call as the agent makes it

WAIT = "until [ -f go ]; do sleep 0.05; done; rm go"


@pytest.fixture
def roots(tmp_path: Path) -> Path:
    root = tmp_path / "roots"
    git_repo(root / "proj", {"app.py": "print('proj')\n"})
    return root


@pytest.fixture
def server(scripted, roots, tmp_path):
    live = run_server(tmp_path / "home", scripted.url, workspace_roots=[str(roots)])
    yield live
    live.stop()


def _sandbox_dir(server, run_id: str) -> Path:
    checkout = [e for _, e in _events(server, run_id) if e["type"] == "checkout"][-1]
    return server.app.state.services.fleet.get("t1", checkout["sandbox"]).workspace


# ---------------------------------------------------------------- C1: the files API

@pytest.mark.parametrize("path", [".git/config", "sub/.git/config", ".git", "a/../.git/HEAD",
                                  ".GIT/config", "x/.Git/hooks/pre-commit"])
def test_files_api_refuses_git_paths_at_any_depth(server, roots, path):
    h = caller(server)
    box = httpx.post(f"{server.url}/v1/sandboxes", headers=h,
                     json={"repo": str(roots / "proj")}).json()
    url = f"{server.url}/v1/sandboxes/{box['id']}/files"
    wrote = httpx.put(url, params={"path": path}, content=b"[core]\n# PLANTED\n", headers=h)
    assert wrote.status_code == 400, wrote.text
    assert wrote.json()["error"]["code"] == "path_refused"
    read = httpx.get(url, params={"path": path}, headers=h)
    assert read.status_code == 400, read.text
    assert b"PLANTED" not in (Path(box["workspace"]) / ".git" / "config").read_bytes()


# ---------------------------------------------------------------- C1: git config on disk

def _plant(ws: Path, kind: str, marker: Path) -> None:
    """What the audit planted through the files API, written straight into the sandbox's
    tree: the test stands for any way a tenant's bytes reach that `.git`."""
    (ws / ".payload.sh").write_text(f"touch {marker}; cat\n")
    run = f"sh {ws / '.payload.sh'}"
    config = {"filter": f'[filter "x"]\n\tclean = {run}\n\tsmudge = {run}\n',
              "diff.external": f"[diff]\n\texternal = {run}\n",
              "include.path": f"[include]\n\tpath = {ws / 'evil.cfg'}\n"}[kind]
    (ws / "evil.cfg").write_text(f'[filter "x"]\n\tclean = {run}\n')
    with open(ws / ".git" / "config", "a") as f:
        f.write(config)
    (ws / ".gitattributes").write_text("* filter=x\n")


@pytest.mark.parametrize("kind", ["filter", "diff.external", "include.path"])
def test_git_config_in_a_background_sandbox_never_runs_on_the_host(scripted, server, roots,
                                                                    tmp_path, kind):
    marker = tmp_path / "HOST-RCE"
    scripted.script = [{"calls": [("run_terminal_cmd", {"command": WAIT})]},
                       {"calls": [("create_file", {"path": "out.txt", "content": "step2\n"})]},
                       {"content": "done"}]
    run = launch(server, roots / "proj", max_steps=5)
    wait_for(lambda: any(e["type"] == "tool_start" for _, e in _events(server, run["id"])))
    ws = _sandbox_dir(server, run["id"])
    _plant(ws, kind, marker)
    (ws / "go").touch()
    got = ended(server, run["id"])
    assert not marker.exists(), f"{kind} planted in the sandbox's .git ran on the host"
    assert got["status"] == "completed", got
    patch = httpx.get(f"{server.url}{API}/{run['id']}/patch", headers=caller(server)).text
    assert "+++ b/out.txt" in patch and "+step2" in patch
    diffs = [e for _, e in _events(server, run["id"]) if e["type"] == "diff"]
    assert diffs and "+step2" in diffs[-1]["diff"]


# ---------------------------------------------------------------- C2: one agent command

def test_one_agent_command_cannot_leave_a_repository_for_the_host(scripted, server, roots,
                                                                  tmp_path):
    """bg_agent_rce.sh: a 1,000-deep directory (the sweep's recursive walk died on it) and a
    nested repository whose clean filter the end-of-run `git status` ran on the host."""
    marker = tmp_path / "HOST-MARK"
    deep = "/".join(["d"] * 1000)
    command = (f"mkdir -p {deep} && git init -q sub && cd sub && echo hello > f.txt && "
               "echo '* filter=x' > .gitattributes && git add . && "
               "git -c user.name=x -c user.email=y@z commit -qm s && "
               f"git config filter.x.clean \"sh -c 'touch {marker}; cat'\" && "
               "touch -d 2001-01-01 f.txt && echo planted")
    scripted.script = [{"calls": [("run_terminal_cmd", {"command": command})]},
                       {"calls": [("create_file", {"path": "out.txt", "content": "x\n"})]},
                       {"content": "done"}]
    run = launch(server, roots / "proj", max_steps=5)
    got = ended(server, run["id"])  # ends: never stuck "running"
    assert not marker.exists(), "a repository made by the agent ran its filter on the host"
    assert got["status"] == "completed", got
    output = next(e for _, e in _events(server, run["id"]) if e["type"] == "tool_result")
    assert "planted" in output["output"] and "renamed aside" in output["output"]


# ---------------------------------------------------------------- H1: HEAD + commondir

def test_a_commondir_repository_made_in_the_sandbox_runs_nothing_on_the_host(ws, tmp_path):
    """gitguard_commondir.py: HEAD + `commondir` is a repository to git (its config lives in
    the common directory); a developer's `git log` there ran a sandbox-written pager."""
    subprocess.run(["git", "init", "-q", str(ws)], check=True)
    marker = tmp_path / "HOST-RCE"
    command = f"""set -e
cd /tmp && git init -q r && cd r && git -c user.name=x -c user.email=x@y commit -q --allow-empty -m hi
cd {ws} && mkdir -p docs/cd docs/evil
cp -r /tmp/r/.git/objects /tmp/r/.git/refs docs/cd/
cp /tmp/r/.git/HEAD docs/evil/HEAD
echo ../cd > docs/evil/commondir
printf '[core]\\n\\trepositoryformatversion = 0\\n\\tpager = "touch {marker}; cat"\\n' > docs/cd/config
echo planted"""
    res = BwrapRunner(ws).run(command, ws, Limits(timeout=60))
    assert "planted" in res.output and "renamed aside" in res.output, res.output
    env = {**os.environ, "GIT_CONFIG_GLOBAL": "/dev/null", "TERM": "xterm"}
    env.pop("GIT_PAGER", None)
    env.pop("PAGER", None)
    subprocess.run(["script", "-qc", "git log --oneline", "/dev/null"], cwd=ws / "docs" / "evil",
                   env=env, capture_output=True, timeout=30, check=False)
    assert not marker.exists(), "the host's git ran a pager the sandbox wrote"


def test_a_commondir_planted_by_an_agent_run_does_not_lead_out_of_the_roots(scripted, server,
                                                                            roots, tmp_path):
    """roots_escape_commondir.sh: an agent run writes docs/evil/HEAD + commondir pointing at a
    repository outside the roots; a sandbox of docs/evil read that repository."""
    secret = git_repo(tmp_path / "outside-secret", {"app.py": "SECRET = 'TOP-SECRET-7f3a'\n"})
    proj = roots / "proj"
    plant = (f"mkdir -p docs/evil && echo 'ref: refs/heads/main' > docs/evil/HEAD && "
             f"echo {secret / '.git'} > docs/evil/commondir && ls docs/evil")
    scripted.script = [{"calls": [("run_terminal_cmd", {"command": plant})]},
                       {"content": "done"}]
    h = caller(server)
    run = httpx.post(f"{server.url}/v1/agent/runs", headers=h, json={
        "task": "plant", "path": str(proj), "model": "scripted", "stream": False}).json()
    wait_for(lambda: httpx.get(f"{server.url}/v1/agent/runs/{run['id']}", headers=h
                               ).json()["status"] != "running", 60, "for the agent run")
    got = httpx.post(f"{server.url}/v1/sandboxes", headers=h,
                     json={"repo": str(proj / "docs" / "evil")})
    assert 400 <= got.status_code < 500, got.text
    assert "TOP-SECRET" not in got.text


@pytest.mark.parametrize("layout", ["commondir", "gitdir-file", "alternates"])
def test_a_repository_whose_parts_lie_outside_the_roots_is_refused(server, roots, tmp_path,
                                                                   layout):
    """The layouts git follows out of a directory, planted under the roots however they got
    there: a sandbox of them must not read what lies outside."""
    secret = git_repo(tmp_path / "outside-secret", {"app.py": "SECRET = 'TOP-SECRET-7f3a'\n"})
    evil = roots / "evil"
    if layout == "commondir":
        evil.mkdir()
        (evil / "HEAD").write_text("ref: refs/heads/main\n")
        (evil / "commondir").write_text(f"{secret / '.git'}\n")
    elif layout == "gitdir-file":
        evil.mkdir()
        (evil / ".git").write_text(f"gitdir: {secret / '.git'}\n")
    else:
        git_repo(evil, {"own.txt": "own\n"})
        subprocess.run(["git", "fetch", "-q", str(secret), "main:stolen"], cwd=evil,
                       check=True, capture_output=True)
        subprocess.run(["git", "repack", "-q", "-a", "-d"], cwd=evil, check=True)
        for pack in (evil / ".git" / "objects" / "pack").iterdir():  # the objects: elsewhere
            pack.rename(secret / ".git" / "objects" / "pack" / pack.name)
        (evil / ".git" / "objects" / "info" / "alternates").write_text(
            f"{secret / '.git' / 'objects'}\n")
    got = httpx.post(f"{server.url}/v1/sandboxes", headers=caller(server),
                     json={"repo": str(evil), "ref": "stolen" if layout == "alternates"
                           else "HEAD"})
    assert 400 <= got.status_code < 500, got.text
    assert got.json()["error"]["param"] == "repo", got.text


# ---------------------------------------------------------------- the agent's file tools

@pytest.mark.parametrize("path", ["sub/.git/config", ".git/hooks/pre-commit", ".GIT/config",
                                  "vendor/lib/.git", "a/b/.git/info/attributes"])
def test_the_agents_file_tools_never_write_git_metadata(ws, path):
    (ws / "vendor" / "lib").mkdir(parents=True)
    env = local_environment(ws)
    made = execute(env, "create_file", {"path": path, "content": "[core]\n"})
    assert not made.ok and ".git" in made.output, made.output
    assert not (ws / path).exists()
