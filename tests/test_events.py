"""Object store and event lake against the real parts: a local directory and a real S3 server
(SeaweedFS on loopback, requests signed with a real key), Parquet files and DuckDB."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import lancedb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyarrow import fs as pafs
from typer.testing import CliRunner

from codeplane.cli import app
from codeplane.config import load_settings
from codeplane.events import query as lake
from codeplane.events.adapters import agent_listener
from codeplane.events.log import EventLog
from codeplane.events.schema import EventError
from codeplane.storage import ObjectNotFound, ObjectStore, StorageError

if TYPE_CHECKING:
    from s3server import S3Server

pytest_plugins = ["s3server"]  # the s3_server fixture: a real SeaweedFS on loopback

DAY1 = datetime(2026, 11, 20, 23, 59, 59, tzinfo=UTC)
DAY2 = datetime(2026, 11, 21, 0, 0, 1, tzinfo=UTC)


@pytest.fixture(params=["local", "s3"])
def store_url(request, tmp_path: Path, monkeypatch) -> str:
    """A fresh store URL; for S3 a new prefix in the test bucket, credentials in AWS_*."""
    if request.param == "local":
        return str(tmp_path / "objects")
    server: S3Server = request.getfixturevalue("s3_server")
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    return f"s3://{server.bucket}/t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def store(store_url: str) -> ObjectStore:
    return ObjectStore.open(store_url)


def _emit_sample(events: EventLog) -> None:
    for i, latency in enumerate([10.0, 20.0, 30.0, 40.0]):
        events.emit("tab_shown", "acme", {"suggestion_id": f"s{i}", "model": "code-small",
                                          "latency_ms": latency, "chars": 12 + i,
                                          "confidence": 0.5, "source": "model",
                                          "language": "python"}, at=DAY1)
    events.emit("tab_accepted", "acme", {"suggestion_id": "s1", "after_ms": 900.0}, at=DAY1)
    events.emit("tab_rejected", "acme", {"suggestion_id": "s2", "after_ms": 400.0}, at=DAY1)
    events.emit("gateway_usage", "acme", {"model": "gpt-x", "prompt_tokens": 100,
                                          "completion_tokens": 5, "latency_ms": 50.0}, at=DAY1)
    events.emit("gateway_usage", "beta/team", {"model": "gpt-x", "prompt_tokens": 1,
                                               "completion_tokens": 2, "latency_ms": 70.0},
                at=DAY2)
    events.emit("gateway_usage", "beta/team", {"model": "code-small", "prompt_tokens": 7,
                                               "completion_tokens": 3, "status": 200}, at=DAY2)


def test_object_store_put_get_list_delete(store: ObjectStore) -> None:
    store.put("a/b/one.bin", b"1")
    store.put("a/two.bin", b"22")
    store.put("a/two.bin", b"333")  # overwrite: last complete write wins
    assert store.get("a/two.bin") == b"333"
    assert [(o.key, o.size) for o in store.list("a")] == [("a/b/one.bin", 1), ("a/two.bin", 3)]
    store.delete("a/b/one.bin")
    store.delete("a/b/one.bin")  # idempotent
    assert [o.key for o in store.list()] == ["a/two.bin"]
    with pytest.raises(ObjectNotFound):
        store.get("a/b/one.bin")


def test_lancedb_tables_live_under_the_store(store: ObjectStore) -> None:
    vectors = pa.array([[0.0, 1.0], [1.0, 0.0]], type=pa.list_(pa.float32(), 2))
    db = lancedb.connect(store.uri("lance"), storage_options=store.storage_options)
    db.create_table("chunks", pa.table({"id": [1, 2], "vector": vectors}))
    again = lancedb.connect(store.uri("lance"), storage_options=store.storage_options)
    table = again.open_table("chunks")
    assert table.search([1.0, 0.0]).limit(1).to_list()[0]["id"] == 2
    assert any(o.key.startswith("lance/chunks.lance/") for o in store.list("lance"))


@pytest.mark.parametrize("key", ["../escape", "/abs", "a//b", "a/./b", ".staging/x", "a\\b", ""])
def test_object_keys_cannot_escape_the_root(tmp_path: Path, key: str) -> None:
    store = ObjectStore.open(str(tmp_path / "objects"))
    with pytest.raises(StorageError, match="invalid object key"):
        store.put(key, b"x")
    assert not (tmp_path / "escape").exists() and store.list() == []


def test_round_trip_emit_flush_query(store: ObjectStore) -> None:
    events = EventLog(store)
    _emit_sample(events)
    assert lake.query(store, "SELECT count(*) FROM tab_shown")[1] == [(0,)]  # still buffered
    assert len(events.flush()) == 5  # kinds x days x tenants
    events.close()
    columns, rows = lake.query(store, "SELECT suggestion_id, latency_ms, chars, language, "
                                      "tenant, day FROM tab_shown ORDER BY suggestion_id")
    assert columns == ["suggestion_id", "latency_ms", "chars", "language", "tenant", "day"]
    assert rows[1] == ("s1", 20.0, 13, "python", "acme", "2026-11-20")
    assert len(rows) == 4
    stats = lake.stats(store)
    assert stats["tab"] == {"shown": 4, "accepted": 1, "rejected": 1, "accept_rate": 0.25,
                            "latency_p50_ms": 25.0, "latency_p95_ms": pytest.approx(38.5)}
    assert stats["usage"] == [
        {"model": "gpt-x", "requests": 2, "prompt_tokens": 101, "completion_tokens": 7,
         "latency_p50_ms": 60.0},
        {"model": "code-small", "requests": 1, "prompt_tokens": 7, "completion_tokens": 3,
         "latency_p50_ms": None}]
    assert lake.stats(store, tenant="beta/team")["usage"][0]["requests"] == 1


def test_partitions_by_kind_day_and_tenant(store: ObjectStore) -> None:
    events = EventLog(store)
    _emit_sample(events)
    events.close()
    dirs = sorted(o.key.rsplit("/", 1)[0] for o in store.list("events"))
    assert dirs == [
        "events/v1/kind=gateway_usage/day=2026-11-20/tenant=acme",
        "events/v1/kind=gateway_usage/day=2026-11-21/tenant=beta%2Fteam",
        "events/v1/kind=tab_accepted/day=2026-11-20/tenant=acme",
        "events/v1/kind=tab_rejected/day=2026-11-20/tenant=acme",
        "events/v1/kind=tab_shown/day=2026-11-20/tenant=acme"]
    # the tenant's "/" cannot add a path level, and reads back decoded
    assert lake.query(store, "SELECT DISTINCT tenant, day FROM gateway_usage "
                             "WHERE day = '2026-11-21'")[1] == [("beta/team", "2026-11-21")]


def test_the_day_is_the_utc_day(tmp_path: Path) -> None:
    store = ObjectStore.open(str(tmp_path / "objects"))
    events = EventLog(store)
    berlin_night = datetime(2026, 11, 21, 0, 30, tzinfo=timezone(timedelta(hours=1)))
    events.emit("tab_shown", "acme", {}, at=berlin_night)
    (key,) = events.flush()
    events.close()
    assert "/day=2026-11-20/" in key
    assert lake.query(store, "SELECT ts FROM tab_shown")[1] == [(datetime(2026, 11, 20, 23, 30),)]
    with pytest.raises(EventError, match="timezone-aware"):
        events.emit("tab_shown", "acme", {}, at=datetime(2026, 11, 21))


def test_files_carry_the_schema_version(store: ObjectStore) -> None:
    events = EventLog(store)
    events.emit("agent_step", "acme", {"run_id": "r1", "step": 3, "tool": "read_file",
                                       "outcome": "ok", "latency_ms": 12.5}, at=DAY1)
    (key,) = events.flush()
    events.close()
    assert key.startswith("events/v1/kind=agent_step/") and key.endswith(".parquet")
    parquet = pq.ParquetFile(store.filesystem.open_input_file(key))
    assert parquet.schema_arrow.metadata[b"codeplane.events.schema_version"] == b"1"
    assert parquet.read().column("schema_version").to_pylist() == [1]
    assert lake.query(store, "SELECT * FROM agent_step")[1][0][:2] == (
        DAY1.replace(tzinfo=None), 1)  # every column converts, ts is UTC
    assert lake.query(store, "SELECT step, tool, schema_version FROM agent_step")[1] == [
        (3, "read_file", 1)]


@pytest.mark.parametrize(("kind", "fields", "message"), [
    ("tab_shown", {"prefix": "def f():"}, "not in the whitelist: prefix"),
    ("tab_shown", {"suggestion_id": "a\nreturn secret"}, "single-line"),
    ("tab_shown", {"model": "x" * 129}, "at most 128"),
    ("tab_shown", {"chars": "12"}, "expected a number"),
    ("tab_shown", {"chars": 1.5}, "expected an integer"),
    ("tab_shown", {"chars": True}, "expected a number"),
    ("tab_shown", {"latency_ms": float("nan")}, "finite"),
    ("apply_outcome", {"ok": 1}, "true/false"),
    ("apply_outcome", {"merged": "whole file"}, "not in the whitelist: merged"),
    ("tab.typed", {}, "unknown event kind"),
])
def test_fields_outside_the_whitelist_are_refused(tmp_path: Path, kind: str, fields: dict,
                                                   message: str) -> None:
    store = ObjectStore.open(str(tmp_path / "objects"))
    events = EventLog(store)
    with pytest.raises(EventError, match=message):
        events.emit(kind, "acme", fields)
    with pytest.raises(EventError, match="tenant"):
        events.emit("tab_shown", "", {})
    events.close()
    assert events.pending() == 0 and store.list() == []


_CRASH_WRITER = """
import sys, time
from codeplane.storage import ObjectStore
store = ObjectStore.open(sys.argv[1])
data = open(sys.argv[2], "rb").read()
with store.writer(sys.argv[3]) as out:
    out.write(data[: len(data) // 2])
    out.flush()
    print("half", flush=True)
    time.sleep(600)
"""


def test_a_writer_killed_mid_write_leaves_nothing_visible(store: ObjectStore, store_url: str,
                                                          tmp_path: Path) -> None:
    events = EventLog(store)
    _emit_sample(events)
    events.close()
    whole = tmp_path / "whole.parquet"
    big = next(o for o in store.list("events") if "tab_shown" in o.key)
    whole.write_bytes(store.get(big.key))
    key = "events/v1/kind=tab_shown/day=2026-11-22/tenant=acme/part-crashed.parquet"
    child = subprocess.Popen([sys.executable, "-c", _CRASH_WRITER, store_url, str(whole), key],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "half"
    child.kill()
    child.wait()
    assert key not in [o.key for o in store.list()]
    with pytest.raises(ObjectNotFound):
        store.get(key)
    assert lake.query(store, "SELECT count(*) FROM tab_shown")[1] == [(4,)]
    # On disk the torn staging file is really there until swept; on S3 the unfinished upload
    # was never an object at all.
    torn = 0 if store_url.startswith("s3://") else 1
    assert store.sweep_staging(older_than_s=0) == torn
    assert store.sweep_staging(older_than_s=0) == 0


def test_a_failed_write_block_stores_nothing(store: ObjectStore) -> None:
    with pytest.raises(RuntimeError), store.writer("a/x.bin") as out:
        out.write(b"partial")
        raise RuntimeError("serialisation failed")
    assert store.list() == [] and store.sweep_staging(older_than_s=0) == 0


def test_flush_failure_keeps_events_within_the_bound(s3_server: S3Server) -> None:
    refused = pafs.S3FileSystem(access_key=s3_server.access_key, secret_key="wrong",
                                region="us-east-1", scheme="http",
                                endpoint_override=s3_server.endpoint_url.split("//")[1])
    store = ObjectStore(refused, f"{s3_server.bucket}/refused", "s3://refused")
    events = EventLog(store, max_pending=4)
    for i in range(3):
        events.emit("tab_shown", "acme", {"chars": i})
    with pytest.raises(StorageError, match="ACCESS_DENIED|denied"):
        events.flush()
    assert events.pending() == 3 and events.dropped == 0
    for i in range(3):
        events.emit("tab_shown", "acme", {"chars": i})
    assert events.pending() == 4 and events.dropped == 2
    with pytest.raises(StorageError):
        events.close()


def _wait_for_files(store: ObjectStore) -> None:
    """Wait for the flusher thread's first file: a readiness poll, not a speed check."""
    deadline = time.monotonic() + 60
    while not store.list("events") and time.monotonic() < deadline:
        time.sleep(0.05)


def test_flushes_by_itself_once_the_batch_is_full(tmp_path: Path) -> None:
    store = ObjectStore.open(str(tmp_path / "objects"))
    events = EventLog(store, flush_events=3, flush_seconds=3600)
    for i in range(3):
        events.emit("tab_shown", "acme", {"chars": i})
    _wait_for_files(store)
    assert len(store.list("events")) == 1 and events.pending() == 0
    events.emit("tab_shown", "acme", {"chars": 9})
    events.close()  # the rest goes out at close
    assert lake.query(store, "SELECT sum(chars) FROM tab_shown")[1] == [(12,)]
    with pytest.raises(EventError, match="closed"):
        events.emit("tab_shown", "acme", {})


def test_flushes_by_itself_once_old_enough(tmp_path: Path) -> None:
    store = ObjectStore.open(str(tmp_path / "objects"))
    events = EventLog(store, flush_events=10**6, flush_seconds=0.05)
    events.emit("tab_shown", "acme", {"chars": 1})  # one event: only its age can flush it
    _wait_for_files(store)
    assert len(store.list("events")) == 1 and events.pending() == 0
    events.close()


def test_agent_listener_keeps_counters_and_drops_code(tmp_path: Path) -> None:
    store = ObjectStore.open(str(tmp_path / "objects"))
    events = EventLog(store)
    listen = agent_listener(events, "acme", "code-medium")
    secret = "def handler(request):\n    return API_TOKEN"
    # the shapes agent/loop.py publishes to Agent.listeners
    listen({"type": "run_start", "run_id": "r1", "t": 0.0, "task": secret})
    listen({"type": "model_turn", "run_id": "r1", "t": 1.0, "step": 1,
            "message": {"role": "assistant", "content": secret}, "finish_reason": "tool_calls",
            "usage": {"prompt_tokens": 900, "completion_tokens": 40}, "seconds": 1.25})
    listen({"type": "tool_result", "run_id": "r1", "t": 1.5, "step": 1, "index": 0,
            "call_id": "c1", "name": "read_file", "ok": True, "output": secret,
            "seconds": 0.002, "truncated": False, "data": {}})
    events.close()
    _, rows = lake.query(store, "SELECT step, tool, outcome, latency_ms, prompt_tokens, "
                                "completion_tokens, model FROM agent_step ORDER BY outcome")
    assert rows == [(1, None, "model_turn", 1250.0, 900, 40, "code-medium"),
                    (1, "read_file", "ok", 2.0, None, None, "code-medium")]
    _, every = lake.query(store, "SELECT * FROM agent_step")
    assert not [v for row in every for v in row if "API_TOKEN" in str(v)]


def test_concurrent_emitters_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    store = ObjectStore.open(str(tmp_path / "objects"))
    events = EventLog(store, flush_events=300)  # background flushes race with the emitters

    def emitter(n: int) -> None:
        for i in range(1500):
            events.emit("tab_shown", f"t{n % 2}", {"suggestion_id": f"{n}-{i}", "chars": 1})

    threads = [threading.Thread(target=emitter, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    events.close()
    assert lake.query(store, "SELECT count(*), count(DISTINCT suggestion_id) FROM tab_shown")[
        1] == [(6000, 6000)]
    assert events.dropped == 0


def test_storage_settings_select_the_store(tmp_path: Path, s3_server: S3Server,
                                           monkeypatch) -> None:
    home = tmp_path / "home"
    home.mkdir()
    default = ObjectStore.from_settings(load_settings(home=home))
    assert default.url == str(home / "server" / "objects")
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    (home / "codeplane.toml").write_text(
        f'[storage]\nobjects = "s3://{s3_server.bucket}/cfg"\n'
        f'endpoint_url = "{s3_server.endpoint_url}"\n')
    store = ObjectStore.from_settings(load_settings(home=home))
    store.put("k", b"v")
    assert store.get("k") == b"v" and store.url == f"s3://{s3_server.bucket}/cfg"
    (home / "codeplane.toml").write_text('[storage]\nobjects = "s3://no-such-bucket"\n'
                                         f'endpoint_url = "{s3_server.endpoint_url}"\n')
    with pytest.raises(StorageError, match="does not exist"):
        ObjectStore.from_settings(load_settings(home=home))


@pytest.mark.parametrize(("url", "endpoint", "message"), [
    ("gs://bucket/x", None, "unsupported URL"),
    ("s3:///prefix", None, "names no bucket"),
    ("s3://bucket", "ftp://127.0.0.1:21", "is not http"),
    ("s3://bucket", "http://127.0.0.1:1", "cannot reach"),
])
def test_bad_store_settings_are_named(url: str, endpoint: str | None, message: str) -> None:
    with pytest.raises(StorageError, match=message):
        ObjectStore.open(url, endpoint_url=endpoint)


def _cli(store_url: str, home: Path, *args: str):
    env = {"CODEPLANE_HOME": str(home), "CODEPLANE_STORAGE__OBJECTS": store_url}
    return CliRunner().invoke(app, ["events", *args], env=env)


def test_cli_query_and_stats(store: ObjectStore, store_url: str, tmp_path: Path) -> None:
    events = EventLog(store)
    _emit_sample(events)
    events.close()
    result = _cli(store_url, tmp_path, "query", "SELECT tenant, count(*) AS n FROM "
                  "gateway_usage GROUP BY tenant ORDER BY tenant", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == [{"tenant": "acme", "n": 1},
                                         {"tenant": "beta/team", "n": 2}]
    result = _cli(store_url, tmp_path, "stats", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tab"]["accept_rate"] == 0.25
    result = _cli(store_url, tmp_path, "stats")
    assert "accept rate 25.0%" in result.stdout and "gpt-x" in result.stdout


@pytest.mark.parametrize(("sql", "message"), [
    ("SELEC 1", "syntax error"),
    ("SELECT * FROM read_text('/etc/passwd')", "disabled by configuration"),
    ("COPY tab_shown TO '/tmp/leak.csv'", "disabled by configuration"),
])
def test_cli_query_refuses_bad_sql_and_file_access(tmp_path: Path, sql: str,
                                                    message: str) -> None:
    result = _cli(str(tmp_path / "objects"), tmp_path, "query", sql)
    assert result.exit_code == 2 and message in result.stderr
    assert "Traceback" not in result.output
