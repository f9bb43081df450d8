"""The server database on both engines it supports: embedded SQLite and a real PostgreSQL
(started by the tests on a loopback port). Two `Database` objects on one database stand for
two replicas: each has its own connection pool and its own lease, exactly as two processes.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import make_settings
from pgserver import pg_server, pg_url  # noqa: F401  (fixtures)
from sqlalchemy import inspect, select, update

from codeplane.agent.records import RunRecords, RunTaken
from codeplane.background.records import BackgroundRecords
from codeplane.gateway.admission import SharedBuckets
from codeplane.gateway.keys import KeyStore
from codeplane.storage import Database, DatabaseError, Replica
from codeplane.storage.tables import agent_events, metadata, rate_buckets, replicas


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'server.db'}"
    return request.getfixturevalue("pg_url")


@pytest.fixture
def pair(url):
    """Two replicas on one database, schema migrated."""
    dbs = [Database(url), Database(url)]
    dbs[0].upgrade()
    replicas_ = [Replica(db, lease_s=30) for db in dbs]
    yield list(zip(dbs, replicas_, strict=True))
    for db in dbs:
        db.close()


def expire(db: Database, replica: Replica) -> None:
    """What a SIGKILLed replica leaves once its lease has run out: a stale heartbeat."""
    with db.write() as conn:
        conn.execute(update(replicas).where(replicas.c.id == replica.id).values(heartbeat=0.0))


def test_migrations_build_the_schema_the_code_uses_and_run_once_when_raced(url):
    dbs = [Database(url) for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:  # replicas starting together
        assert set(pool.map(lambda db: db.upgrade(), dbs)) == {"0006"}
    with dbs[0].engine.connect() as conn:
        found = inspect(conn)
        for table in metadata.sorted_tables:
            columns = {c["name"] for c in found.get_columns(table.name)}
            assert columns == {c.name for c in table.columns}, table.name
    for db in dbs:
        db.close()


def test_bad_database_urls_are_clear_errors(tmp_path):
    with pytest.raises(DatabaseError, match="unsupported URL"):
        Database("mysql://root@localhost/x")
    db = Database("postgresql://u:hunter2@127.0.0.1:1/x")
    with pytest.raises(DatabaseError, match="127.0.0.1") as caught:
        db.upgrade()
    assert "hunter2" not in str(caught.value)


def test_a_key_made_on_one_replica_works_on_the_other_and_its_revocation_too(pair):
    (db_a, rep_a), (db_b, rep_b) = pair
    a, b = KeyStore(db_a, rep_a), KeyStore(db_b, rep_b)
    assert not b.has_active()  # b's snapshot is now fresh and empty
    key, secret = a.create("ci", tenant="acme")
    assert b.lookup(secret).id == key.id  # a snapshot miss asks the database
    assert b.by_id(key.id).tenant == "acme"
    with pytest.raises(ValueError, match="active key named"):
        b.create("ci")
    a.revoke("ci")
    assert KeyStore(db_b, rep_b).lookup(secret) is None


def test_a_budget_holds_across_replicas_under_concurrent_calls(pair):
    """20 calls of 10 tokens at once, split over two replicas, against a 55-token budget:
    exactly 5 reserve. (With per-process holds, each replica would have admitted 5.)"""
    (db_a, rep_a), (db_b, rep_b) = pair
    a, b = KeyStore(db_a, rep_a), KeyStore(db_b, rep_b)
    key, _ = a.create("intern", budget_tokens=55)
    start = threading.Barrier(20)

    def call(store: KeyStore) -> bool:
        start.wait()
        return store.reserve(key, 10)

    with ThreadPoolExecutor(20) as pool:
        won = list(pool.map(call, [a, b] * 10))
    assert won.count(True) == 5
    assert a.held(key) == 50
    for store, ok in zip([a, b] * 10, won, strict=True):
        if ok:
            store.settle(key, 10, 3)
    assert (a.used(key), b.held(key)) == (15, 0)
    assert b.reserve(key, 40) and not a.reserve(key, 1)  # 15 used + 40 held = 55


def test_tokens_per_minute_hold_across_replicas_under_concurrent_calls(pair):
    """One bucket for both replicas: 20 calls of 10 tokens at one instant against 55 tokens
    per minute take 5; what refills and what is given back is shared too. (The clock is
    passed in, so the test does not depend on how fast it runs.)"""
    (db_a, rep_a), (db_b, rep_b) = pair
    a, b = KeyStore(db_a, rep_a), KeyStore(db_b, rep_b)
    key, _ = a.create("ci", tpm=60)  # 1 token a second
    start, now = threading.Barrier(20), 1000.0

    def call(store: KeyStore) -> float:
        start.wait()
        return store.take_rate(key, 10, now)

    with ThreadPoolExecutor(20) as pool:
        waits = list(pool.map(call, [a, b] * 10))
    assert waits.count(0.0) == 6 and set(waits) == {0.0, 10.0}  # 60 - 6 * 10 = 0 left
    assert b.take_rate(key, 5, now + 4) == 1.0  # 4 tokens refilled, 5 needed: 1 s more
    b.adjust_rate(key, -20, now + 4)  # two calls used nothing: their share comes back
    assert a.take_rate(key, 24, now + 4) == 0.0 and a.take_rate(key, 1, now + 4) == 1.0


def test_request_rate_buckets_hold_across_replicas_under_concurrent_calls(pair):
    """A key's requests per minute and a client address's limits are one bucket for every
    replica: 20 requests at one instant against 10 per minute, split over two replicas,
    take 10; addresses do not share; idle buckets are dropped (full again by then)."""
    (db_a, _), (db_b, _) = pair
    a, b = (SharedBuckets(db, rate_buckets, rate_buckets.c.name) for db in (db_a, db_b))
    start, now = threading.Barrier(20), 1000.0

    def call(buckets: SharedBuckets) -> float:
        start.wait()
        return buckets.take("rpm:key1", 10, 1, now)

    with ThreadPoolExecutor(20) as pool:
        waits = list(pool.map(call, [a, b] * 10))
    assert waits.count(0.0) == 10 and set(waits) == {0.0, 6.0}  # 1 a minute: 6 s each
    assert b.take("ip_rpm:10.0.0.2", 10, 1, now) == 0.0  # another address, its own bucket
    assert a.take("rpm:key1", 10, 1, now + 6) == 0.0  # refilled one request
    a.spend("ip_tpm:10.0.0.2", 100, 0)
    assert a.prune() == 2 and a.take("rpm:key1", 10, 10) == 0.0  # now - 1000 s: idle


def test_a_dead_replicas_holds_are_given_back_once(pair):
    (db_a, rep_a), (db_b, rep_b) = pair
    a, b = KeyStore(db_a, rep_a), KeyStore(db_b, rep_b)
    key, _ = a.create("intern", budget_tokens=100)
    assert a.reserve(key, 60) and a.reserve(key, 30)
    assert not b.reserve(key, 20)
    expire(db_a, rep_a)
    assert b.release_dead() == 2 and b.release_dead() == 0
    assert b.held(key) == 0 and b.reserve(key, 100)


def test_a_keys_json_is_imported_once_with_its_usage(tmp_path, url):
    settings = make_settings(tmp_path / "home", storage={"database": url})
    settings.server_dir.mkdir(parents=True)
    legacy = {"keys": [{"id": "ab12cd34", "name": "old", "hash": "1" * 64, "hint": "cp-abcd",
                        "created": 1.0, "priority": "agent", "revoked": False,
                        "budget_tokens": 500}]}
    (settings.server_dir / "keys.json").write_text(json.dumps(legacy))
    (settings.server_dir / "key_usage.json").write_text(json.dumps({"ab12cd34": 120}))
    store = KeyStore.from_settings(settings)
    (key,) = store.all()
    assert (key.name, key.tenant, store.used(key)) == ("old", "old", 120)
    assert not (settings.server_dir / "keys.json").exists()
    assert (settings.server_dir / "keys.json.imported").exists()
    (settings.server_dir / "keys.json").write_text(json.dumps(legacy))  # restored by hand
    assert store.import_json(settings.server_dir) == 0  # never twice
    store.db.close()


def test_runs_of_a_dead_replica_end_interrupted_not_running(pair):
    (db_a, rep_a), (db_b, rep_b) = pair
    a, b = BackgroundRecords(db_a, rep_a), BackgroundRecords(db_b, rep_b)
    a.create({"id": "r1", "tenant": "t", "repo": "/r", "ref": "HEAD", "task": "x",
              "model": "m"})
    a.append("r1", {"type": "run_start"})
    assert b.interrupt_unfinished() == []  # a is alive: its run is its own
    expire(db_a, rep_a)
    assert b.interrupt_unfinished() == ["r1"] and b.interrupt_unfinished() == []
    assert b.get("t", "r1")["status"] == "interrupted"
    assert [e["type"] for _, e in b.events("r1")] == ["run_start", "interrupted"]


def test_the_agent_run_cap_counts_every_live_replica(pair):
    (db_a, rep_a), (db_b, rep_b) = pair
    a, b = RunRecords(db_a, rep_a), RunRecords(db_b, rep_b)
    assert a.claim("t", "run-a", limit=1) is None
    assert b.claim("t", "run-b", limit=1) == 1  # over the cap, counted on a
    assert b.claim("u", "run-u", limit=1) is None  # another tenant's cap
    expire(db_a, rep_a)
    assert b.interrupt_orphans() == 1
    assert b.get("t", "run-a")["status"] == "interrupted"
    assert b.claim("t", "run-b", limit=1) is None


def test_agent_run_events_are_read_from_any_replica_by_their_tenant_only(pair):
    """Attack first: tenant u asking replica b for tenant t's run (its events, a resume
    point, a cancel) finds nothing, exactly as for an id that never existed."""
    (db_a, rep_a), (db_b, rep_b) = pair
    a, b = RunRecords(db_a, rep_a), RunRecords(db_b, rep_b)
    assert a.claim("t", "run-1", limit=5) is None
    for seq, kind in enumerate(["run_start", "model_turn", "tool_result"], start=1):
        a.append("run-1", seq, {"type": kind, "secret": "def handler(): ..."})
    assert b.tail("u", "run-1") is None and b.tail("u", "run-1", 2) is None
    assert not b.request_cancel("u", "run-1") and a.cancelled(["run-1"]) == []
    status, events = b.tail("t", "run-1", 1)
    assert status == "running" and [s for s, _ in events] == [2, 3]
    assert [e["type"] for _, e in events] == ["model_turn", "tool_result"]
    assert b.request_cancel("t", "run-1") and a.cancelled(["run-1", "x"]) == ["run-1"]
    a.finish("run-1", "cancelled", None)
    assert not b.request_cancel("t", "run-1")  # nothing left to cancel


def test_a_dead_replicas_agent_run_ends_with_one_interrupted_event(pair):
    (db_a, rep_a), (db_b, rep_b) = pair
    a, b = RunRecords(db_a, rep_a), RunRecords(db_b, rep_b)
    a.claim("t", "run-1", limit=5)
    a.append("run-1", 1, {"type": "run_start"})
    expire(db_a, rep_a)
    assert b.interrupt_orphans() == 1 and b.interrupt_orphans() == 0
    status, events = b.tail("t", "run-1")
    assert status == "interrupted" and [e["type"] for _, e in events] == ["run_start",
                                                                          "interrupted"]
    with pytest.raises(RunTaken):  # the owner was only frozen: its next event must not land
        a.append("run-1", 2, {"type": "model_turn"})
    a.finish("run-1", "completed", None)  # nor may it overwrite the verdict
    assert b.get("t", "run-1")["status"] == "interrupted"


def test_finished_agent_runs_past_the_keep_limit_are_forgotten_with_their_events(pair):
    (db_a, rep_a), _ = pair
    records = RunRecords(db_a, rep_a, keep_finished=2)
    for i in range(4):
        records.claim("t", f"run-{i}", limit=5)
        records.append(f"run-{i}", 1, {"type": "run_start"})
        records.finish(f"run-{i}", "completed", None)
    records.claim("u", "other", limit=5)  # another tenant's runs are not counted
    records.finish("other", "completed", None)
    records.claim("t", "run-4", limit=5)  # a new run makes room: two finished ones stay
    kept = [i for i in range(5) if records.tail("t", f"run-{i}") is not None]
    assert kept == [2, 3, 4] and records.tail("u", "other") is not None
    with db_a.read() as conn:
        stored = set(conn.execute(select(agent_events.c.run_id)).scalars())
    assert stored == {"run-2", "run-3"}


def test_a_named_lock_excludes_the_other_replica(pair):
    """The second replica's attempt is still blocked after the first has finished its
    critical section's first half: the order of the recorded steps proves exclusion.
    (An embedded SQLite database serves one process: its lock is a thread lock.)"""
    (db_a, _), (db_b, _) = pair
    if not db_a.shared:
        pytest.skip("one process per SQLite database")
    steps: list[str] = []
    inside = threading.Event()

    def second() -> None:
        inside.wait()
        with db_b.lock("search:w1"):
            steps.append("b")

    thread = threading.Thread(target=second)
    thread.start()
    with db_a.lock("search:w1"):
        inside.set()
        steps.append("a1")
        thread.join(0.5)  # b is blocked: it cannot append between a1 and a2
        steps.append("a2")
    thread.join()
    assert steps == ["a1", "a2", "b"]
