"""Private indexing end to end: a real client syncing over loopback HTTP to a real server
(FastAPI + LanceDB + the bge-small ONNX embedder), with the privacy properties checked on the
wire, in the server's storage and in its logs."""

from __future__ import annotations

import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import LiveServer, free_port, make_settings
from indexkit import tenant_app, write

from codeplane.indexing.chunker import EMBED_FORMAT
from codeplane.indexing.query import IndexUnavailable, search, search_workspace
from codeplane.indexing.remote import Remote, RemoteError
from codeplane.indexing.state import WorkspaceState, workspace_dir
from codeplane.indexing.sync import sync
from codeplane.models.embed_openai import OpenAIEmbedder, OpenAIEmbedderSettings
from codeplane.models.embedders import Embedders

AWS_KEY = "AKIA" + "QYLPMN5HHHFPZAM2"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/" + "bPxRfiCYzQ8mLpR4tUvW"
PEM_BODY = "MIIEowIBAAKCAQEAx4Rb" + "S1tW0vK3nQ9pL2mZ8yJ7hG6fD5sA4"

WORKSPACE = {
    "billing/invoice.py": '''"""Invoices for the storefront."""
from decimal import Decimal


def compute_invoice_total(lines, tax_rate):
    """Sum line items and add sales tax, rounding to cents."""
    subtotal = sum(Decimal(l.price) * l.quantity for l in lines)
    return (subtotal * (1 + Decimal(tax_rate))).quantize(Decimal("0.01"))


def apply_discount_code(order, code):
    """Reduce an order's total by a percentage coupon if the coupon is still valid."""
    if code.expired or code.uses_left <= 0:
        raise ValueError("coupon no longer valid")
    order.total = order.total * (100 - code.percent) / 100
    code.uses_left -= 1
    return order


def render_invoice_email(customer, invoice):
    """Write the plain-text email that carries an invoice to a customer."""
    greeting = f"Dear {customer.name},"
    body = f"your invoice {invoice.number} over {invoice.total} is attached."
    return "\\n\\n".join([greeting, body, "Kind regards, the billing team"])
''',
    "utils/durations.py": '''import re

UNITS = {"h": 3600, "m": 60, "s": 1}


def parse_duration_string(text):
    """Convert strings such as '1h30m' or '45s' into a number of seconds."""
    total = 0
    for amount, unit in re.findall(r"(\\d+)([hms])", text):
        total += int(amount) * UNITS[unit]
    return total


def humanize_seconds(seconds):
    """Format a number of seconds as hours, minutes and seconds for people."""
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h {minutes}m {secs}s"
''',
    "auth/cloud.py": f'''import boto3


def upload_backup_archive(path):
    """Push the nightly backup tarball into the object store bucket."""
    session = boto3.Session(aws_access_key_id="{AWS_KEY}",
                            aws_secret_access_key="{AWS_SECRET}")
    session.client("s3").upload_file(path, "backups", path)


def list_backup_archives(client):
    """Names of every backup tarball kept in the bucket, newest first."""
    names = [o["Key"] for o in client.list_objects(Bucket="backups")["Contents"]]
    return sorted(names, reverse=True)
''',
    "deploy/ssh_keys.py": f'''DEPLOY_KEY = """-----BEGIN RSA PRIVATE KEY-----
{PEM_BODY}
-----END RSA PRIVATE KEY-----"""


def rotate_deploy_keys(servers):
    """Replace the authorized deploy key on every production server in turn."""
    for host in servers:
        host.install_key(DEPLOY_KEY)
''',
    "README.md": "# storefront\n\nBilling, auth and deployment helpers for the storefront.\n",
    ".gitignore": "ignored_notes.txt\n",
    "ignored_notes.txt": "quarterly_margin_projection_confidential = 0.4132\n",
}


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real server with its own CODEPLANE_HOME, so its storage can be audited alone."""
    cfg = make_settings(tmp_path_factory.mktemp("server") / "home")
    live = LiveServer(tenant_app(cfg), free_port()).start()
    yield live, cfg
    live.stop()


@pytest.fixture(scope="module")
def logs():
    """Every log record of client and server (uvicorn access log included) at DEBUG."""
    capture = Capture()
    names = ["", "uvicorn", "uvicorn.access", "uvicorn.error"]
    saved = [(logging.getLogger(n), logging.getLogger(n).level) for n in names]
    for logger, _ in saved:
        logger.addHandler(capture)
        logger.setLevel(logging.DEBUG)
    yield capture
    for logger, level in saved:
        logger.removeHandler(capture)
        logger.setLevel(level)


def client_settings(tmp_path: Path, url: str, **indexing):
    return make_settings(tmp_path / "client-home", server=url, indexing=indexing)


def synced_workspace(tmp_path: Path, url: str, name: str, files: dict[str, str]):
    """A workspace of `files` under tmp_path/name, synced to the server at `url`."""
    root = tmp_path / name
    write(root, files)
    cfg = client_settings(tmp_path, url)
    sync(root, cfg)
    return root, cfg


def capturing_client(bodies: list[bytes]) -> httpx.Client:
    return httpx.Client(timeout=120, event_hooks={"request": [lambda r: bodies.append(r.read())]})


@pytest.fixture(scope="module")
def indexed(server, logs, tmp_path_factory):
    live, _ = server
    tmp = tmp_path_factory.mktemp("client")
    root = tmp / "storefront"
    write(root, WORKSPACE)
    cfg = client_settings(tmp, live.url)
    wire: list[bytes] = []
    report = sync(root, cfg, http=capturing_client(wire))
    return root, cfg, report, wire


def test_index_then_search_finds_the_function(indexed) -> None:
    root, cfg, report, _ = indexed
    assert report.files_scanned == 6 and report.files_changed == 6
    assert report.files_ignored == 1  # ignored_notes.txt
    assert report.chunks_embedded >= 7 and report.chunks_reused == 0
    hits = search_workspace(root, "convert a duration string like 1h30m into seconds", 3, cfg)
    assert hits[0]["path"] == "utils/durations.py"
    assert (hits[0]["start_line"], hits[0]["end_line"]) == (6, 11)
    assert hits[0]["snippet"].startswith("def parse_duration_string")
    assert set(hits[0]) == {"path", "start_line", "end_line", "score", "snippet"}
    coupon = search_workspace(root, "reduce the order total with a coupon", 1, cfg)
    assert coupon[0]["path"] == "billing/invoice.py" and coupon[0]["start_line"] == 11


def test_a_search_writes_no_warning_to_the_server_log(indexed, capfd) -> None:
    """LanceDB warns on stderr (from Rust, past Python's logging) on every query that selects
    columns without `_distance`: hundreds of lines per benchmark run in the server log."""
    root, cfg, _, _ = indexed
    capfd.readouterr()
    hits = search_workspace(root, "reduce the order total with a coupon", 3, cfg)
    assert hits and all(0 < h["score"] <= 1 for h in hits)  # the score still comes back
    err = capfd.readouterr().err
    assert "_distance" not in err and "arning" not in err, err


def test_planted_secrets_never_reach_the_server(indexed) -> None:
    root, cfg, report, wire = indexed
    assert report.files_withheld_secrets == 2
    assert set(report.secret_types) == {"AWS Access Key", "Private Key"}
    assert report.chunks_withheld_secrets >= 3  # every chunk of both files, not just one each
    sent = b"".join(wire)
    assert b"parse_duration_string" in sent  # the capture does see uploaded chunk text
    for secret in (AWS_KEY, AWS_SECRET, PEM_BODY, "BEGIN RSA PRIVATE KEY"):
        assert secret.encode() not in sent
    assert b"quarterly_margin_projection" not in sent  # ignored file
    # the rest of a file with a secret stays on this machine too; lexical fusion still finds it
    assert b"list_backup_archives" not in sent and b"rotate_deploy_keys" not in sent
    hybrid = make_settings(cfg.home, server=cfg.server, indexing={"fusion": "hybrid"})
    hits = search_workspace(root, "list_backup_archives newest first", 3, hybrid)
    assert any("list_backup_archives" in h["snippet"] for h in hits)


def test_a_key_split_over_chunks_withholds_the_whole_file(server, tmp_path) -> None:
    """The reported leak: a PEM key longer than one chunk; only the chunk with the header was
    withheld and every later chunk (the key body, the code after it) was uploaded."""
    live, _ = server
    body = "\n".join(f"{PEM_BODY}{i:04d}" + "Q" * 20 for i in range(80))
    text = ('"""Deployment helpers."""\n\n\ndef connect_bastion(host):\n'
            '    """Open the SSH tunnel to the bastion."""\n    return host\n\n\n'
            f'BASTION_KEY = """-----BEGIN OPENSSH PRIVATE KEY-----\n{body}\n'
            '-----END OPENSSH PRIVATE KEY-----"""\n\n\n'
            'def summarize_fleet_inventory(servers):\n'
            '    """Count servers per region for the weekly report."""\n'
            '    return {s.region: 1 for s in servers}\n')
    root = tmp_path / "ops"
    write(root, {"deploy/bastion.py": text, "main.py": "def hello():\n    return 1\n"})
    wire: list[bytes] = []
    report = sync(root, client_settings(tmp_path, live.url), http=capturing_client(wire))
    assert report.files_withheld_secrets == 1 and report.chunks_withheld_secrets >= 3
    sent = b"".join(wire)
    assert b"def hello" in sent
    for needle in (PEM_BODY, "0079QQQQ", "summarize_fleet_inventory", "connect_bastion"):
        assert needle.encode() not in sent


def test_server_storage_and_logs_hold_no_source(indexed, server, logs) -> None:
    _, server_cfg = server
    needles = set()
    for rel, text in WORKSPACE.items():
        needles |= {line.strip() for line in text.splitlines() if len(line.strip()) >= 12}
        needles |= {part for part in Path(rel).parts if len(part) >= 5}
    needles |= {"parse_duration_string", "compute_invoice_total", "durations", "invoice"}
    stored = [p for p in server_cfg.server_dir.rglob("*") if p.is_file()]
    assert any(p.suffix == ".lance" for p in stored) and len(stored) > 3
    blob = b"".join(p.read_bytes() for p in stored)
    leaked = sorted(n for n in needles if n.encode() in blob)
    assert leaked == [], f"server storage contains source: {leaked[:5]}"
    log_text = "\n".join(logs.lines)
    assert "POST /v1/index/workspaces/" in log_text  # the access log was captured
    assert not [n for n in needles if n in log_text]


def test_a_workspace_is_only_searchable_with_its_key(indexed, server, tmp_path) -> None:
    root, cfg, _, _ = indexed
    live, _ = server
    other_root, other_cfg = synced_workspace(
        tmp_path, live.url, "other", {"main.py": "def greet(name):\n    return 'hello ' + name\n"})
    state_a = WorkspaceState(root, cfg, create=False)
    state_b = WorkspaceState(other_root, other_cfg, create=False)
    intruder = Remote(live.url, state_a.workspace_id, state_b.keys.server_key)
    for call in (lambda: intruder.search("invoice", 5, None), intruder.status,
                 lambda: intruder.tree([""]), lambda: intruder.delete(["x"])):
        with pytest.raises(RemoteError) as err:
            call()
        assert err.value.status == 403
    no_key = httpx.post(f"{live.url}/v1/index/workspaces/{state_a.workspace_id}/search",
                        json={"query": "invoice"})
    assert no_key.status_code == 400
    results = search_workspace(other_root, "compute the invoice total with tax", 5, other_cfg)
    assert [r["path"] for r in results] == ["main.py"]
    with pytest.raises(IndexUnavailable, match="not indexed"):
        search_workspace(tmp_path / "never-indexed", "x", 3, other_cfg)
    state_a.close()
    state_b.close()


def test_one_line_edit_reembeds_only_that_chunk(indexed) -> None:
    root, cfg, _, _ = indexed
    again = sync(root, cfg)
    assert (again.files_changed, again.chunks_embedded, again.round_trips) == (0, 0, 2)
    path = root / "billing" / "invoice.py"
    path.write_text(path.read_text().replace('"coupon no longer valid"',
                                             '"coupon expired or used up"'))
    edit = sync(root, cfg)
    assert edit.files_changed == 1
    assert edit.chunks_embedded == 1
    assert edit.chunks_reused == 3  # module header and the two untouched functions
    assert edit.round_trips <= 8
    hits = search_workspace(root, "reduce the order total with a coupon", 1, cfg)
    assert "coupon expired or used up" in hits[0]["snippet"]
    (root / "utils" / "durations.py").unlink()
    removed = sync(root, cfg)
    assert removed.files_deleted == 1
    paths = {r["path"] for r in search_workspace(root, "seconds hours minutes", 10, cfg)}
    assert "utils/durations.py" not in paths


def test_openai_embeddings_endpoint_and_backend(server) -> None:
    """Each local model serves its own name; "default" is the one the index uses."""
    live, _ = server
    resp = httpx.post(f"{live.url}/v1/embeddings", timeout=120,  # the first call loads it
                      json={"model": "bge-small-code", "input": ["def add(a, b): return a + b"]})
    assert resp.status_code == 200
    vec = np.asarray(resp.json()["data"][0]["embedding"])
    assert vec.shape == (384,) and abs(np.linalg.norm(vec) - 1) < 1e-3
    texts = ["sum two numbers", "parse a date"]
    local = Embedders()
    for name, model in (("bge-small-code", "bge-small-code"), ("default", "bge-small-code"),
                        ("bge-small", "bge-small")):
        remote = OpenAIEmbedder(OpenAIEmbedderSettings(base_url=f"{live.url}/v1", model=name))
        assert np.allclose(remote.embed(texts), local.local(model).embed(texts),
                           atol=1e-3), name
    bad = httpx.post(f"{live.url}/v1/embeddings", json={"model": "nope", "input": "x"})
    assert bad.status_code == 404 and "bge-small-code" in bad.json()["error"]["message"]


def many_files(root: Path, count: int) -> None:
    topics = ["invoice", "shipment", "customer", "warehouse", "payment", "refund", "coupon",
              "report", "session", "ledger"]
    for i in range(count):
        topic = topics[i % len(topics)]
        write(root, {f"mod{i // 10}/{topic}_{i}.py": "\n\n".join(
            f"def {verb}_{topic}_{i}(item, limit={i}):\n"
            f"    \"\"\"{verb.title()} the {topic} number {i} unless it exceeds {limit}.\"\"\"\n"
            f"    values = [getattr(item, '{topic}_' + str(j)) for j in range({limit % 7 + 1})]\n"
            f"    return sorted(values)[:limit]\n"
            for verb, limit in (("load", 3), ("store", 5), ("audit", 9)))})


def test_killed_sync_resumes_consistently(server, tmp_path) -> None:
    """SIGKILL the CLI mid-sync: search still answers (partially, and says so); the next run
    finishes the job, re-sending only what the server does not have."""
    live, _ = server
    root = tmp_path / "big"
    many_files(root, 60)
    home = tmp_path / "client-home"
    cfg = client_settings(tmp_path, live.url, batch_chunks=4)
    (home / "codeplane.toml").write_text("[indexing]\nbatch_chunks = 4\n")
    env = {**os.environ, "CODEPLANE_HOME": str(home), "CODEPLANE_SERVER": live.url}
    cmd = [sys.executable, "-m", "codeplane", "index", str(root), "--json"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    db = workspace_dir(cfg, root) / "state.sqlite"
    deadline = time.monotonic() + 120
    indexed = 0
    while time.monotonic() < deadline and proc.poll() is None and indexed < 12:
        if db.is_file():
            try:
                with sqlite3.connect(db, timeout=5) as conn:
                    indexed = conn.execute(
                        "SELECT count(*) FROM chunks WHERE status='indexed'").fetchone()[0]
            except sqlite3.OperationalError:
                pass
        time.sleep(0.05)
    assert proc.poll() is None, "sync finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    state = WorkspaceState(root, cfg, create=False)
    before = state.chunk_counts()
    assert before.get("pending", 0) > 0
    partial = search(root, "audit the refund number 59", 3, cfg)
    assert partial.notes and "incomplete" in partial.notes[0]
    assert partial.results  # lexical ranking covers the chunks not yet embedded
    done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    for key in ("files_scanned", "files_changed", "files_ignored", "chunks_embedded",
                "chunks_reused", "chunks_withheld_secrets", "root_hash", "seconds"):
        assert key in report
    assert 0 < report["files_changed"] < 60
    after = state.chunk_counts()
    assert after == {"indexed": 180}
    remote = Remote(live.url, state.workspace_id, state.keys.server_key)
    assert remote.status()["chunks"] == 180  # no duplicates, nothing missing
    again = sync(root, cfg)
    assert again.files_changed == 0 and again.root_hash == report["root_hash"]
    hits = search(root, "audit the refund number 59 unless it exceeds 9", 3, cfg)
    assert not hits.notes
    assert "refund" in hits.results[0]["path"]
    found = subprocess.run([sys.executable, "-m", "codeplane", "search", "store the ledger 19",
                            "--root", str(root), "--json", "--limit", "2"],
                           check=False, env=env, capture_output=True, text=True, timeout=120)
    assert found.returncode == 0, found.stderr
    rows = json.loads(found.stdout)
    assert len(rows) == 2 and set(rows[0]) == {"path", "start_line", "end_line", "score"}
    state.close()


def read_json_object(stream) -> dict:
    """One pretty-printed JSON object from a line stream (print_json ends it with '}')."""
    lines = []
    for line in iter(stream.readline, ""):
        lines.append(line)
        if line.startswith("}"):
            return json.loads("".join(lines))
    raise AssertionError("stream ended: " + "".join(lines))


def test_watch_resyncs_on_change(server, tmp_path) -> None:
    live, _ = server
    root = tmp_path / "watched"
    write(root, {"app.py": "def main():\n    return 1\n"})
    env = {**os.environ, "CODEPLANE_HOME": str(tmp_path / "client-home"),
           "CODEPLANE_SERVER": live.url}
    proc = subprocess.Popen([sys.executable, "-m", "codeplane", "index", str(root), "--watch",
                             "--json", "--interval", "3"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        first = read_json_object(proc.stdout)
        assert first["files_changed"] == 1
        (root / "app.py").write_text("def main():\n    return 2\n")
        second = read_json_object(proc.stdout)
        assert (second["files_changed"], second["chunks_embedded"]) == (1, 1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_forget_deletes_the_workspace_on_the_server_and_this_machine(server, tmp_path) -> None:
    live, _ = server
    root, cfg = synced_workspace(tmp_path, live.url, "gone", {"app.py": "def main():\n    return 1\n"})
    state = WorkspaceState(root, cfg, create=False)
    remote = Remote(live.url, state.workspace_id, state.keys.server_key)
    state.close()
    assert remote.status()["chunks"] == 1
    env = {**os.environ, "CODEPLANE_HOME": str(tmp_path / "client-home"),
           "CODEPLANE_SERVER": live.url}
    forget = [sys.executable, "-m", "codeplane", "index", str(root), "--forget"]
    done = subprocess.run(forget, check=False, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "index deleted" in " ".join(done.stdout.split())  # rich wraps long lines
    with pytest.raises(RemoteError) as gone:
        remote.status()
    assert gone.value.status == 404
    remote.close()
    assert not workspace_dir(cfg, root).exists()
    again = subprocess.run(forget, check=False, env=env, capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0 and "not indexed" in " ".join(again.stdout.split())


def test_client_side_embedding_sends_only_vectors(server, tmp_path) -> None:
    """`indexing.embed = "client"`: no chunk or query text on the wire, search still finds the
    function, and the scores match server-side embedding of the same workspace."""
    live, _ = server
    root = tmp_path / "storefront"
    write(root, {k: v for k, v in WORKSPACE.items() if k.startswith(("billing", "utils"))})
    client_cfg = make_settings(tmp_path / "client-mode", server=live.url,
                               indexing={"embed": "client"})
    wire: list[bytes] = []
    report = sync(root, client_cfg, http=capturing_client(wire))
    assert report.chunks_embedded >= 6
    query = "convert a duration string like 1h30m into seconds"
    outcome = search(root, query, 3, client_cfg, http=capturing_client(wire))
    assert outcome.results[0]["path"] == "utils/durations.py"
    sent = b"".join(wire)
    assert b'"vector"' in sent and b'"text"' not in sent and b'"query"' not in sent
    for needle in ("parse_duration_string", "compute_invoice_total", "coupon", "1h30m"):
        assert needle.encode() not in sent
    server_cfg = client_settings(tmp_path, live.url)
    sync(root, server_cfg)
    by_server = search(root, query, 3, server_cfg).results
    assert [(r["path"], r["start_line"]) for r in by_server] == \
        [(r["path"], r["start_line"]) for r in outcome.results]
    assert np.allclose([r["score"] for r in by_server], [r["score"] for r in outcome.results],
                       atol=2e-3)


def test_switching_embedding_mode_rebuilds_the_workspace(server, tmp_path) -> None:
    """Server-side vectors are rotated by the server key, client-side ones by a key the server
    never gets: after a switch the old vectors are dropped and everything is re-sent."""
    live, _ = server
    root = tmp_path / "utils"
    write(root, {"durations.py": WORKSPACE["utils/durations.py"]})
    home = tmp_path / "switch-home"
    first = sync(root, make_settings(home, server=live.url))
    client_cfg = make_settings(home, server=live.url, indexing={"embed": "client"})
    switched = sync(root, client_cfg)
    assert switched.files_changed == first.files_changed == 1
    assert switched.chunks_embedded == first.chunks_embedded
    hits = search_workspace(root, "convert a duration string like 1h30m into seconds", 1,
                            client_cfg)
    assert hits[0]["start_line"] == 6


def test_an_index_built_with_another_chunk_layout_is_re_embedded(server, tmp_path) -> None:
    """The Merkle leaf hashes the file, not the text the embedder saw: after the chunk text
    layout (`chunker.EMBED_FORMAT`) changes, an unchanged file would keep its old vector next
    to new ones. A client whose index was built with another layout rebuilds it; one built
    with the current layout does not."""
    live, _ = server
    root = tmp_path / "utils"
    write(root, {"durations.py": WORKSPACE["utils/durations.py"]})
    cfg = make_settings(tmp_path / "layout-home", server=live.url)
    first = sync(root, cfg)
    assert sync(root, cfg).files_changed == 0
    state = WorkspaceState(root, cfg)
    state.put("embed_format", None)  # recorded by a client from before the format existed
    state.close()
    assert sync(root, cfg).files_changed == (0 if EMBED_FORMAT == 1 else 1)
    state = WorkspaceState(root, cfg)
    state.put("embed_format", EMBED_FORMAT + 1)  # an index built with another layout
    state.close()
    rebuilt = sync(root, cfg)
    assert rebuilt.files_changed == first.files_changed == 1
    assert rebuilt.chunks_embedded + rebuilt.chunks_reused == first.chunks_total
    assert sync(root, cfg).files_changed == 0
    hits = search_workspace(root, "convert a duration string like 1h30m into seconds", 1, cfg)
    assert hits[0]["start_line"] == 6


def relabel_as_legacy(home: Path) -> None:
    """Give the server's one workspace the storage id a store from before tenants kept (its
    workspace id, `service._migrate`): its Merkle nodes and vector table follow."""
    with sqlite3.connect(home / "server" / "codeplane.db") as db:
        ws, sid = db.execute("SELECT ws, sid FROM search_workspaces").fetchone()
        db.execute("UPDATE search_workspaces SET sid = ? WHERE sid = ?", (ws, sid))
        db.execute("UPDATE search_nodes SET ws = ? WHERE ws = ?", (ws, sid))
    tables = next(home.glob("server/**/lancedb"))
    (tables / f"ws_{sid}.lance").rename(tables / f"ws_{ws}.lance")


@pytest.mark.parametrize("legacy", [False, True], ids=["tenant-sid", "legacy-sid"])
def test_a_server_that_changed_its_embedding_model_re_embeds(tmp_path, legacy) -> None:
    """Vectors of two models rank on different footing: a workspace embedded by the wheel's
    bge-small, synced again after the server switched to bge-small-code, is emptied and
    re-embedded in full (no vector is reused from the old model's cache), and search works;
    also for a workspace stored under its pre-tenant storage id."""
    root = tmp_path / "utils"
    write(root, {"durations.py": WORKSPACE["utils/durations.py"]})
    home = tmp_path / "server-home"
    client = tmp_path / "client-home"
    runs = []
    for model in ("bge-small", "bge-small-code", "bge-small-code"):
        live = LiveServer(tenant_app(make_settings(
            home, indexing={"embedder": {"model": model}})), free_port()).start()
        try:
            cfg = make_settings(client, server=live.url)
            runs.append(sync(root, cfg))
            hits = search_workspace(root, "convert a duration string like 1h30m into seconds",
                                    1, cfg)
            status = httpx.get(f"{live.url}/v1/models").json()
        finally:
            live.stop()
        if legacy and model == "bge-small":
            relabel_as_legacy(home)
        assert hits[0]["start_line"] == 6
        assert {"bge-small", "bge-small-code"} <= {m["id"] for m in status["data"]}
    first, switched, again = runs
    assert switched.files_changed == first.files_changed == 1
    assert switched.chunks_embedded == first.chunks_embedded == first.chunks_total
    assert again.files_changed == 0
