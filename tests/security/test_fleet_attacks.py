"""Attacks on /v1/sandboxes, over real HTTP on loopback against real sandboxes: another
tenant's sandbox, repos outside the workspace roots, option injection through the ref, file
paths and symlinks leading out of the sandbox, a sandbox reading its neighbour, and repos
fetched by URL (policy, transports, config redirection, size and time limits, prompts,
redirects) against a loopback `git daemon` and HTTP server."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from conftest import LiveServer, free_port
from test_fleet import GitDaemon, create, fleet_server_at, git_repo
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


# ---------------------------------------------------------------- repos fetched by URL

@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    """A loopback `git daemon` serving `allowed/app`, `other/secret` and `allowed/big` (a
    megabyte of incompressible data), and a server whose policy allows `allowed/` only."""
    tmp = tmp_path_factory.mktemp("fleet-urls")
    served = tmp / "served"
    git_repo(served / "allowed" / "app", {"a.txt": "fetched\n"})
    git_repo(served / "other" / "secret", {"s.txt": "not allowed\n"})
    git_repo(served / "allowed" / "big", {"blob.bin": os.urandom(1 << 20).hex()})
    daemon = GitDaemon(served)
    live = fleet_server_at(tmp, "pool_size = 1\nfetch_bytes = 262144\nfetch_timeout = 20",
                           repo_urls=[f"{daemon.url}/allowed/"], auth="on")
    live.daemon = daemon
    yield live
    live.stop()
    live.daemon.stop()  # the one running now: a test restarts it


def test_a_url_inside_the_policy_is_fetched_once_and_cached(remote):
    url = f"{remote.daemon.url}/allowed/app"
    first = make(remote, repo=url)
    assert first.status_code == 201, first.text
    box = first.json()
    assert box["repo"] == url
    got = httpx.get(f"{remote.url}/v1/sandboxes/{box['id']}/files", params={"path": "a.txt"},
                    headers=caller(remote))
    assert got.content == b"fetched\n"
    fleet = remote.app.state.services.fleet
    bases = sorted(fleet.bases.iterdir())
    remote.daemon.stop()  # the second sandbox comes from the cache: no fetch, no server
    try:
        again = make(remote, repo=url)
        assert again.status_code == 201, again.text
        assert again.json()["commit"] == box["commit"] and sorted(fleet.bases.iterdir()) == bases
        fleet.settings.fetch_ttl = 0  # due for a refetch, the server down: the cache serves
        assert make(remote, repo=url).status_code == 201
    finally:
        fleet.settings.fetch_ttl = 60.0
        remote.daemon = GitDaemon(remote.tmp / "served", port=remote.daemon.port)


def test_urls_are_refused_by_default(server):
    """No `serve.repo_urls`: no URL is fetched, whatever it names."""
    got = make(server, repo="git://127.0.0.1:9/allowed/app")
    assert got.status_code == 403 and got.json()["error"]["code"] == "repo_url_not_allowed"


@pytest.mark.parametrize("template,status", [
    ("{url}/other/secret", 403),  # outside the allowed prefix
    ("{url}/allowedX/app", 403),  # a prefix is matched at a path boundary
    ("{url}/allowed/../other/secret", 400),  # no dot segments
    ("{url}/allowed/%2e%2e/other/secret", 400),  # nor encoded ones
    ("git://127.0.0.1:1/allowed/app", 403),  # another port
    ("git://localhost:{port}/allowed/app", 403),  # another host name
    ("git://user:pw@127.0.0.1:{port}/allowed/app", 400),  # no credentials in URLs
    ("file://{tmp}/served/allowed/app", 400),
    ("file:///etc", 400),
    ("ext::sh -c touch% /tmp/pwned-fleet-ext", 400),
    ("ssh://-oProxyCommand=touch%20/tmp/pwned-fleet-ssh/x", 400),
    ("fd::17", 400),
    ("{url}/allowed/app\n", 400),
    ("{url}/allowed/app?x=1", 400),
])
def test_urls_outside_the_policy_or_with_tricks_are_refused(remote, template, status):
    url = template.format(url=remote.daemon.url, port=remote.daemon.port, tmp=remote.tmp)
    got = make(remote, repo=url)
    assert got.status_code == status, got.text
    assert not Path("/tmp/pwned-fleet-ext").exists()
    assert not Path("/tmp/pwned-fleet-ssh").exists()


def test_the_servers_git_config_cannot_redirect_a_fetch(remote, tmp_path, monkeypatch):
    """`url.<base>.insteadOf` in the server's global git config would turn an allowed URL into
    a `file://` read of the host: the fetch reads no user or system config."""
    evil = tmp_path / "gitconfig"
    evil.write_text(f'[url "file://{remote.tmp}/served/other/"]\n'
                    f"\tinsteadOf = {remote.daemon.url}/allowed/\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(evil))
    box = make(remote, repo=f"{remote.daemon.url}/allowed/secret")  # exists only at the
    assert box.status_code == 502, box.text                         # redirected place
    assert box.json()["error"]["code"] == "repo_fetch_failed"


def test_a_fetch_past_the_size_limit_is_refused_and_leaves_nothing(remote):
    fleet = remote.app.state.services.fleet
    got = make(remote, repo=f"{remote.daemon.url}/allowed/big")
    assert got.status_code == 413, got.text
    assert got.json()["error"]["code"] == "repo_too_large"
    assert [p.name for p in fleet.remotes.iterdir() if "big" in p.name or
            p.name.startswith(".tmp")] == []
    assert len(list(fleet.remotes.iterdir())) <= 1  # the `app` mirror alone


def test_a_server_that_never_answers_times_out(remote, loopback_listener, monkeypatch):
    """A git server that accepts and says nothing: the fetch is killed at its time limit
    (no credential prompt or hang either: nothing waits on a terminal)."""
    fleet = remote.app.state.services.fleet
    silent = f"git://127.0.0.1:{loopback_listener.port}"
    monkeypatch.setattr(fleet, "repo_urls", [*fleet.repo_urls, f"{silent}/"])
    monkeypatch.setattr(fleet.settings, "fetch_timeout", 2.0)
    got = make(remote, repo=f"{silent}/repo")
    assert got.status_code == 504, got.text
    assert got.json()["error"]["code"] == "repo_fetch_timeout"


def test_http_credential_prompts_and_redirects_are_refused(remote, monkeypatch):
    """An HTTP git server that asks for a password, or redirects elsewhere: refused (502), at
    once, without waiting on a prompt and without following the redirect."""
    from fastapi import FastAPI
    from fastapi.responses import RedirectResponse, Response

    app, hits = FastAPI(), []

    @app.get("/{path:path}")
    def answer(path: str):
        hits.append(path)
        if path.startswith("auth/"):
            return Response(status_code=401, headers={"www-authenticate": 'Basic realm="x"'})
        return RedirectResponse(f"{remote.daemon.url}/other/secret", 302)

    http = LiveServer(app, free_port())
    http.start()
    fleet = remote.app.state.services.fleet
    monkeypatch.setattr(fleet, "repo_urls", [*fleet.repo_urls, f"{http.url}/"])
    try:
        for path in ("auth/repo", "moved/repo"):
            got = make(remote, repo=f"{http.url}/{path}")
            assert got.status_code == 502, got.text
        assert all(not h.startswith("other") for h in hits)
    finally:
        http.stop()
