"""A sandbox's resources are bounded as a whole (#29 M5, M4, L2): one memory and pids budget
for every process of a sandbox and its /tmp (a cgroup per sandbox, not a limit per process or
per command), and commands through the API run off the server's request threads with a cap
per tenant, so one tenant's commands cannot starve another tenant's requests. Real
bubblewrap, real cgroups, real HTTP on loopback; concurrency is made by commands that wait
for a file the test creates, never by timing."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from test_fleet import create, fleet_server_at
from upstreams.scripted import caller, wait_for

from codeplane.sandbox import BwrapRunner, CommandResult, Limits

MiB = 1 << 20
# a command that says it started, then waits until the test creates `release`
HOLD = "mktemp started.XXXXXX >/dev/null; while [ ! -e release ]; do sleep 0.05; done"


def test_memory_limit_covers_every_process_of_a_sandbox(ws: Path) -> None:
    """The audit's six 50 MiB processes under a 64 MiB limit: per process they all fit."""
    hog = "python3 -c 'b = bytearray(50 << 20); import time; time.sleep(2); print(\"held\")'"
    res = BwrapRunner(ws).run(f"for i in 1 2 3 4 5 6; do {hog} & done; wait", ws,
                              Limits(memory_bytes=64 * MiB, timeout=60))
    assert res.output.count("held") < 6, res.output


def test_tmp_is_bounded_by_the_memory_limit(ws: Path) -> None:
    """/tmp is memory: 100 MB do not fit in a 64 MiB sandbox (the write fails, or the kernel
    kills the writer at the memory limit), however large `tmp_bytes` is."""
    res = BwrapRunner(ws).run("head -c 100000000 /dev/zero > /tmp/x && echo WROTE-100MB", ws,
                              Limits(memory_bytes=64 * MiB, tmp_bytes=1 << 30))
    assert "WROTE-100MB" not in res.output, res.output


def _concurrently(box: BwrapRunner, ws: Path, command: str, limits: Limits,
                  count: int = 2) -> list[CommandResult]:
    """`count` commands of one sandbox at once; each runs `command`, then holds (reading a
    FIFO: no process to fork, for a sandbox out of pids) until all have got that far or
    died, so what they hold overlaps."""
    os.mkfifo(ws / "hold")
    release = os.open(ws / "hold", os.O_RDWR)  # keeps the FIFO open: no reader sees EOF
    results: list[CommandResult] = []
    threads = [threading.Thread(target=lambda i=i: results.append(box.run(
        f"{command}; : > started.{i}; read line < hold", ws, limits)))
        for i in range(count)]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: len(list(ws.glob("started.*"))) + len(results) >= count, 120,
                 "for the commands to get going")
    finally:
        os.write(release, b"\n" * count)  # one line for each reader
        for thread in threads:
            thread.join()
        os.close(release)
    return results


def test_concurrent_commands_share_the_sandbox_memory_and_tmp(ws: Path) -> None:
    """Two commands each writing 40 MiB to their /tmp (a tmpfs: memory) under a 64 MiB limit
    for the sandbox: they cannot both hold it (one write fails, or the kernel kills one)."""
    results = _concurrently(BwrapRunner(ws), ws,
                            "head -c 41943040 /dev/zero > /tmp/x && echo WROTE-40MiB",
                            Limits(memory_bytes=64 * MiB, timeout=120))
    held = [r for r in results if r.exit_code == 0 and "WROTE-40MiB" in r.output]
    assert len(held) < 2, results


def test_concurrent_commands_share_the_sandbox_pids(ws: Path) -> None:
    forty = " ".join(map(str, range(40)))
    start = f"n=0; for i in {forty}; do sleep 600 & n=$((n+1)); done 2>/dev/null; echo started=$n"
    results = _concurrently(BwrapRunner(ws), ws, start, Limits(processes=64, timeout=120))
    started = sum(int(r.output.split("started=")[1].split()[0]) for r in results
                  if "started=" in r.output)
    assert started < 80, results


# ---------------------------------------------------------------- through the API

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    live = fleet_server_at(tmp_path_factory.mktemp("sandbox-limits"),
                           "pool_size = 0\nmemory_bytes = 67108864", auth="on")
    yield live
    live.stop()


def test_one_tenant_cannot_starve_another(server) -> None:
    """Tenant A sends 45 commands that hold (the audit's 45 sleeps): past its cap they are
    refused with 429, and tenant B's listing answers meanwhile."""
    box = create(server, "tenant-a").json()
    ws = Path(box["workspace"])
    url = f"{server.url}/v1/sandboxes/{box['id']}/exec"
    a, b = caller(server, "tenant-a"), caller(server, "tenant-b")
    pool = ThreadPoolExecutor(45)
    replies = [pool.submit(httpx.post, url, json={"command": HOLD, "timeout": 300},
                           headers=a, timeout=600) for _ in range(45)]

    def refused() -> list[httpx.Response]:  # before the release only refusals come back
        return [r.result() for r in replies if r.done()]

    try:
        wait_for(lambda: len(list(ws.glob("started.*"))) + len(refused()) == 45, 90,
                 "for every command to be running or refused")
        codes = [r.status_code for r in refused()]
        assert codes and set(codes) == {429}, codes
        assert refused()[0].json()["error"]["code"] == "exec_quota_exceeded"
        listing = httpx.get(f"{server.url}/v1/sandboxes", headers=b, timeout=30)
        assert listing.status_code == 200
    finally:
        (ws / "release").touch()
        pool.shutdown()
    done = [r.result() for r in replies if r.result().status_code == 200]
    assert done and all(r.json()["exit_code"] == 0 for r in done)
    again = httpx.post(url, json={"command": "true"}, headers=a, timeout=60)
    assert again.status_code == 200  # the cap is free again


def test_a_diff_counts_against_the_tenants_command_cap(server) -> None:
    """A diff runs git in the sandbox, a command like any other: with the tenant's cap full
    it is refused (429), not queued on the server's request threads; another tenant's diff
    answers meanwhile, and the tenant's own once its commands end."""
    box, other = create(server, "tenant-d").json(), create(server, "tenant-e").json()
    ws = Path(box["workspace"])
    a, b = caller(server, "tenant-d"), caller(server, "tenant-e")
    pool = ThreadPoolExecutor(4)
    holds = [pool.submit(httpx.post, f"{server.url}/v1/sandboxes/{box['id']}/exec",
                         json={"command": HOLD, "timeout": 300}, headers=a, timeout=600)
             for _ in range(4)]  # max_execs_per_tenant
    try:
        wait_for(lambda: len(list(ws.glob("started.*"))) == 4, 90, "for the commands to run")
        full = httpx.get(f"{server.url}/v1/sandboxes/{box['id']}/diff", headers=a, timeout=60)
        assert full.status_code == 429, full.text
        assert full.json()["error"]["code"] == "exec_quota_exceeded"
        theirs = httpx.get(f"{server.url}/v1/sandboxes/{other['id']}/diff", headers=b,
                           timeout=60)
        assert theirs.status_code == 200, theirs.text
    finally:
        (ws / "release").touch()
        pool.shutdown()
    assert all(h.result().status_code == 200 for h in holds)
    mine = httpx.get(f"{server.url}/v1/sandboxes/{box['id']}/diff", headers=a, timeout=60)
    assert mine.status_code == 200 and "started." in mine.json()["diff"], mine.text


def test_memory_limit_through_the_api(server) -> None:
    box = create(server, "tenant-m").json()
    hog = "python3 -c 'b = bytearray(50 << 20); import time; time.sleep(2); print(\"held\")'"
    got = httpx.post(f"{server.url}/v1/sandboxes/{box['id']}/exec",
                     json={"command": f"for i in 1 2 3 4 5 6; do {hog} & done; wait"},
                     headers=caller(server, "tenant-m"), timeout=120)
    assert got.status_code == 200 and got.json()["output"].count("held") < 6, got.text


@pytest.mark.parametrize("command", ["echo a\u0000b", "\u0000"])
def test_nul_in_a_command_is_a_400(server, command: str) -> None:
    box = create(server, "tenant-n").json()
    got = httpx.post(f"{server.url}/v1/sandboxes/{box['id']}/exec", json={"command": command},
                     headers=caller(server, "tenant-n"), timeout=60)
    assert got.status_code == 400, got.text
    assert got.json()["error"]["code"] == "invalid_command"
