"""Background agents through a real server on loopback: the agent runs in a pooled sandbox of
the fleet against the scripted model (deterministic), and ends with a commit on a branch (kept
as a bundle once the sandbox is gone) and a patch; runs survive a restart; tenants cannot see each other's runs; `codeplane agents
pull` applies a patch or refuses on a conflict."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import make_settings
from test_fleet import GitDaemon, serve_process
from upstreams.scripted import caller, run_server, wait_for

from codeplane.background.records import BackgroundRecords
from codeplane.gateway.keys import KeyStore
from codeplane.sandbox.clone import mounts_under

API = "/v1/background-agents"
HELLO = [{"calls": [("create_file", {"path": "hello.txt", "content": "hello\n"})]},
         {"content": "Created hello.txt."}]
HANG = {"raw": ['data: {"choices": []}\n\n'], "hang": True}




def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd,
                          check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "roots" / "repo"
    root.mkdir(parents=True)
    git(root, "init", "-q", "-b", "main")
    (root / "a.py").write_text("A = 1\n")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "start")
    return root


@pytest.fixture
def server(scripted, repo, tmp_path):
    live = run_server(tmp_path / "home", scripted.url, workspace_roots=[str(repo.parent)],
                      max_runs_per_tenant=1)
    yield live
    live.stop()


def launch(server, repo: Path | str, tenant: str = "t1", **body) -> dict:
    resp = httpx.post(server.url + API, headers=caller(server, tenant), json={
        "repo": str(repo), "task": "create hello.txt containing hello", "model": "scripted",
        "max_steps": 4, **body})
    assert resp.status_code == 202, resp.text
    return resp.json()


def ended(server, run_id: str, tenant: str = "t1") -> dict:
    def done() -> dict | None:
        got = httpx.get(f"{server.url}{API}/{run_id}", headers=caller(server, tenant)).json()
        return got if got["status"] not in ("queued", "running") else None
    return wait_for(done, 30, f"for background run {run_id}")


def sse(server, run_id: str, tenant: str = "t1", last: int | None = None) -> list[tuple]:
    headers = {**caller(server, tenant), **({"last-event-id": str(last)} if last else {})}
    out, seq = [], None
    with httpx.stream("GET", f"{server.url}{API}/{run_id}/events", headers=headers,
                      timeout=30) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("id: "):
                seq = int(line[4:])
            elif line.startswith("data: "):
                out.append((seq, json.loads(line[6:])))
    return out


def sandbox_of(server, run_id: str) -> Path:
    """The workspace of the pooled sandbox a run is working in now."""
    checkout = [e for _, e in _events(server, run_id) if e["type"] == "checkout"][-1]
    return server.app.state.services.fleet.get("t1", checkout["sandbox"]).workspace


def test_launch_returns_at_once_and_ends_with_a_commit_and_patch(scripted, repo, server,
                                                                 tmp_path):
    scripted.script = list(HELLO)
    run = launch(server, repo)
    assert run["status"] == "running" and run["branch"] == f"codeplane/{run['id']}"
    got = ended(server, run["id"])
    assert got["status"] == "completed", got
    assert not (repo / "hello.txt").exists()  # the source checkout is untouched
    fleet = server.app.state.services.fleet
    assert fleet.list("t1") == []  # the run's sandbox went back when it ended
    # the branch outlives the sandbox, as a bundle any clone can fetch
    bundle = server.app.state.services.background.root / run["id"] / "branch.bundle"
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(repo), str(clone))
    git(clone, "fetch", "-q", str(bundle), f"{got['branch']}:{got['branch']}")
    assert git(clone, "rev-parse", got["branch"]).strip() == got["commit_sha"]
    assert git(clone, "show", f"{got['branch']}:hello.txt") == "hello\n"
    patch = httpx.get(f"{server.url}{API}/{run['id']}/patch", headers=caller(server)).text
    assert "+++ b/hello.txt" in patch and "+hello" in patch
    events = sse(server, run["id"])
    kinds = [e["type"] for _, e in events]
    for kind in ("checkout", "turn_start", "run_start", "tool_start", "tool_result", "diff",
                 "run_end", "result", "end"):
        assert kind in kinds, kinds
    assert [s for s, _ in events] == list(range(1, len(events) + 1))
    diff = next(e for _, e in events if e["type"] == "diff")
    assert "+hello" in diff["diff"]
    # resumable: after event 3 come exactly events 4..n; after the last, none (and it ends)
    assert sse(server, run["id"], last=3) == events[3:]
    assert sse(server, run["id"], last=len(events)) == []
    assert sse(server, run["id"], last=10_000) == []
    listed = httpx.get(server.url + API, headers=caller(server)).json()["data"]
    assert [r["id"] for r in listed] == [run["id"]]


def test_follow_up_continues_and_cancel_stops(scripted, repo, server):
    scripted.script = list(HELLO)
    run = launch(server, repo)
    ended(server, run["id"])
    url = f"{server.url}{API}/{run['id']}"
    scripted.script = [{"calls": [("create_file", {"path": "bye.txt", "content": "bye\n"})]},
                       {"content": "Created bye.txt."}]
    sent = httpx.post(url + "/messages", headers=caller(server), json={"content": "add bye"})
    assert sent.status_code == 202 and sent.json()["queued"] is False
    got = ended(server, run["id"])
    assert got["status"] == "completed"
    assert "Follow-up instruction: add bye" in json.dumps(scripted.requests[-2]["messages"])
    patch = httpx.get(url + "/patch", headers=caller(server)).text
    assert "+++ b/hello.txt" in patch and "+++ b/bye.txt" in patch
    # a follow-up sent during a turn waits for it, then runs as the next turn
    scripted.script = [{"calls": [("run_terminal_cmd",
                                   {"command": "until [ -f go ]; do sleep 0.05; done; rm go"})]},
                       {"content": "waited"},
                       {"calls": [("create_file", {"path": "after.txt", "content": "x\n"})]},
                       {"content": "Created after.txt."}]
    run = launch(server, repo)
    url = f"{server.url}{API}/{run['id']}"
    wait_for(lambda: any(e["type"] == "tool_start" for _, e in _events(server, run["id"])))
    queued = httpx.post(url + "/messages", headers=caller(server), json={"content": "add after"})
    assert queued.json()["queued"] is True  # the turn is blocked until `go` exists
    (sandbox_of(server, run["id"]) / "go").touch()
    assert ended(server, run["id"])["status"] == "completed"
    turns = [e for _, e in _events(server, run["id"]) if e["type"] == "turn_start"]
    assert [t["turn"] for t in turns] == [1, 2] and "add after" in turns[1]["task"]
    assert "+++ b/after.txt" in httpx.get(url + "/patch", headers=caller(server)).text
    # cancel: the command in flight is killed, the run ends "cancelled", queued follow-ups
    # are dropped
    scripted.script = [{"calls": [("run_terminal_cmd", {"command": "sleep 43.5; touch late"})]}]
    run = launch(server, repo)
    url = f"{server.url}{API}/{run['id']}"
    wait_for(lambda: any(e["type"] == "tool_start" for _, e in _events(server, run["id"])))
    httpx.post(url + "/messages", headers=caller(server), json={"content": "then more"})
    assert httpx.post(url + "/cancel", headers=caller(server)).json()["cancel_requested"]
    got = ended(server, run["id"])
    assert got["status"] == "cancelled" and got["commit_sha"] is None
    assert len([e for _, e in _events(server, run["id"]) if e["type"] == "turn_start"]) == 1
    assert httpx.post(url + "/cancel", headers=caller(server)).json() == {
        "id": run["id"], "cancel_requested": False}


def _events(server, run_id: str) -> list[tuple[int, dict]]:
    return server.app.state.services.background.store.events(run_id)


def test_tenancy_policy_and_cap(scripted, repo, server, tmp_path):
    scripted.script = [HANG]
    run = launch(server, repo)
    url = f"{server.url}{API}/{run['id']}"
    other = caller(server, "t2")
    for method, path in (("GET", ""), ("GET", "/events"), ("GET", "/patch"),
                         ("POST", "/cancel")):
        assert httpx.request(method, url + path, headers=other).status_code == 404
    assert httpx.post(url + "/messages", headers=other,
                      json={"content": "x"}).status_code == 404
    assert httpx.get(server.url + API, headers=other).json()["data"] == []
    # the cap counts the tenant's running agents: a second one waits its turn
    capped = httpx.post(server.url + API, headers=caller(server), json={
        "repo": str(repo), "task": "again", "model": "scripted"})
    assert capped.status_code == 429 and capped.json()["error"]["code"] == "too_many_runs"
    outside = tmp_path / "outside"
    outside.mkdir()
    bad = {"repo": str(outside), "task": "t", "model": "scripted"}
    assert httpx.post(server.url + API, headers=other, json=bad).status_code == 403
    for ref in ("--upload-pack=touch /tmp/x", "no-such-branch"):  # never an option to git
        resp = httpx.post(server.url + API, headers=other, json={**bad, "repo": str(repo),
                                                                 "ref": ref})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "ref", resp.text
    for bad in ("x", "9" * 30):  # no event id, or past what the database holds
        assert httpx.get(url + "/events", headers={**caller(server),
                                                   "last-event-id": bad}).status_code == 400
    assert httpx.delete(url, headers=other).status_code == 404
    assert httpx.delete(url, headers=caller(server)).status_code == 409  # still running
    assert httpx.post(url + "/cancel", headers=caller(server)).json()["cancel_requested"]
    assert ended(server, run["id"])["status"] == "cancelled"


def test_runs_survive_a_restart_and_unfinished_ones_are_interrupted(scripted, repo, tmp_path):
    home = tmp_path / "home"
    first = run_server(home, scripted.url, workspace_roots=[str(repo.parent)])
    try:
        scripted.script = list(HELLO)
        done = launch(first, repo)
        ended(first, done["id"])
        before = sse(first, done["id"])
        scripted.script = [HANG]
        hanging = launch(first, repo)
        wait_for(lambda: any(e["type"] == "run_start" for _, e in _events(first,
                                                                         hanging["id"])))
        # a second server process on the same home starts while the run "is running":
        # what a restart after a crash sees (the first never got to record an end, and its
        # lease in the database has ended as a killed process's would)
        first.app.state.services.replica.close()
        second = run_server(home, scripted.url, workspace_roots=[str(repo.parent)])
        second.callers = first.callers  # same home, same keys
        try:
            headers = caller(first)
            got = httpx.get(f"{second.url}{API}/{hanging['id']}", headers=headers).json()
            assert got["status"] == "interrupted" and "stopped" in got["error"]
            events = sse(second, hanging["id"], tenant="t1")  # ends: not stuck
            assert events[-1][1]["type"] == "interrupted"
            assert sse(second, done["id"]) == before
            patch = httpx.get(f"{second.url}{API}/{done['id']}/patch", headers=headers).text
            assert "+hello" in patch
            cont = httpx.post(f"{second.url}{API}/{hanging['id']}/messages", headers=headers,
                              json={"content": "go on"})
            assert cont.status_code == 409
        finally:
            second.stop()
    finally:
        first.stop()


def test_after_a_crash_a_finished_run_keeps_its_patch_and_branch_not_its_sandbox(scripted, repo,
                                                                              tmp_path):
    """A real `codeplane serve` is SIGKILLed while one run hangs in its sandbox: the restarted
    server's reaper removes every sandbox (mounts, directories, the hung command) and its store
    marks the run interrupted; the finished run's patch and branch bundle are still there."""
    home = tmp_path / "home"
    settings = make_settings(home)
    (home / "codeplane.toml").write_text(
        f'[serve]\nworkspace_roots = ["{repo.parent}"]\n[fleet]\npool_size = 0\n'
        f'[[models]]\nname = "scripted"\nprovider = "openai"\nbase_url = "{scripted.url}"\n'
        'model = "scripted"\n')
    keys = KeyStore.from_settings(settings)
    _, secret = keys.create("k", tenant="t1")
    keys.db.close()
    headers = {"authorization": f"Bearer {secret}"}
    boxes = settings.server_dir / "fleet" / "sandboxes"
    proc, url = serve_process(home, tmp_path / "serve.log")
    try:
        body = {"repo": str(repo), "task": "t", "model": "scripted", "max_steps": 4}
        scripted.script = list(HELLO)
        done = httpx.post(url + API, headers=headers, json=body).json()
        wait_for(lambda: httpx.get(f"{url}{API}/{done['id']}", headers=headers
                                   ).json()["status"] == "completed", 60, "for the first run")
        scripted.script = [{"calls": [("run_terminal_cmd", {"command": "sleep 600"})]}]
        hung = httpx.post(url + API, headers=headers, json=body).json()
        wait_for(lambda: _sleeping_in(boxes), 60, "for the command to start in its sandbox")
        proc.kill()
        proc.wait()
        assert len(list(boxes.iterdir())) == 1  # the crash left the hung run's sandbox
        proc, url = serve_process(home, tmp_path / "serve.log")
        assert not _sleeping_in(boxes) and list(boxes.iterdir()) == []
        assert not mounts_under(boxes)
        got = httpx.get(f"{url}{API}/{hung['id']}", headers=headers).json()
        assert got["status"] == "interrupted"
        kept = httpx.get(f"{url}{API}/{done['id']}/patch", headers=headers).text
        assert "+hello" in kept
        assert (settings.server_dir / "background" / done["id"] / "branch.bundle").is_file()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _sleeping_in(boxes: Path) -> bool:
    """Is a process working in one of the sandboxes (the hung `sleep 600`)?"""
    return any(_cwd_under(pid, boxes) for pid in os.listdir("/proc") if pid.isdigit())


def _cwd_under(pid: str, top: Path) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/cwd").startswith(str(top) + "/")
    except OSError:
        return False


def test_repos_as_a_bundle_or_a_git_url(scripted, repo, tmp_path):
    """A run from a `.bundle` under the roots, and one from a URL the policy allows (a loopback
    `git daemon`): each ends with a patch; a URL outside the policy is refused (403)."""
    bundle = repo.parent / "repo.bundle"
    git(repo, "bundle", "create", "-q", str(bundle), "main")
    daemon = GitDaemon(repo.parent)
    live = run_server(tmp_path / "home", scripted.url, workspace_roots=[str(repo.parent)],
                      repo_urls=[f"{daemon.url}/repo"])
    try:
        for source, ref in ((str(bundle), "main"), (f"{daemon.url}/repo", "HEAD")):
            scripted.script = list(HELLO)
            run = launch(live, source, ref=ref)
            got = ended(live, run["id"])
            assert got["status"] == "completed" and got["repo"] == source, got
            patch = httpx.get(f"{live.url}{API}/{run['id']}/patch", headers=caller(live)).text
            assert "+++ b/hello.txt" in patch
        refused = httpx.post(live.url + API, headers=caller(live), json={
            "repo": f"{daemon.url}/other", "task": "t", "model": "scripted"})
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["code"] == "repo_url_not_allowed"
    finally:
        live.stop()
        daemon.stop()


def test_store_rolls_back_a_failed_transaction(tmp_path):
    store = BackgroundRecords.open(tmp_path / "runs.db")
    store.create({"id": "r1", "tenant": "t", "repo": "/r", "ref": "HEAD", "task": "x",
                  "model": "m"})
    with pytest.raises(Exception, match="UNIQUE"):
        store.create({"id": "r1", "tenant": "t", "repo": "/r", "ref": "HEAD", "task": "y",
                      "model": "m"})
    assert store.get("t", "r1")["task"] == "x" and store.get("u", "r1") is None
    store.close()


def cli(*args: str, key: str, server, env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess:
    env = {**(os.environ if env is None else env), "CODEPLANE_API_KEY": key,
           "CODEPLANE_SERVER": server.url, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-m", "codeplane", "agents", *args],
                          capture_output=True, text=True, env=env, timeout=120, check=False)


def test_cli_launch_logs_and_pull_with_and_without_conflicts(scripted, repo, server, tmp_path):
    key = caller(server)["authorization"][7:]
    scripted.script = list(HELLO)
    launched = cli("launch", "create hello.txt", "--repo", str(repo), "--model", "scripted",
                   "--json", key=key, server=server)
    assert launched.returncode == 0, launched.stderr
    run_id = json.loads(launched.stdout)["id"]
    logs = cli("logs", run_id, "--follow", key=key, server=server)
    assert "create_file" in logs.stdout and "[end] completed" in logs.stdout, logs.stdout
    assert run_id in cli("list", key=key, server=server).stdout
    assert "completed" in cli("show", run_id, key=key, server=server).stdout
    local = tmp_path / "local"
    git(tmp_path, "clone", "-q", str(repo), str(local))
    pulled = cli("pull", run_id, "--path", str(local), key=key, server=server)
    assert pulled.returncode == 0, pulled.stderr
    assert (local / "hello.txt").read_text() == "hello\n"
    # a checkout where hello.txt already says something else: refused, left as it was
    clash = tmp_path / "clash"
    git(tmp_path, "clone", "-q", str(repo), str(clash))
    (clash / "hello.txt").write_text("goodbye\n")
    git(clash, "add", "-A")
    git(clash, "commit", "-qm", "mine")
    head = git(clash, "rev-parse", "HEAD")
    refused = cli("pull", run_id, "--path", str(clash), key=key, server=server)
    assert refused.returncode == 2 and "does not apply cleanly" in refused.stderr
    assert git(clash, "rev-parse", "HEAD") == head and not git(clash, "status", "--porcelain")
    assert (clash / "hello.txt").read_text() == "goodbye\n"
    other = caller(server, "t2")["authorization"][7:]
    assert cli("pull", run_id, "--path", str(local), key=other, server=server).returncode == 2
    assert cli("delete", run_id, key=other, server=server).returncode == 2
    # delete erases what the server kept: record, events, patch, checkout
    assert cli("delete", run_id, key=key, server=server).returncode == 0
    assert cli("show", run_id, key=key, server=server).returncode == 2
    assert not (server.app.state.services.background.root / run_id).exists()
    assert _events(server, run_id) == []


def no_git_identity(home: Path) -> dict[str, str]:
    """The environment of a fresh machine or container: an empty HOME, no system git config,
    no EMAIL or GIT_* variables, so git knows no user.name/user.email."""
    home.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("GIT_") and k not in ("EMAIL", "XDG_CONFIG_HOME")}
    return {**env, "HOME": str(home), "GIT_CONFIG_NOSYSTEM": "1"}


def test_pull_works_where_git_knows_no_identity(scripted, repo, server, tmp_path):
    """`git am` records a committer: with no identity configured it used to refuse
    ('Committer identity unknown'). The patch keeps its author; the committer is the user
    when git knows them, else a fixed codeplane identity."""
    key = caller(server)["authorization"][7:]
    scripted.script = list(HELLO)
    run_id = launch(server, repo)["id"]
    assert ended(server, run_id)["status"] == "completed"
    bare = no_git_identity(tmp_path / "empty-home")
    for name, user in (("anonymous", None), ("known", "Ada <ada@example.org>")):
        local = tmp_path / name
        git(tmp_path, "clone", "-q", str(repo), str(local))
        if user:
            git(local, "config", "user.name", "Ada")
            git(local, "config", "user.email", "ada@example.org")
        pulled = cli("pull", run_id, "--path", str(local), key=key, server=server, env=bare)
        assert pulled.returncode == 0, pulled.stderr
        assert (local / "hello.txt").read_text() == "hello\n"
        author, committer = git(local, "log", "-1", "--format=%an <%ae>%n%cn <%ce>").split("\n")[:2]
        assert author == "codeplane <agent@codeplane.invalid>"
        assert committer == (user or "codeplane <codeplane@localhost>")
    # a conflict: `git am --abort` needs an identity too, or the checkout is left mid-merge
    clash = tmp_path / "clash"
    git(tmp_path, "clone", "-q", str(repo), str(clash))
    (clash / "hello.txt").write_text("goodbye\n")
    git(clash, "add", "-A")
    git(clash, "commit", "-qm", "mine")
    refused = cli("pull", run_id, "--path", str(clash), key=key, server=server, env=bare)
    assert refused.returncode == 2 and "does not apply cleanly" in refused.stderr
    assert not git(clash, "status", "--porcelain") and not (clash / ".git/rebase-apply").exists()


@pytest.mark.model
def test_real_model_hello_via_cli_launch_and_pull(engine, repo, tmp_path):
    """The issue's acceptance run: the real local model in the real sandbox, via the CLI."""
    live = run_server(tmp_path / "home", None, engine=engine,
                      workspace_roots=[str(repo.parent)])
    try:
        key = caller(live)["authorization"][7:]
        launched = cli("launch", "create hello.txt containing the word hello", "--repo",
                       str(repo), "--model", "code-medium", "--max-steps", "4", key=key,
                       server=live)
        assert launched.returncode == 0, launched.stderr
        run_id = launched.stdout.strip()
        got = wait_for(lambda: (r := httpx.get(f"{live.url}{API}/{run_id}",
                                               headers=caller(live)).json())["status"]
                       not in ("queued", "running") and r, 540, "for the model run")
        assert got["status"] == "completed" and got["commit_sha"], got
        local = tmp_path / "local"
        git(tmp_path, "clone", "-q", str(repo), str(local))
        pulled = cli("pull", run_id, "--path", str(local), key=key, server=live)
        assert pulled.returncode == 0, pulled.stderr
        assert "hello" in (local / "hello.txt").read_text().lower()
    finally:
        live.stop()
