"""Attacks on /v1/sandboxes, over real HTTP on loopback against real sandboxes: another
tenant's sandbox, repos outside the workspace roots, option injection through the ref, file
paths and symlinks leading out of the sandbox, and a sandbox reading its neighbour."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from test_fleet import create, fleet_server_at, git_repo
from upstreams.scripted import caller


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fleet-attacks")
    (tmp / "outside").mkdir()
    (tmp / "outside" / "secret.txt").write_text("top secret\n")
    git_repo(tmp / "elsewhere", {"s.txt": "not yours\n"})
    live = fleet_server_at(tmp, "pool_size = 0", auth="on")
    yield live
    live.stop()


make = create  # POST /v1/sandboxes for the repo `app`

def test_no_key_no_sandbox(server):
    assert httpx.get(f"{server.url}/v1/sandboxes").status_code == 401


def test_other_tenant_sees_nothing(server):
    box = make(server, "owner").json()
    url = f"{server.url}/v1/sandboxes/{box['id']}"
    thief = caller(server, "thief")
    for method, path, kwargs in [("GET", "", {}), ("GET", "/diff", {}),
                                 ("GET", "/files", {"params": {"path": "a.txt"}}),
                                 ("PUT", "/files", {"params": {"path": "a.txt"},
                                                    "content": b"x"}),
                                 ("POST", "/exec", {"json": {"command": "true"}}),
                                 ("DELETE", "", {})]:
        got = httpx.request(method, url + path, headers=thief, timeout=60, **kwargs)
        assert got.status_code == 404, (method, path, got.text)
    assert box["id"] not in httpx.get(f"{server.url}/v1/sandboxes", headers=thief).text
    assert httpx.get(url, headers=caller(server, "owner")).status_code == 200  # still there


@pytest.mark.parametrize("repo,status", [("elsewhere", 403), ("outside", 403),
                                         ("relative/path", 400), ("/etc", 403)])
def test_repos_outside_the_roots_are_refused(server, repo, status):
    path = repo if repo.startswith(("/", "relative")) else str(server.tmp / repo)
    got = make(server, repo=path)
    assert got.status_code == status, got.text


def test_symlink_in_roots_to_outside_is_refused(server):
    link = server.root / "sneaky"
    link.symlink_to(server.tmp / "elsewhere")
    assert make(server, repo=str(link)).status_code == 403


@pytest.mark.parametrize("ref", ["--upload-pack=touch /tmp/pwned-fleet", "-h",
                                 "HEAD\u0000x", ""])
def test_ref_cannot_inject_options(server, ref):
    got = make(server, ref=ref)
    assert got.status_code == 400, got.text
    assert not Path("/tmp/pwned-fleet").exists()


@pytest.mark.parametrize("path", ["../../../../etc/passwd", "/etc/passwd", "ws/../../x",
                                  ".."])
def test_file_paths_stay_in_the_sandbox(server, path):
    box = make(server).json()
    url = f"{server.url}/v1/sandboxes/{box['id']}/files"
    h = caller(server)
    read = httpx.get(url, params={"path": path}, headers=h)
    assert read.status_code == 400 and b"root:" not in read.content, read.text
    wrote = httpx.put(url, params={"path": path}, content=b"pwned", headers=h)
    assert wrote.status_code == 400, wrote.text


def test_symlink_planted_by_a_command_is_not_followed(server):
    box = make(server).json()
    base = f"{server.url}/v1/sandboxes/{box['id']}"
    h = caller(server)
    secret = server.tmp / "outside" / "secret.txt"
    ran = httpx.post(f"{base}/exec", headers=h, timeout=60,
                     json={"command": f"ln -s {secret} leak.txt && ln -s {secret.parent} d"})
    assert ran.json()["exit_code"] == 0
    read = httpx.get(f"{base}/files", params={"path": "leak.txt"}, headers=h)
    assert read.status_code == 400 and b"top secret" not in read.content
    wrote = httpx.put(f"{base}/files", params={"path": "d/secret.txt"}, content=b"pwned",
                      headers=h)
    assert wrote.status_code == 400
    assert secret.read_text() == "top secret\n"


def test_a_sandbox_cannot_read_its_neighbour_or_the_host(server):
    mine, theirs = make(server, "a").json(), make(server, "b").json()
    httpx.put(f"{server.url}/v1/sandboxes/{theirs['id']}/files", params={"path": "p.txt"},
              content=b"PRIVATE-MARK", headers=caller(server, "b"))
    probe = (f"cat {theirs['workspace']}/p.txt; cat {server.tmp}/outside/secret.txt; "
             f"ls {Path(mine['workspace']).parent.parent}")
    out = httpx.post(f"{server.url}/v1/sandboxes/{mine['id']}/exec", headers=caller(server, "a"),
                     json={"command": probe}, timeout=60).json()["output"]
    assert "PRIVATE-MARK" not in out and "top secret" not in out
    assert out.count("No such file") == 2
    assert out.splitlines()[-1] == mine["id"]  # its own directory alone is mounted


def test_bad_input_is_4xx(server):
    h = caller(server)
    assert httpx.post(f"{server.url}/v1/sandboxes", headers=h, json={}).status_code == 400
    assert httpx.post(f"{server.url}/v1/sandboxes", headers=h,
                      json={"repo": "/x", "extra": 1}).status_code == 400
    box = make(server).json()
    exec_url = f"{server.url}/v1/sandboxes/{box['id']}/exec"
    assert httpx.post(exec_url, headers=h, json={"command": ""}).status_code == 400
    assert httpx.post(exec_url, headers=h, json={"command": "true",
                                                 "timeout": -1}).status_code == 400
    missing = httpx.get(f"{server.url}/v1/sandboxes/{box['id']}/files",
                        params={"path": "nope.txt"}, headers=h)
    assert missing.status_code == 404
