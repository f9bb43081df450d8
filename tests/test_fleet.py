"""The sandbox fleet over real HTTP on loopback: copy-on-write sandboxes from a git repo, warm
pools, quotas, diff, release, and the reaper after a SIGKILLed `codeplane serve`."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import LiveServer, free_port, make_settings
from upstreams.scripted import caller, run_server, wait_for

from codeplane.gateway.keys import KeyStore
from codeplane.sandbox.clone import mounts_under
from codeplane.sandbox.runner import Limits


def git_repo(path: Path, files: dict[str, str]) -> Path:
    path.mkdir(parents=True)
    for name, text in files.items():
        (path / name).write_text(text)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@localhost"}
    for argv in (["init", "-q", "-b", "main"], ["add", "."], ["commit", "-qm", "init"]):
        subprocess.run(["git", *argv], cwd=path, env=env, check=True)
    return path


def fleet_server_at(tmp: Path, fleet_toml: str, repo_urls: list[str] | None = None,
                    **gateway) -> LiveServer:
    """A real server whose workspace root `tmp/code` holds one repo, `app`; `repo_urls` are
    the URL prefixes its policy lets sandboxes fetch from."""
    root = tmp / "code"
    git_repo(root / "app", {"a.txt": "hello\n", "src.py": "x = 1\n"})
    home = tmp / "home"
    home.mkdir()
    (home / "codeplane.toml").write_text(f"[fleet]\n{fleet_toml}\n")
    server = run_server(home, None, gateway=gateway, workspace_roots=[str(root)],
                        repo_urls=repo_urls or [])
    server.tmp, server.root = tmp, root
    return server


@pytest.fixture(scope="module")
def fleet_server(tmp_path_factory):
    server = fleet_server_at(tmp_path_factory.mktemp("fleet"), "pool_size = 1\nmax_per_tenant = 3")
    yield server
    server.stop()


def create(server, tenant: str = "t1", **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/sandboxes", headers=caller(server, tenant),
                      json={"repo": str(server.root / "app"), **body}, timeout=60)

def test_sandbox_lifecycle_changes_stay_in_the_sandbox(fleet_server):
    s, h = fleet_server, caller(fleet_server)
    box = create(s).json()
    url = f"{s.url}/v1/sandboxes/{box['id']}"
    assert httpx.put(f"{url}/files", params={"path": "new/b.txt"}, content=b"written\n",
                     headers=h).status_code == 200
    ran = httpx.post(f"{url}/exec", json={"command": "cat new/b.txt; echo more >> a.txt"},
                     headers=h, timeout=60).json()
    assert ran["exit_code"] == 0 and ran["output"] == "written\n" and ran["sandboxed"]
    assert httpx.get(f"{url}/files", params={"path": "a.txt"},
                     headers=h).content == b"hello\nmore\n"
    patch = httpx.get(f"{url}/diff", headers=h, timeout=60).json()["diff"]
    assert "+more" in patch and "new file mode" in patch and "+written" in patch
    assert (s.root / "app" / "a.txt").read_text() == "hello\n"  # the repo is untouched
    assert not (s.root / "app" / "new").exists()
    workspace = Path(box["workspace"])
    assert workspace.is_dir()
    assert httpx.delete(url, headers=h).json()["deleted"] is True
    assert not workspace.parent.exists() and not mounts_under(workspace.parent)
    assert httpx.get(url, headers=h).status_code == 404


def test_second_sandbox_shares_the_base(fleet_server):
    """Copy-on-write: a fresh sandbox adds nothing to the disk until it writes."""
    s, h = fleet_server, caller(fleet_server)
    boxes = [create(s).json() for _ in range(2)]
    services = s.app.state.services
    for box in boxes:
        assert box["strategy"] == services.fleet.strategy.name
        if box["strategy"] == "overlay":
            path = Path(box["workspace"]).parent
            assert mounts_under(path) == [path / "ws"]
            assert not any((path / "upper").iterdir())
        httpx.delete(f"{s.url}/v1/sandboxes/{box['id']}", headers=h)


def test_warm_pool_refills_and_serves_hits(fleet_server):
    s, h = fleet_server, caller(fleet_server)
    first = create(s).json()

    def pool() -> dict | None:
        pools = httpx.get(f"{s.url}/v1/sandboxes", headers=h).json()["fleet"]["pools"]
        return next((p for p in pools if p["commit"] == first["commit"] and p["ready"] >= 1),
                    None)

    before = wait_for(pool, what="for the pool to refill")
    second = create(s).json()
    after = httpx.get(f"{s.url}/v1/sandboxes", headers=h).json()
    stats = next(p for p in after["fleet"]["pools"] if p["commit"] == first["commit"])
    assert stats["hits"] == before["hits"] + 1
    assert {b["id"] for b in after["data"]} >= {first["id"], second["id"]}
    for box in (first, second):
        httpx.delete(f"{s.url}/v1/sandboxes/{box['id']}", headers=h)


def test_tenant_sandbox_quota(fleet_server):
    s = fleet_server
    made = [create(s, "quota").json()["id"] for _ in range(3)]
    refused = create(s, "quota")
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "sandbox_quota_exceeded"
    assert create(s, "other-tenant").status_code == 201  # the quota is per tenant
    for sandbox_id in made:
        httpx.delete(f"{s.url}/v1/sandboxes/{sandbox_id}", headers=caller(s, "quota"))


def test_ref_selects_the_commit(fleet_server):
    s = fleet_server
    assert create(s, ref="main").status_code == 201
    missing = create(s, ref="no-such-branch")
    assert missing.status_code == 400 and missing.json()["error"]["code"] == "unknown_ref"


def test_reaper_cleans_up_after_sigkill(tmp_path):
    """A real `codeplane serve` subprocess makes sandboxes, is SIGKILLed, and leaves mounts,
    directories and a process working in a sandbox; the restarted server removes them all."""
    root = tmp_path / "code"
    git_repo(root / "app", {"a.txt": "hello\n"})
    home = tmp_path / "home"
    settings = make_settings(home, serve={"workspace_roots": [str(root)]})
    (home / "codeplane.toml").write_text(
        f"[serve]\nworkspace_roots = [\"{root}\"]\n[fleet]\npool_size = 2\n")
    _, secret = KeyStore.from_settings(settings).create("k", tenant="t1")
    headers = {"authorization": f"Bearer {secret}"}
    fleet_dir = settings.server_dir / "fleet" / "sandboxes"

    def start() -> tuple[subprocess.Popen, str]:
        return serve_process(home, tmp_path / "serve.log")

    proc, url = start()
    made = [httpx.post(f"{url}/v1/sandboxes", json={"repo": str(root / "app")},
                       headers=headers, timeout=60).json() for _ in range(2)]
    wait_for(lambda: len(list(fleet_dir.iterdir())) >= 4, what="for the pool to fill")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    left = list(fleet_dir.iterdir())
    assert len(left) >= 4  # two acquired, two pooled: the crash left them all
    leftover = subprocess.Popen(["sleep", "600"], cwd=made[0]["workspace"])  # e.g. a git the
    try:                                                            # dead server was running
        proc, url = start()
        assert leftover.wait(timeout=30) == -signal.SIGKILL
        for path in left:
            assert not path.exists() and not mounts_under(path)
        fleet = httpx.get(f"{url}/v1/sandboxes", headers=headers).json()["fleet"]
        assert fleet["reaped_at_start"]["sandboxes"] >= 4
        assert fleet["reaped_at_start"]["processes"] >= 1
        assert httpx.get(f"{url}/v1/sandboxes/{made[0]['id']}", headers=headers
                         ).json()["state"] == "gone"  # its record says so (test_sandbox_records)
    finally:
        leftover.kill()
        proc.terminate()
        proc.wait(timeout=30)
    assert not mounts_under(fleet_dir)  # a clean shutdown removes what it made


class GitDaemon:
    """`git daemon` on a loopback port serving the repositories under `base` (read-only):
    the git server URL-fetch tests and the benchmark fetch from."""

    def __init__(self, base: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"git://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            ["git", "daemon", "--reuseaddr", "--export-all", f"--base-path={base}",
             "--listen=127.0.0.1", f"--port={self.port}", str(base)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        wait_for(lambda: _listening(self.port), 30, "for git daemon")

    def stop(self) -> None:
        """`git daemon` runs `git-daemon` as a child: end the whole group, not the wrapper."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(timeout=30)


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def serve_process(home: Path, log_path: Path) -> tuple[subprocess.Popen, str]:
    """A real `codeplane serve` subprocess on `home` (its codeplane.toml), once it answers:
    what a test SIGKILLs to leave what a crash leaves."""
    port = free_port()
    env = {**os.environ, "CODEPLANE_HOME": str(home),
           "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-c", "from codeplane.cli import main; main()",
                                 "serve", "--port", str(port)], env=env,
                                stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: _up(url), 60, "for codeplane serve")
    return proc, url


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_sandbox_from_a_git_bundle(fleet_server):
    s, h = fleet_server, caller(fleet_server)
    bundle = s.root / "app.bundle"
    if not bundle.exists():
        subprocess.run(["git", "bundle", "create", "-q", str(bundle), "main"],
                       cwd=s.root / "app", check=True)
    box = create(s, repo=str(bundle), ref="main")
    assert box.status_code == 201, box.text
    got = httpx.get(f"{s.url}/v1/sandboxes/{box.json()['id']}/files",
                    params={"path": "a.txt"}, headers=h)
    assert got.content == b"hello\n"
    assert create(s, repo=str(bundle), ref="nope").status_code == 400


def test_tenant_quota_holds_under_a_burst(fleet_server):
    """Eight acquires at once against a quota of three: exactly three are made."""
    s = fleet_server
    caller(s, "burst")
    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda _: create(s, "burst"), range(8)))
    assert sorted(r.status_code for r in codes) == [201] * 3 + [429] * 5
    for made in codes:
        if made.status_code == 201:
            httpx.delete(f"{s.url}/v1/sandboxes/{made.json()['id']}", headers=caller(s, "burst"))


def test_pooled_sandbox_as_a_workspace(fleet_server):
    """The fleet's sandbox behind the `Workspace` interface the agent's tools use."""
    fleet = fleet_server.app.state.services.fleet
    ws = fleet.open("ws-tenant", fleet_server.root / "app", "main")
    before = ws.snapshot()
    ws.write(Path("made.txt"), b"made\n")
    assert ws.read(Path("a.txt"), 100) == b"hello\n"
    ran = ws.exec("cat made.txt && echo o > other.txt", Limits(timeout=60))
    assert ran.exit_code == 0 and ran.output == "made\n" and ws.describe()["backend"] == "pool"
    assert "made.txt" in ws.diff(before) and "other.txt" in ws.diff(before)
    root = ws.root
    ws.close()
    assert not root.exists() and fleet.list("ws-tenant") == []




def test_agent_run_on_the_pool_backend(scripted, tmp_path):
    """`POST /v1/agent/runs` with backend "pool": the agent's tools run unchanged in a pooled
    sandbox of the repo, which the run's end gives back; server policy decides which backends
    a request may name."""
    root = tmp_path / "code"
    repo = git_repo(root / "app", {"a.txt": "hello\n"})
    server = run_server(tmp_path / "home", scripted.url, workspace_roots=[str(root)])
    try:
        url, h = f"{server.url}/v1/agent/runs", caller(server)
        body = {"task": "make b", "path": str(repo), "model": "scripted", "stream": False,
                "max_steps": 3}
        scripted.script = [{"calls": [("create_file", {"path": "b.txt", "content": "b\n"}),
                                      ("run_terminal_cmd", {"command": "cat a.txt b.txt"})]},
                           {"content": "done"}]
        run = httpx.post(url, headers=h, json={**body, "backend": "pool"}).json()
        got = wait_for(lambda: (r := httpx.get(f"{url}/{run['id']}", headers=h).json())
                       ["status"] != "running" and r, what="for the pool run")
        assert got["status"] == "completed", got
        start = next(e for e in got["transcript"] if e["type"] == "run_start")
        assert start["environment"]["backend"] == "pool"
        outputs = [e["output"] for e in got["transcript"] if e["type"] == "tool_result"]
        assert "hello\nb\n" in outputs[-1]
        assert not (repo / "b.txt").exists()  # the work stayed in the sandbox...
        sandbox = Path(start["environment"]["root"]).parent  # ...which the run's end removes
        wait_for(lambda: not sandbox.exists(), what="for the sandbox to go")
        assert server.app.state.services.fleet.list("t1") == [] and not mounts_under(sandbox)
        for backend, status, code in (("host", 403, "unsandboxed_not_allowed"),
                                      ("nosuch", 403, "backend_not_allowed")):
            refused = httpx.post(url, headers=h, json={**body, "backend": backend})
            assert refused.status_code == status and refused.json()["error"]["code"] == code
        plain = root / "plain"
        plain.mkdir()
        refused = httpx.post(url, headers=h, json={**body, "path": str(plain),
                                                  "backend": "pool"})
        assert refused.status_code == 400, refused.text  # not a git repository
    finally:
        server.stop()


def test_pool_backend_needs_a_fleet(tmp_path):
    """Outside a server (`codeplane tool --backend pool`) there is no fleet: a clear refusal."""
    from codeplane.agent.env import ToolError, local_environment

    with pytest.raises(ToolError, match="needs a server's sandbox fleet"):
        local_environment(git_repo(tmp_path / "r", {"a": "a\n"}), backend="pool")


def test_the_pool_backend_takes_its_fleet_and_tenant_by_injection(pool_fleet, tmp_path):
    """The composition root gives the table the fleet; each caller binds its tenant (two
    callers on two threads at once, each sandbox counted against its own tenant), and a
    sandbox a caller holds opens as a workspace that closing does not release."""
    from codeplane.sandbox import Backends, BackendServices

    repo = git_repo(tmp_path / "r", {"a.txt": "a\n"})
    server = Backends(BackendServices(fleet=pool_fleet))
    with ThreadPoolExecutor(2) as pool:
        opened = list(pool.map(lambda t: server.for_caller(t).open(repo, "pool"),
                               ["inj-a", "inj-b"]))
    assert [len(pool_fleet.list(t)) for t in ("inj-a", "inj-b")] == [1, 1]
    assert {ws.box.tenant for ws in opened} == {"inj-a", "inj-b"}
    for ws in opened:
        ws.close()
    assert pool_fleet.list("inj-a") == pool_fleet.list("inj-b") == []
    box = pool_fleet.acquire("inj-a", repo)
    held = server.for_caller("inj-a", box).open(box.workspace, "pool")
    assert held.read(Path("a.txt"), 10) == b"a\n" and held.root == box.workspace
    held.close()
    assert [b.id for b in pool_fleet.list("inj-a")] == [box.id]
    with pytest.raises(ValueError, match="not the tree of the held sandbox"):
        server.for_caller("inj-a", box).open(repo, "pool")
    pool_fleet.release(box.id)
