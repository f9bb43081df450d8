"""Sandbox fleet benchmark: per-strategy create time and disk (copy-on-write vs a full copy),
warm acquire p50/p95 from the pool, then a soak of N concurrent sandboxes through a real
`codeplane serve` on loopback, and a check that no process, mount, directory or record leaked,
with the server's memory before and after.

    flock /tmp/codeplane-cpu.lock python bench/fleet.py [--files 3000] [--soak 100]

Runs as root for the overlay strategy (the others are measured either way). Loopback only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from codeplane.gateway.keys import KeyStore
from codeplane.sandbox import clone
from codeplane.sandbox.fleet import Fleet, FleetSettings
from codeplane.sandbox.reaper import kill_inside


def make_repo(path: Path, files: int) -> Path:
    """A git repo of `files` 8 KiB files in 100 directories (a mid-size project)."""
    for i in range(files):
        target = path / f"d{i % 100}" / f"f{i}.py"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text((f"# file {i}\n" + "x = 1\n" * 1360)[:8192])
    env = {**os.environ, "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@localhost",
           "GIT_COMMITTER_NAME": "b", "GIT_COMMITTER_EMAIL": "b@localhost"}
    for argv in (["init", "-q", "-b", "main"], ["add", "."], ["commit", "-qm", "bench"]):
        subprocess.run(["git", *argv], cwd=path, env=env, check=True)
    return path


def du(path: Path) -> int:
    return int(subprocess.run(["du", "-sb", "-x", str(path)], capture_output=True, text=True,
                              check=True).stdout.split()[0])


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def strategies(repo: Path, scratch: Path, rounds: int) -> None:
    """Each strategy on the same base: create time and bytes a fresh sandbox adds."""
    fleet = Fleet(scratch / "strategies", FleetSettings(pool_size=0))
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                            text=True, check=True).stdout.strip()
    base = fleet.base(repo, commit)
    print(f"base checkout: {du(base) / 1e6:.1f} MB")
    for kind in clone.STRATEGIES:
        times, added = [], 0
        try:
            for i in range(rounds):
                dest = scratch / "strat" / f"{kind.name}-{i}"
                start = time.perf_counter()
                kind().make(base, dest)
                times.append(time.perf_counter() - start)
                added = du(dest / "upper") if (dest / "upper").exists() else du(dest / "ws")
                clone.teardown(dest)
        except (clone.CloneError, OSError) as exc:
            print(f"  {kind.name:11s} unavailable: {str(exc)[:90]}")
            continue
        print(f"  {kind.name:11s} create p50 {statistics.median(times) * 1e3:8.1f} ms  "
              f"p95 {pct(times, .95) * 1e3:8.1f} ms  disk added {added / 1e6:8.2f} MB")
    fleet.close()


def warm(repo: Path, scratch: Path, rounds: int) -> None:
    """Acquire from a filled pool (waiting for the refill between acquires) vs cold create."""
    fleet = Fleet(scratch / "warm", FleetSettings(pool_size=2, max_per_tenant=rounds + 4))
    start = time.perf_counter()
    first = fleet.acquire("bench", repo)
    print(f"first acquire (base checkout + create): {(time.perf_counter() - start) * 1e3:.1f} ms")
    warm_t, cold_t = [], []
    for _ in range(rounds):
        while not fleet.stats()["pools"][0]["ready"]:
            time.sleep(0.01)
        start = time.perf_counter()
        box = fleet.acquire("bench", repo)
        warm_t.append(time.perf_counter() - start)
        fleet.release(box.id)
    fleet.release(first.id)
    fleet.close()
    fleet = Fleet(scratch / "cold", FleetSettings(pool_size=0, max_per_tenant=rounds + 4))
    fleet.release(fleet.acquire("bench", repo).id)  # the base checkout, built once
    for _ in range(rounds):
        start = time.perf_counter()
        box = fleet.acquire("bench", repo)
        cold_t.append(time.perf_counter() - start)
        fleet.release(box.id)
    print(f"warm acquire ({fleet.strategy.name}): p50 {statistics.median(warm_t) * 1e3:.2f} ms"
          f"  p95 {pct(warm_t, .95) * 1e3:.2f} ms  (n={rounds})")
    print(f"cold create  ({fleet.strategy.name}): p50 {statistics.median(cold_t) * 1e3:.2f} ms"
          f"  p95 {pct(cold_t, .95) * 1e3:.2f} ms  (n={rounds})")
    fleet.close()


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def soak(repo_root: Path, scratch: Path, count: int) -> bool:
    """`count` concurrent sandboxes through a real server, a command in each, all released;
    then the server stops and nothing may remain."""
    home = scratch / "home"
    home.mkdir()
    (home / "codeplane.toml").write_text(
        f'[serve]\nworkspace_roots = ["{repo_root}"]\n[gateway]\nauth = "on"\n'
        f"[fleet]\npool_size = 4\nmax_per_tenant = {count}\nmax_sandboxes = {count + 8}\n")
    _, secret = KeyStore(home / "server").create("bench", tenant="bench")
    headers = {"authorization": f"Bearer {secret}"}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-c", "from codeplane.cli import main; main()",
                               "serve", "--port", str(port), "--log-level", "warning"],
                              env={**os.environ, "CODEPLANE_HOME": str(home)})
    client = httpx.Client(headers=headers, timeout=120)
    while True:
        try:
            client.get(f"{url}/healthz")
            break
        except httpx.TransportError:
            time.sleep(0.1)
    body = {"repo": str(repo_root / "repo")}
    client.delete(f"{url}/v1/sandboxes/{client.post(f'{url}/v1/sandboxes', json=body).json()['id']}")
    time.sleep(2)  # the pool fills
    before = rss_kb(server.pid)

    def one(_: int) -> float:
        start = time.perf_counter()
        box = client.post(f"{url}/v1/sandboxes", json=body).json()
        took = time.perf_counter() - start
        assert "id" in box, box
        return took, box["id"]

    start = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        made = list(pool.map(one, range(count)))
    listed = client.get(f"{url}/v1/sandboxes").json()
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda m: client.post(f"{url}/v1/sandboxes/{m[1]}/exec",
                                                   json={"command": "ls | wc -l"}).json(),
                             made))
    ok = sum(1 for o in outs if o.get("exit_code") == 0)
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda m: client.delete(f"{url}/v1/sandboxes/{m[1]}"), made))
    elapsed = time.perf_counter() - start
    after = rss_kb(server.pid)
    http = [t for t, _ in made]
    print(f"soak: {count} concurrent sandboxes held at once ({len(listed['data'])} listed), "
          f"{ok}/{count} commands ok, {elapsed:.1f} s in all")
    print(f"  HTTP acquire under load: p50 {statistics.median(http) * 1e3:.1f} ms  "
          f"p95 {pct(http, .95) * 1e3:.1f} ms; pool {listed['fleet']['pools']}")
    print(f"  server RSS before {before / 1024:.1f} MiB, after {after / 1024:.1f} MiB")
    server.send_signal(signal.SIGTERM)
    server.wait(timeout=60)
    fleet_dir = home / "server" / "fleet"
    leaks = {"mounts": len(clone.mounts_under(fleet_dir)),
             "sandbox dirs": len(list((fleet_dir / "sandboxes").iterdir())),
             "records": len(list((fleet_dir / "records").iterdir())),
             "processes": kill_inside(fleet_dir / "sandboxes")}
    print(f"  leaks after shutdown: {leaks}")
    return not any(leaks.values()) and ok == count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--soak", type=int, default=100)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="codeplane-fleet-bench-"))
    try:
        repo = make_repo(scratch / "code" / "repo", args.files)
        print(f"repo: {args.files} files, {du(repo) / 1e6:.1f} MB with .git")
        strategies(repo, scratch, 5)
        warm(repo, scratch, args.rounds)
        clean = soak(scratch / "code", scratch, args.soak)
        print("zero leaks" if clean else "LEAKS OR FAILURES")
    finally:
        for point in clone.mounts_under(scratch):
            subprocess.run(["umount", "-l", str(point)], check=False)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
