"""Two `codeplane serve` processes on one PostgreSQL and one S3 bucket (SeaweedFS), both
started by the tests on loopback: what one replica does, the other sees; what a SIGKILLed
replica was doing ends consistent (uploads leave no duplicate rows, runs end interrupted, never
"running"); a token budget holds across both.

The replicas are real processes with homes of their own (their own disks); only the database
and the bucket are shared. The models they call are loopback stand-ins for remote providers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from conftest import free_port, make_settings
from indexkit import write
from pgserver import pg_server  # noqa: F401  (fixture)
from s3server import S3Server, s3_server  # noqa: F401  (fixture)
from security.test_limits import HeldUpstream
from sqlalchemy import select
from upstreams.scripted import wait_for

from codeplane.config import Settings
from codeplane.indexing.query import search
from codeplane.indexing.remote import Remote, RemoteError
from codeplane.indexing.state import WorkspaceState
from codeplane.indexing.sync import sync
from codeplane.storage import Database
from codeplane.storage.tables import agent_runs

AGENT = "/v1/agent/runs"
HANG = {"raw": ['data: {"choices": []}\n\n'], "hang": True}  # a model call that never ends
BG = "/v1/background-agents"
CODE = {f"pkg/mod{i}.py": f'def handler_{i}(request):\n    """Serve route {i} of the '
                          f'storefront."""\n    return {{"route": {i}, "ok": True}}\n'
        for i in range(8)}
CODE["billing/invoice.py"] = ('def compute_invoice_total(lines, tax_rate):\n    """Sum line '
                              'items and add sales tax."""\n    return sum(l.price for l in '
                              'lines) * (1 + tax_rate)\n')


@dataclass
class Replica:
    name: str
    home: Path
    port: int = 0
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Cluster:
    root: Path
    db_url: str
    s3: S3Server
    prefix: str
    model_url: str
    held_url: str
    repos: Path
    replicas: dict[str, Replica] = field(default_factory=dict)

    def env(self, replica: Replica) -> dict[str, str]:
        return {**os.environ, **self.s3.env(), "CODEPLANE_HOME": str(replica.home),
                "PYTHONPATH": os.pathsep.join(sys.path)}

    def configure(self, replica: Replica) -> None:
        make_settings(replica.home)  # the home, with the shared model weights linked in
        models = [{"name": "scripted", "provider": "openai", "base_url": self.model_url,
                   "model": "scripted"},
                  {"name": "held", "provider": "openai", "base_url": self.held_url,
                   "model": "up-model"}]
        lines = ["[serve]", f"workspace_roots = [{json.dumps(str(self.repos))}]",
                 "[gateway]", 'auth = "on"',
                 "[storage]", f"database = {json.dumps(self.db_url)}",
                 f"objects = {json.dumps(f's3://{self.s3.bucket}/{self.prefix}')}",
                 f"endpoint_url = {json.dumps(self.s3.endpoint_url)}", "lease_seconds = 2"]
        for model in models:
            lines += ["[[models]]", *(f"{k} = {json.dumps(v)}" for k, v in model.items())]
        (replica.home / "codeplane.toml").write_text("\n".join(lines) + "\n")

    def start(self, name: str) -> Replica:
        replica = self.replicas.setdefault(name, Replica(name, self.root / name))
        if not (replica.home / "codeplane.toml").exists():
            self.configure(replica)
        replica.port = free_port()
        log = (self.root / f"{name}.log").open("ab")
        replica.proc = subprocess.Popen(
            [sys.executable, "-m", "codeplane", "serve", "--port", str(replica.port),
             "--log-level", "warning"], env=self.env(replica), stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

        def up() -> bool:
            assert replica.proc.poll() is None, f"{name} exited; see {self.root / name}.log"
            try:
                return httpx.get(f"{replica.url}/healthz", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, 120, f"for replica {name}")
        return replica

    def kill(self, name: str) -> None:
        """SIGKILL: no shutdown hook runs, nothing is flushed or released."""
        proc = self.replicas[name].proc
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def cli(self, name: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "codeplane", *args], check=True,
                              env=self.env(self.replicas[name]), capture_output=True,
                              text=True, timeout=120)

    def key(self, name: str, key_name: str, *options: str,
            tenant: str = "acme") -> dict[str, str]:
        """A new API key, created with the CLI on `name`'s host; its Bearer header."""
        made = json.loads(self.cli(name, "keys", "create", key_name, "--tenant", tenant,
                                   *options, "--json").stdout)
        return {"authorization": f"Bearer {made['key']}"}

    def stop(self) -> None:
        for replica in self.replicas.values():
            if replica.proc is not None and replica.proc.poll() is None:
                replica.proc.send_signal(signal.SIGTERM)
                try:
                    replica.proc.wait(15)
                except subprocess.TimeoutExpired:
                    replica.proc.kill()


@pytest.fixture(scope="module")
def held():
    up = HeldUpstream(name="held").start()
    yield up
    up.release.set()
    up.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, pg_server, s3_server, provider, held) -> Iterator[Cluster]:  # noqa: F811
    name = f"replicas_{uuid.uuid4().hex[:8]}"
    pg_server.admin(f"CREATE DATABASE {name}")
    root = tmp_path_factory.mktemp("replicas")
    repos = root / "repos"
    repos.mkdir()
    cluster = Cluster(root, pg_server.url(name), s3_server, f"cluster-{uuid.uuid4().hex[:8]}",
                      provider.url, held.url + "/v1", repos)
    try:
        cluster.start("a")
        cluster.start("b")
        yield cluster
    finally:
        cluster.stop()


def client(cluster: Cluster, replica: str, headers: dict[str, str], **indexing):
    """Index-client settings (one client home for the whole module) talking to `replica`,
    and an HTTP client carrying the API key (a sync closes the one it is given)."""
    settings = make_settings(cluster.root / "client-home", server=cluster.replicas[replica].url,
                             indexing=indexing)
    return settings, httpx.Client(timeout=300, headers=headers)


def test_a_key_created_on_one_replica_works_on_the_other(cluster):
    headers = cluster.key("a", "dev")
    for name in ("a", "b"):
        reply = httpx.get(f"{cluster.replicas[name].url}/v1/models", headers=headers)
        assert reply.status_code == 200, (name, reply.text)
    cluster.cli("b", "keys", "revoke", "dev")
    wait_for(lambda: httpx.get(f"{cluster.replicas['a'].url}/v1/models",
                               headers=headers).status_code == 401, 10, "for the revocation")


@pytest.mark.parametrize(("limit", "value", "passed", "refused"), [
    ("--budget-tokens", "100", 2, 403), ("--tpm", "100", 2, 429), ("--rpm", "5", 5, 429)])
def test_a_limit_holds_across_replicas_under_concurrent_calls(cluster, held, limit, value,
                                                               passed, refused):
    """Each call holds ~45 tokens before it starts; with a 100-token budget (or 100 tokens
    per minute), 2 of 10 simultaneous calls (5 on each replica) go through; with 5 requests
    per minute, 5 do. Per-replica accounting would let twice as many through."""
    headers = cluster.key("a", f"intern{limit}", limit, value)
    body = {"model": "held", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30}
    urls = [f"{cluster.replicas[n].url}/v1/chat/completions" for n in ("a", "b")] * 5
    held.release.clear()
    held.arrived = 0
    with ThreadPoolExecutor(10) as pool:
        futures = [pool.submit(httpx.post, url, json=body, headers=headers, timeout=60)
                   for url in urls]
        wait_for(lambda: sum(f.done() for f in futures) + held.arrived >= 10, 60,
                 "for every call to be refused or forwarded")
        held.release.set()
        codes = sorted(f.result().status_code for f in futures)
    assert codes == [200] * passed + [refused] * (10 - passed)


def test_a_workspace_indexed_through_one_is_searchable_through_the_other(cluster, tmp_path):
    headers = cluster.key("a", "indexer")
    root = tmp_path / "storefront"
    write(root, CODE)
    settings_a, http_a = client(cluster, "a", headers)
    sync(root, settings_a, http=http_a)
    settings_b, http_b = client(cluster, "b", headers)
    found = search(root, "compute the invoice total with tax", 3, settings_b, http=http_b)
    assert found.results[0]["path"] == "billing/invoice.py"


def test_a_background_run_whose_replica_is_killed_ends_interrupted(cluster, provider):
    headers = cluster.key("a", "runner")
    repo = cluster.repos / "repo"
    write(repo, {"a.py": "A = 1\n"})
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-qm", "start"]):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                       check=True, capture_output=True)
    provider.reset().script = [HANG]
    b = cluster.replicas["b"].url
    run = httpx.post(b + BG, headers=headers, json={
        "repo": str(repo), "task": "create hello.txt", "model": "scripted", "max_steps": 4})
    assert run.status_code == 202, run.text
    run_id = run.json()["id"]
    wait_for(lambda: provider.requests, 60, "for the run's first model call")
    a = cluster.replicas["a"].url
    assert httpx.get(f"{a}{BG}/{run_id}", headers=headers).json()["status"] == "running"
    cluster.kill("b")

    def ended() -> dict | None:
        got = httpx.get(f"{a}{BG}/{run_id}", headers=headers).json()
        return got if got["status"] != "running" else None

    final = wait_for(ended, 60, "for the surviving replica to notice")
    assert final["status"] == "interrupted"
    with httpx.stream("GET", f"{a}{BG}/{run_id}/events", headers=headers, timeout=30) as resp:
        kinds = [json.loads(line[6:])["type"] for line in resp.iter_lines()
                 if line.startswith("data: ")]
    assert kinds[-1] == "interrupted"  # a watcher on any replica sees the end
    db = Database(cluster.db_url)
    with db.read() as conn:  # the agent run's own record ended too
        statuses = set(conn.scalars(select(agent_runs.c.status)))
    db.close()
    assert "running" not in statuses and "interrupted" in statuses
    cluster.start("b")


def test_killing_a_replica_mid_upload_leaves_the_index_consistent(cluster, tmp_path):
    """A sync through `a` is cut by SIGKILL right after `a` answered its second upload; that
    upload is re-sent to `b` (the client never learnt it had landed) and the sync is re-run
    through `b`. The workspace then holds exactly the rows of a clean index of the same files:
    nothing lost, nothing twice."""
    headers = cluster.key("a", "uploader")
    root, clean = tmp_path / "cut", tmp_path / "clean"
    write(root, CODE)
    write(clean, CODE)
    uploads: list[httpx.Request] = []

    def on_response(response: httpx.Response) -> None:
        if response.request.url.path.endswith("/files"):
            uploads.append(response.request)
            if len(uploads) == 2:
                cluster.kill("a")

    settings_a, http_a = client(cluster, "a", headers, batch_chunks=2)
    http_a.event_hooks["response"] = [on_response]
    with pytest.raises(RemoteError, match="cannot reach"):
        sync(root, settings_a, http=http_a)
    resent = httpx.post(f"{cluster.replicas['b'].url}{uploads[1].url.path}",
                         content=uploads[1].content, headers=dict(uploads[1].headers), timeout=300)
    assert resent.status_code == 200, resent.text
    for path in (root, clean):
        settings_b, http_b = client(cluster, "b", headers, batch_chunks=2)
        sync(path, settings_b, http=http_b)
    cluster.start("a")
    cut = _status(root, *client(cluster, "a", headers))  # read back through the restarted a
    clean_rows = _status(clean, *client(cluster, "b", headers))["chunks"]
    assert cut["chunks"] == clean_rows == len(CODE)  # one chunk per (small) file


def _status(root: Path, settings: Settings, http: httpx.Client) -> dict:
    state = WorkspaceState(root, settings)
    try:
        return Remote(settings.server, state.workspace_id, state.keys.server_key, http).status()
    finally:
        state.close()


def _agent_run(cluster: Cluster, replica: str, headers: dict[str, str], name: str) -> str:
    """A run started without a stream on `replica`, in a fresh workspace; its id."""
    repo = cluster.repos / name
    write(repo, {"a.py": "A = 1\n"})
    run = httpx.post(cluster.replicas[replica].url + AGENT, headers=headers, timeout=60, json={
        "task": "make made.txt", "path": str(repo), "model": "scripted", "max_steps": 4,
        "stream": False})
    assert run.status_code == 200, run.text
    return run.json()["id"]


def _events(url: str, headers: dict[str, str], after: int | None = None) -> list[tuple[int, dict]]:
    """A whole SSE stream of a run: (id, event) pairs until `[DONE]`."""
    if after is not None:
        headers = {**headers, "last-event-id": str(after)}
    got, seq = [], None
    with httpx.stream("GET", url + "/events", headers=headers, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("id: "):
                seq = int(line[4:])
            elif line.startswith("data: ") and line != "data: [DONE]":
                got.append((seq, json.loads(line[6:])))
    return got


def test_an_agent_run_on_one_replica_is_shown_and_streamed_by_the_other(cluster, provider):
    """The run works on a; b streams it to its end, resumes after an event id, and answers
    GET with what a answers. Attack first: another tenant's key gets 404 on both replicas
    for the run, its events and its cancel."""
    headers = cluster.key("a", "agent-dev")
    rival = cluster.key("b", "agent-rival", tenant="rival")
    provider.reset().script = [
        {"calls": [("create_file", {"path": "made.txt", "content": "made\n"}),
                   ("run_terminal_cmd", {"command": "sleep 2; cat made.txt"})]},
        {"content": "done"}]
    run_id = _agent_run(cluster, "a", headers, "agent-ws")
    a, b = (f"{cluster.replicas[n].url}{AGENT}/{run_id}" for n in ("a", "b"))
    for url in (a, b):
        assert httpx.get(url, headers=rival).status_code == 404
        assert httpx.get(url + "/events", headers=rival).status_code == 404
        assert httpx.get(url + "/events", headers={**rival, "last-event-id": "1"}
                         ).status_code == 404
        assert httpx.post(url + "/cancel", headers=rival).status_code == 404
    events = _events(b, headers)
    kinds = [e["type"] for _, e in events]
    assert kinds[0] == "run_start" and kinds[-1] == "run_end" and "tool_result" in kinds
    assert events[-1][1]["status"] == "completed"
    assert [seq for seq, _ in events] == list(range(1, len(events) + 1))
    assert _events(b, headers, after=len(events) - 2) == events[-2:]
    got_a, got_b = (httpx.get(url, headers=headers).json() for url in (a, b))
    assert got_b == got_a and got_b["status"] == "completed"
    assert got_b["transcript"] == [e for _, e in events]
    assert got_b["result"]["answer"] == "done"  # the scripted model's last word


def test_an_agent_run_cancelled_through_the_other_replica_stops(cluster, provider):
    """b has no thread of the run: its cancel is a flag in the database that a polls."""
    headers = cluster.key("a", "agent-canceller")
    provider.reset().script = [HANG]
    run_id = _agent_run(cluster, "a", headers, "agent-cancel")
    wait_for(lambda: provider.requests, 60, "for the run's first model call")
    b = f"{cluster.replicas['b'].url}{AGENT}/{run_id}"
    cancel = httpx.post(b + "/cancel", headers=headers)
    assert cancel.status_code == 200 and cancel.json()["cancel_requested"], cancel.text
    events = _events(b, headers)
    assert events[-1][1]["type"] == "run_end" and events[-1][1]["status"] == "cancelled"
    assert httpx.get(b, headers=headers).json()["status"] == "cancelled"


def test_an_agent_runs_stream_on_the_other_replica_ends_interrupted_when_its_owner_dies(
        cluster, provider):
    headers = cluster.key("b", "agent-orphan")
    provider.reset().script = [HANG]
    run_id = _agent_run(cluster, "a", headers, "agent-orphan")
    wait_for(lambda: provider.requests, 60, "for the run's first model call")
    b = f"{cluster.replicas['b'].url}{AGENT}/{run_id}"
    with ThreadPoolExecutor(1) as pool:
        watching = pool.submit(_events, b, headers)
        wait_for(lambda: httpx.get(b, headers=headers).json()["transcript"], 30,
                 "for the run's first event")
        cluster.kill("a")
        events = watching.result(timeout=60)
    assert events[0][1]["type"] == "run_start" and events[-1][1]["type"] == "interrupted"
    assert httpx.get(b, headers=headers).json()["status"] == "interrupted"
    cluster.start("a")


def test_a_sandbox_made_on_one_replica_is_listed_by_the_other(cluster):
    """Only its record is shared: b lists and shows it (its state and replica), refuses to
    work in it with a 409, and another tenant sees nothing on either replica."""
    headers = cluster.key("a", "sandboxer", tenant="sandboxes")  # earlier tests' are "gone"
    rival = cluster.key("b", "sandbox-rival", tenant="rival")
    repo = cluster.repos / "sandboxed"
    write(repo, {"a.py": "A = 1\n"})
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-qm", "start"]):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                       check=True, capture_output=True)
    a, b = (f"{cluster.replicas[n].url}/v1/sandboxes" for n in ("a", "b"))
    made = httpx.post(a, headers=headers, json={"repo": str(repo)}, timeout=60)
    assert made.status_code == 201, made.text
    box = made.json()
    for url in (a, b):
        assert httpx.get(url, headers=rival).json()["data"] == []
        assert httpx.get(f"{url}/{box['id']}", headers=rival).status_code == 404
    (listed,) = httpx.get(b, headers=headers).json()["data"]
    assert (listed["id"], listed["state"]) == (box["id"], "active")
    assert listed["replica"] == box["replica"] and "workspace" not in listed
    assert httpx.get(f"{b}/{box['id']}", headers=headers).json() == listed
    refused = httpx.post(f"{b}/{box['id']}/exec", headers=headers, json={"command": "ls"})
    assert refused.status_code == 409 and box["replica"] in refused.text
    assert httpx.delete(f"{a}/{box['id']}", headers=headers).status_code == 200
    assert httpx.get(b, headers=headers).json()["data"] == []
