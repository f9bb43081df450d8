"""Workspace roots per tenant (audit 2026-11-28, M1: every tenant could make a sandbox, an agent
run or a background run of any repository under the one shared list of roots)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from test_fleet import git_repo
from upstreams.scripted import caller, run_server


@pytest.fixture
def roots(tmp_path: Path) -> dict[str, Path]:
    made = {}
    for who in ("alice", "bob", "shared"):
        made[who] = tmp_path / who
        git_repo(made[who] / "repo", {"a.txt": f"{who}\n"})
    return made


@pytest.fixture
def server(scripted, roots, tmp_path):
    live = run_server(tmp_path / "home", scripted.url, workspace_roots=[str(roots["shared"])],
                      tenant_roots={"alice": [str(roots["alice"])],
                                    "bob": [str(roots["bob"])]})
    yield live
    live.stop()


def _attempts(server, tenant: str, repo: Path) -> dict[str, httpx.Response]:
    h = caller(server, tenant)
    return {
        "sandbox": httpx.post(f"{server.url}/v1/sandboxes", headers=h,
                              json={"repo": str(repo)}, timeout=60),
        "agent run": httpx.post(f"{server.url}/v1/agent/runs", headers=h, timeout=60, json={
            "task": "t", "path": str(repo), "model": "scripted", "stream": False,
            "max_steps": 1}),
        "background run": httpx.post(f"{server.url}/v1/background-agents", headers=h,
                                     timeout=60, json={"task": "t", "repo": str(repo),
                                                       "model": "scripted", "max_steps": 1}),
    }


def test_a_tenant_reaches_only_its_own_roots(scripted, server, roots):
    for what, got in _attempts(server, "bob", roots["alice"] / "repo").items():
        assert got.status_code == 403, (what, got.text)
        assert got.json()["error"]["code"] == "outside_workspace_roots", (what, got.text)
        message = got.json()["error"]["message"]  # the roots it names are bob's own
        assert message.endswith(f"outside the workspace roots ({roots['bob']})"), message
    for what, got in _attempts(server, "alice", roots["alice"] / "repo").items():
        assert got.status_code in (200, 201, 202), (what, got.text)


def test_once_tenants_have_roots_the_shared_list_is_the_keyless_tenants(server, roots):
    """A tenant the operator did not name gets no roots (not the shared list): adding a key
    for a new tenant never opens every repository to it."""
    for what, got in _attempts(server, "carol", roots["shared"] / "repo").items():
        assert got.status_code == 403, (what, got.text)
        assert got.json()["error"]["code"] == "no_workspace_roots", (what, got.text)
    for what, got in _attempts(server, "alice", roots["shared"] / "repo").items():
        assert got.status_code == 403, (what, got.text)


def test_without_tenant_roots_every_tenant_shares_the_list_as_before(scripted, roots,
                                                                     tmp_path):
    live = run_server(tmp_path / "home2", scripted.url, workspace_roots=[str(roots["shared"])])
    try:
        for tenant in ("alice", "bob"):
            got = httpx.post(f"{live.url}/v1/sandboxes", headers=caller(live, tenant),
                             json={"repo": str(roots["shared"] / "repo")}, timeout=60)
            assert got.status_code == 201, got.text
    finally:
        live.stop()
