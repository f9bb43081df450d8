"""The fleet's sandbox records in the server database, on SQLite and PostgreSQL: two fleets on
one database stand for two replicas (each its own host directory, connection pool and lease).
Every replica lists a tenant's sandboxes wherever they live, only the holder works in one,
another tenant sees none of them, and a dead replica's sandboxes are shown as gone.
"""

from __future__ import annotations

import pytest
from pgserver import pg_server, pg_url  # noqa: F401  (fixtures)
from test_database import expire, pair, url  # noqa: F401  (fixtures)
from test_fleet import git_repo

from codeplane.config import FleetSettings
from codeplane.sandbox.fleet import Fleet, FleetError, replica_label
from codeplane.sandbox.records import SandboxRecords


@pytest.fixture
def fleets(pair, tmp_path):  # noqa: F811
    """Fleets on two hosts (directories) sharing one database; no warm pools."""
    made = [Fleet(tmp_path / name, FleetSettings(pool_size=0), records=SandboxRecords(db, rep))
            for name, (db, rep) in zip(("host-a", "host-b"), pair, strict=True)]
    yield made
    for fleet in made:
        fleet.close()


def _status(call) -> int:
    with pytest.raises(FleetError) as refused:
        call()
    return refused.value.status


def test_a_sandbox_is_listed_by_every_replica_for_its_tenant_only(fleets, pair, tmp_path):  # noqa: F811
    """Attack first: tenant u asks either replica for tenant t's sandbox and finds nothing;
    t finds it on both, and only its host works in it."""
    a, b = fleets
    repo = git_repo(tmp_path / "repo", {"a.txt": "hello\n"})
    box = a.acquire("t", repo)
    for fleet in (a, b):
        assert fleet.listed("u") == []
        assert _status(lambda f=fleet: f.get("u", box.id)) == 404
        assert _status(lambda f=fleet: f.describe("u", box.id)) == 404
        assert _status(lambda f=fleet: f.forget("u", box.id)) == 404
    (seen,) = b.listed("t")
    assert (seen["id"], seen["state"]) == (box.id, "active")
    assert seen["replica"] == replica_label(pair[0][1].id) and "-" not in seen["replica"][2:]
    assert seen["commit"] == box.commit and "workspace" not in seen  # a's disk, not b's
    assert b.describe("t", box.id) == seen
    assert a.describe("t", box.id)["workspace"] == str(box.workspace)
    assert _status(lambda: b.get("t", box.id)) == 409  # exec, files, diff: on a only
    assert _status(lambda: b.forget("t", box.id)) == 409  # b cannot remove a's sandbox
    assert a.get("t", box.id) is box
    a.release(box.id)
    assert b.listed("t") == [] and _status(lambda: b.describe("t", box.id)) == 404


def test_a_dead_replicas_sandboxes_are_marked_gone_once(fleets, pair, tmp_path):  # noqa: F811
    a, b = fleets
    db_a, rep_a = pair[0]
    repo = git_repo(tmp_path / "repo", {"a.txt": "hello\n"})
    box = a.acquire("t", repo)
    assert b.shared.mark_gone() == 0  # a is alive
    expire(db_a, rep_a)
    assert b.shared.mark_gone() == 1 and b.shared.mark_gone() == 0
    (seen,) = b.listed("t")
    assert seen["state"] == "gone" and seen["replica"] == replica_label(rep_a.id)
    assert _status(lambda: b.get("t", box.id)) == 410
    b.forget("t", box.id)  # the tenant clears the record from any replica
    assert b.listed("t") == []
