"""Trees whose shape broke the host's walks (audit 2026-11-28: C2, H2, L2): a directory 1,000
levels deep, one deeper than PATH_MAX, names of 255 bytes and more, symlink loops, setuid
files. Every host-side walk and removal must finish or fail closed, and the API must answer
4xx or 2xx, never 500."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import httpx
import pytest
from test_background import API, _events, ended, launch
from test_fleet import fleet_server_at, git_repo
from upstreams.scripted import caller, run_server

from codeplane.agent.env import local_environment
from codeplane.agent.tools import default_toolset
from codeplane.config import FleetSettings
from codeplane.sandbox import BwrapRunner, Limits, gitguard
from codeplane.sandbox.fleet import Fleet

execute = default_toolset().execute  # one call as the agent makes it

DEEP = "/".join(["q"] * 1000)
# deeper than PATH_MAX (4096 bytes): made one relative step at a time, as a shell can
PAST_PATH_MAX = "python3 -c \"import os\nfor _ in range(2100): os.mkdir('d'); os.chdir('d')\""


@pytest.fixture(autouse=True)
def _remove_deep_trees(tmp_path):
    """pytest removes its temporary directories with shutil.rmtree, which recurses on
    Python 3.11: the trees these tests make go with coreutils first."""
    yield
    subprocess.run(["rm", "-rf", "--one-file-system", "--", str(tmp_path)], check=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    live = fleet_server_at(tmp_path_factory.mktemp("deep"), "pool_size = 0")
    yield live
    live.stop()


def _box(server) -> tuple[str, dict]:
    h = caller(server)
    box = httpx.post(f"{server.url}/v1/sandboxes", headers=h,
                     json={"repo": str(server.root / "app")}).json()
    return f"{server.url}/v1/sandboxes/{box['id']}", box


def test_a_file_a_thousand_directories_deep_breaks_nothing(server):
    """deepdir_dos.sh: one PUT, then exec, PUT and DELETE answered 500 for that tenant."""
    url, box = _box(server)
    h = caller(server)
    put = httpx.put(f"{url}/files", params={"path": f"{DEEP}/f"}, content=b"x", headers=h)
    assert put.status_code == 200, put.text
    assert httpx.get(f"{url}/files", params={"path": f"{DEEP}/f"}, headers=h).content == b"x"
    ran = httpx.post(f"{url}/exec", headers=h, json={"command": "echo hi"}, timeout=60)
    assert ran.status_code == 200 and ran.json()["output"] == "hi\n", ran.text
    again = httpx.put(f"{url}/files", params={"path": "b.txt"}, content=b"b", headers=h)
    assert again.status_code == 200, again.text
    assert httpx.get(f"{url}/diff", headers=h, timeout=60).status_code == 200
    gone = httpx.delete(url, headers=h)
    assert gone.status_code == 200, gone.text
    assert not Path(box["workspace"]).parent.exists()


def test_a_restart_removes_a_deep_tree_a_dead_server_left(tmp_path):
    """After a crash, the start-up clean-up met the deep tree and `codeplane serve` exited,
    for every tenant. A record whose owner is dead stands for the crashed server."""
    repo = git_repo(tmp_path / "code" / "app", {"a.txt": "a\n"})
    server_dir = tmp_path / "server"
    fleet = Fleet(server_dir, FleetSettings(pool_size=0))
    box = fleet.acquire("t1", repo)
    done = fleet.exec(box, f"mkdir -p {DEEP} && cd {DEEP} && {PAST_PATH_MAX} && echo made")
    assert "made" in done.output, done.output
    record = server_dir / "fleet" / "records" / f"{box.id}.json"
    data = json.loads(record.read_text())
    data["owner"]["start"] = -1  # no live process started at that tick: a dead owner
    record.write_text(json.dumps(data))
    with fleet._lock:  # this process forgets it, as a crashed one would
        fleet._live.clear()
    fleet.close()
    again = Fleet(server_dir, FleetSettings(pool_size=0))
    try:
        assert again.reaped["sandboxes"] >= 1
        assert not box.path.exists()
    finally:
        again.close()


def test_the_sweep_survives_a_deep_tree_and_renames_a_nested_repository(ws, tmp_path):
    """gitguard_deepdir.py: the recursive walk died (RecursionError), the nested repository
    stayed, a host `git status` there ran its fsmonitor, and every later command failed."""
    subprocess.run(["git", "init", "-q", str(ws)], check=True)
    marker = tmp_path / "HOST-RCE"
    command = (f"mkdir -p {'/'.join(['d'] * 1000)} && git init -q vendor/lib && "
               f"git -C vendor/lib config core.fsmonitor 'touch {marker}; false' && echo planted")
    res = BwrapRunner(ws).run(command, ws, Limits(timeout=60))
    assert "planted" in res.output and "renamed aside" in res.output, res.output
    subprocess.run(["git", "status", "--short"], cwd=ws / "vendor" / "lib", capture_output=True,
                   env={**os.environ, "GIT_CONFIG_GLOBAL": "/dev/null"}, check=False)
    assert not marker.exists()
    assert BwrapRunner(ws).run("echo next", ws, Limits(timeout=60)).output == "next\n"
    assert gitguard.tainted(ws) is None


def test_a_tree_the_sweep_cannot_finish_taints_the_workspace(ws, tmp_path):
    """Past PATH_MAX no walk by path reaches the bottom: the workspace is marked tainted (in
    its .git, which commands cannot write), never silently passed as clean."""
    subprocess.run(["git", "init", "-q", str(ws)], check=True)
    res = BwrapRunner(ws).run(f"{PAST_PATH_MAX} && echo made", ws,
                              Limits(timeout=120))
    assert "made" in res.output, res.output
    reason = gitguard.tainted(ws)
    assert reason is not None and "could not" in reason, reason
    assert "tainted" in res.output
    again = BwrapRunner(ws).run("rm -f .git/codeplane-tainted; echo tried", ws, Limits())
    assert "tried" in again.output
    assert gitguard.tainted(ws) is not None  # a command cannot clear it
    plain = tmp_path / "plain"
    plain.mkdir()
    BwrapRunner(plain).run(PAST_PATH_MAX, plain, Limits(timeout=120))
    assert gitguard.tainted(plain) is not None  # no .git of its own: the mark has a place
    assert subprocess.run(["git", "status"], cwd=plain, capture_output=True,
                          check=False).returncode != 0  # ...which is not a repository


def test_a_background_run_whose_tree_cannot_be_swept_ends_with_an_error(scripted, tmp_path):
    """Fail closed: the run ends (never stuck "running"), with an error saying why, and its
    tree is not committed."""
    repo = git_repo(tmp_path / "roots" / "repo", {"a.py": "A = 1\n"})
    live = run_server(tmp_path / "home", scripted.url, workspace_roots=[str(repo.parent)])
    try:
        scripted.script = [{"calls": [("run_terminal_cmd", {"command": PAST_PATH_MAX})]},
                           {"content": "done"}]
        run = launch(live, repo, max_steps=4)
        got = ended(live, run["id"])
        assert got["status"] == "error" and "tainted" in got["error"], got
        assert got["commit_sha"] is None
        assert _events(live, run["id"])[-1][1]["type"] == "end"
        patch = httpx.get(f"{live.url}{API}/{run['id']}/patch", headers=caller(live))
        assert patch.text == ""
    finally:
        live.stop()


def test_the_agents_walks_survive_a_deep_tree(ws, monkeypatch):
    (ws / "top.py").write_text("NEEDLE = 1\n")
    deep = ws / "/".join(["d"] * 1000)
    subprocess.run(["mkdir", "-p", str(deep)], check=True)  # os.makedirs recurses
    (deep / "bottom.py").write_text("NEEDLE = 2\n")
    env = local_environment(ws)
    monkeypatch.setenv("PATH", "/nonexistent")  # no ripgrep: the Python fallbacks
    res = execute(env, "grep", {"pattern": "NEEDLE"})
    assert res.ok and "top.py:1:NEEDLE = 1" in res.output, res.output[:300]
    found = execute(env, "file_search", {"query": "bottom"})
    assert found.ok and "bottom.py" in found.output, found.output[:300]
    assert "bottom.py" in " ".join(env.workspace.snapshot().hashes)


# ---------------------------------------------------------------- names and loops (L2)

@pytest.mark.parametrize("method,name,ok", [("GET", "a" * 300, False), ("PUT", "d" * 300, False),
                                            ("PUT", "c" * 250, True), ("PUT", "e" * 255, True)])
def test_long_names_are_4xx_or_work(server, method, name, ok):
    url, _ = _box(server)
    got = httpx.request(method, f"{url}/files", params={"path": name}, content=b"x",
                        headers=caller(server))
    if ok:
        assert got.status_code == 200, got.text
        assert httpx.get(f"{url}/files", params={"path": name},
                         headers=caller(server)).content == b"x"
    else:
        assert got.status_code == 400, got.text


def test_a_symlink_loop_is_4xx(server):
    url, _ = _box(server)
    h = caller(server)
    httpx.post(f"{url}/exec", headers=h, json={"command": "ln -s loop loop"}, timeout=60)
    for method in ("GET", "PUT"):
        got = httpx.request(method, f"{url}/files", params={"path": "loop/x"}, content=b"x",
                            headers=h)
        assert got.status_code == 400, (method, got.text)


# ---------------------------------------------------------------- setuid

def test_setuid_files_a_command_leaves_are_stripped(ws):
    res = BwrapRunner(ws).run("cp /bin/true s && cp /bin/true g && chmod 4755 s && "
                              "chmod 2755 g && mkdir -p x && cp s x/s && chmod 6755 x/s && "
                              "echo done", ws, Limits())
    assert "done" in res.output, res.output
    for name in ("s", "g", "x/s"):
        mode = (ws / name).lstat().st_mode
        assert not mode & (stat.S_ISUID | stat.S_ISGID), (name, oct(mode))
        assert mode & stat.S_IXUSR  # the file itself is kept
