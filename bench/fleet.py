"""Sandbox fleet benchmark: per-strategy create time and disk (copy-on-write vs a full copy),
warm acquire p50/p95 from the pool, the Workspace interface's read/write/exec/list latency per
backend (bwrap, host, pool and any other in the table), then a combined soak through one real
`codeplane serve` on loopback: N concurrent sandboxes and M concurrent background agents (the
scripted model from tests/upstreams), a check that no process, mount, directory or record
leaked, and the server's memory before and after.

    flock /tmp/codeplane-cpu.lock python bench/fleet.py [--files 3000] [--soak 100] \
        [--agents 20] [--parts strategies,warm,ops,soak]

Runs as root for the overlay strategy (the others are measured either way). Loopback only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from codeplane.config import FleetSettings, load_settings
from codeplane.gateway.keys import KeyStore
from codeplane.sandbox import (
    BACKENDS,
    Backends,
    BackendServices,
    Limits,
    SandboxUnavailable,
    UnknownBackend,
    Workspace,
    clone,
)
from codeplane.sandbox.fleet import Fleet, FleetError
from codeplane.sandbox.reaper import kill_inside

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the scripted model
from upstreams.scripted import ScriptedModel


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
        while not fleet.stats("bench")["pools"][0]["ready"]:
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


def workspace_ops(repo: Path, scratch: Path, rounds: int) -> None:
    """The Workspace interface's latency per backend (the same calls the agent's tools make):
    read a file, write one, run a shell command, list a directory."""
    fleet = Fleet(scratch / "ops", FleetSettings(pool_size=0))
    names = ["bwrap", "host", "pool", *(n for n in BACKENDS if n not in ("bwrap", "host", "pool"))]
    for name in names:
        try:
            ws = Backends(BackendServices(fleet=fleet, tenant="bench")).open(repo, name)
        except (UnknownBackend, SandboxUnavailable, FleetError, OSError) as exc:
            print(f"  {name:6s} unavailable: {str(exc)[:90]}")  # measure the rest
            continue
        print(f"  {name:6s} {measure(ws, rounds)}")
        ws.close()
    fleet.close()


def measure(ws: Workspace, rounds: int) -> str:
    ops = {"read": lambda: ws.read(Path("d1/f1.py"), 1 << 20),
           "write": lambda: ws.write(Path("bench-out.txt"), b"x" * 4096),
           "exec": lambda: ws.exec("true", Limits(timeout=30)),
           "list": lambda: ws.list(Path("d1"))}
    line = []
    for op, call in ops.items():
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        line.append(f"{op} p50 {statistics.median(times) * 1e3:6.2f} ms "
                    f"p95 {pct(times, .95) * 1e3:6.2f} ms")
    ws.remove(Path("bench-out.txt"))
    return "  ".join(line)


def start_server(home: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-c", "from codeplane.cli import main; main()",
                               "serve", "--port", str(port), "--log-level", "warning"],
                              env={**os.environ, "CODEPLANE_HOME": str(home)})
    while True:
        try:
            httpx.get(f"{url}/healthz", timeout=5)
            return server, url
        except httpx.TransportError:
            time.sleep(0.1)


def agents(url: str, headers: dict, repo: Path, count: int, out: dict) -> None:
    """`count` background agents launched at once, each followed to its end over SSE; the
    delay from an event being stored to the watcher receiving it is recorded."""
    body = {"repo": str(repo), "task": "wait, then write a file", "model": "scripted",
            "max_steps": 4}
    posts, delays, ids = [], [], []

    def watch(run_id: str) -> None:
        """Only events stored after the stream opened count: earlier ones are a backlog
        read from the store, not a live delivery."""
        with httpx.stream("GET", f"{url}/v1/background-agents/{run_id}/events",
                          headers=headers, timeout=600) as resp:
            opened = time.time()
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    stored = json.loads(line[6:])["at"]
                    if stored >= opened:
                        delays.append(time.time() - stored)

    def launch(_: int) -> str:
        start = time.perf_counter()
        resp = httpx.post(f"{url}/v1/background-agents", headers=headers, json=body,
                          timeout=120)
        posts.append(time.perf_counter() - start)
        resp.raise_for_status()
        return resp.json()["id"]

    with ThreadPoolExecutor(count) as pool:
        ids = list(pool.map(launch, range(count)))
        list(pool.map(watch, ids))
    out["statuses"] = [httpx.get(f"{url}/v1/background-agents/{i}", headers=headers
                                 ).json()["status"] for i in ids]
    out["posts"], out["delays"], out["ids"] = posts, delays, ids


def sandboxes(url: str, headers: dict, repo: Path, count: int, hold: threading.Event,
              out: dict) -> None:
    """`count` sandboxes made at once, a command in each, held until `hold` is set (so they
    overlap the agents), then deleted."""
    client = httpx.Client(headers=headers, timeout=300)
    body = {"repo": str(repo)}

    def one(_: int) -> tuple[float, str]:
        start = time.perf_counter()
        box = client.post(f"{url}/v1/sandboxes", json=body).json()
        assert "id" in box, box
        return time.perf_counter() - start, box["id"]

    with ThreadPoolExecutor(16) as pool:
        made = list(pool.map(one, range(count)))
        outs = list(pool.map(lambda m: client.post(f"{url}/v1/sandboxes/{m[1]}/exec",
                                                   json={"command": "ls | wc -l"}).json(),
                             made))
        out["held"] = len(client.get(f"{url}/v1/sandboxes").json()["data"])
        hold.wait(600)
        list(pool.map(lambda m: client.delete(f"{url}/v1/sandboxes/{m[1]}"), made))
    out["acquire"] = [t for t, _ in made]
    out["ok"] = sum(1 for o in outs if o.get("exit_code") == 0)


def soak(repo_root: Path, scratch: Path, count: int, agent_count: int) -> bool:
    """`count` concurrent sandboxes and `agent_count` concurrent background agents (the
    scripted model) through one real server; then every sandbox must be gone while the
    server runs (bar its warm pool), and everything after it stops."""
    model = ScriptedModel()
    model.server.start()
    model.script = [{"calls": [("run_terminal_cmd",
                                {"command": f"sleep 3; echo {i} > out{i}.txt"})]}
                    for i in range(agent_count)]
    home = scratch / "home"
    home.mkdir()
    (home / "codeplane.toml").write_text(
        f'[serve]\nworkspace_roots = ["{repo_root}"]\nmax_runs_per_tenant = {agent_count}\n'
        f'[gateway]\nauth = "on"\n'
        f"[fleet]\npool_size = 4\nmax_per_tenant = {count}\n"
        f"max_sandboxes = {count + agent_count + 8}\n"
        "max_execs_per_tenant = 16\n"  # sandboxes() runs 16 commands at once
        f'[[models]]\nname = "scripted"\nprovider = "openai"\nbase_url = "{model.url}"\n'
        'model = "scripted"\n')
    keys = KeyStore.from_settings(load_settings(home=home))
    boxes_h = {"authorization": f"Bearer {keys.create('boxes', tenant='boxes')[1]}"}
    agents_h = {"authorization": f"Bearer {keys.create('agents', tenant='agents')[1]}"}
    keys.db.close()
    server, url = start_server(home)
    repo = repo_root / "repo"
    warmup = httpx.post(f"{url}/v1/sandboxes", json={"repo": str(repo)}, headers=boxes_h,
                        timeout=300).json()
    httpx.delete(f"{url}/v1/sandboxes/{warmup['id']}", headers=boxes_h)
    time.sleep(3)  # the pool fills
    before = rss_kb(server.pid)
    hold, got_boxes, got_agents = threading.Event(), {}, {}
    start = time.perf_counter()
    box_thread = threading.Thread(target=sandboxes, args=(url, boxes_h, repo, count, hold,
                                                          got_boxes))
    agent_thread = threading.Thread(target=agents, args=(url, agents_h, repo, agent_count,
                                                         got_agents))
    box_thread.start()
    agent_thread.start()
    peak = 0
    while agent_thread.is_alive():
        stats = httpx.get(f"{url}/v1/sandboxes", headers=agents_h, timeout=60).json()
        peak = max(peak, stats["fleet"]["sandboxes"])
        if got_boxes.get("held") is not None and len(got_agents) == 0 and not hold.is_set() \
                and len(stats["data"]) >= agent_count:
            hold.set()  # every agent holds its sandbox while the 100 are held: release them
        time.sleep(0.2)
    hold.set()
    box_thread.join()
    elapsed = time.perf_counter() - start
    settle = time.time() + 60
    while time.time() < settle and httpx.get(f"{url}/v1/sandboxes", headers=agents_h
                                             ).json()["data"]:
        time.sleep(0.2)
    left = {t: len(httpx.get(f"{url}/v1/sandboxes", headers=h).json()["data"])
            for t, h in (("boxes", boxes_h), ("agents", agents_h))}
    totals = httpx.get(f"{url}/v1/sandboxes", headers=boxes_h).json()["fleet"]
    after = rss_kb(server.pid)
    statuses = got_agents["statuses"]
    acquire, posts, delays = got_boxes["acquire"], got_agents["posts"], got_agents["delays"]
    print(f"soak: {count} sandboxes ({got_boxes['held']} held at once, "
          f"{got_boxes['ok']}/{count} commands ok) and {agent_count} background agents "
          f"({ {s: statuses.count(s) for s in set(statuses)} }) through one server; "
          f"peak {peak} sandboxes on the host; {elapsed:.1f} s in all")
    print(f"  HTTP sandbox acquire under load: p50 {statistics.median(acquire) * 1e3:.1f} ms  "
          f"p95 {pct(acquire, .95) * 1e3:.1f} ms")
    print(f"  POST /v1/background-agents under load: p50 {statistics.median(posts) * 1e3:.0f}"
          f" ms  p95 {pct(posts, .95) * 1e3:.0f} ms")
    print(f"  event stored -> SSE watcher, live events ({len(delays)}): p50 "
          f"{statistics.median(delays) * 1e3:.0f} ms  p95 {pct(delays, .95) * 1e3:.0f} ms  "
          f"max {max(delays) * 1e3:.0f} ms")
    print(f"  pools: {totals['totals']}")
    print(f"  held after the soak, server running: {left} (the warm pool keeps "
          f"{totals['totals']['ready']})")
    print(f"  server RSS before {before / 1024:.1f} MiB, after {after / 1024:.1f} MiB")
    server.send_signal(signal.SIGTERM)
    server.wait(timeout=60)
    model.server.stop()
    fleet_dir = home / "server" / "fleet"
    runs = home / "server" / "background"
    kept = sorted({p.name for d in runs.iterdir() if d.is_dir() for p in d.iterdir()})
    leaks = {"mounts": len(clone.mounts_under(fleet_dir)),
             "sandbox dirs": len(list((fleet_dir / "sandboxes").iterdir())),
             "records": len(list((fleet_dir / "records").iterdir())),
             "processes": kill_inside(fleet_dir / "sandboxes")}
    print(f"  leaks after shutdown: {leaks}; what a background run keeps: {kept}")
    return (not any(leaks.values()) and got_boxes["ok"] == count and not any(left.values())
            and statuses.count("completed") == agent_count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--soak", type=int, default=100)
    parser.add_argument("--agents", type=int, default=20)
    parser.add_argument("--parts", default="strategies,warm,ops,soak")
    args = parser.parse_args()
    parts = args.parts.split(",")
    scratch = Path(tempfile.mkdtemp(prefix="codeplane-fleet-bench-"))
    try:
        repo = make_repo(scratch / "code" / "repo", args.files)
        print(f"repo: {args.files} files, {du(repo) / 1e6:.1f} MB with .git")
        if "strategies" in parts:
            strategies(repo, scratch, 5)
        if "warm" in parts:
            warm(repo, scratch, args.rounds)
        if "ops" in parts:
            print(f"Workspace operations per backend ({args.rounds} rounds each):")
            workspace_ops(repo, scratch, args.rounds)
        if "soak" in parts:
            clean = soak(scratch / "code", scratch, args.soak, args.agents)
            print("zero leaks" if clean else "LEAKS OR FAILURES")
    finally:
        for point in clone.mounts_under(scratch):
            subprocess.run(["umount", "-l", str(point)], check=False)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
