"""Background agents benchmark: launch latency, how soon a watcher sees an event, N agents at
once, and what is left behind afterwards.

Everything is on 127.0.0.1: a real codeplane server (in this process) whose agents use the
scripted OpenAI-compatible model from tests/upstreams (deterministic, no weights), in the real
bubblewrap sandbox, each in a pooled copy-on-write sandbox of the fleet (a generated repo).

  python bench/background.py [--agents 20] [--files 300]

Prints: POST latency p50/p95 (sandbox acquire included), event delay p50/p95/max (stored ->
received by an SSE watcher; the goal is < 200 ms), wall time for all agents, server threads and
RSS before/after, bwrap processes and sandboxes left, what a finished run keeps on disk.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the scripted model and server helpers

from upstreams.scripted import ScriptedModel, caller, run_server

API = "/v1/background-agents"


def make_repo(root: Path, files: int) -> Path:
    repo = root / "roots" / "repo"
    (repo / "pkg").mkdir(parents=True)
    for i in range(files):
        (repo / "pkg" / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 20)
    for args in (["init", "-q", "-b", "main"], ["add", "-A"],
                 ["-c", "user.name=b", "-c", "user.email=b@b", "commit", "-qm", "base"]):
        subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)
    return repo


def bwraps() -> int:
    """bwrap processes descended from this one (other users of the machine do not count)."""
    parent, names = {}, {}
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        if proc.name.isdigit():
            names[int(proc.name)] = stat[stat.index("(") + 1:stat.rindex(")")]
            parent[int(proc.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
    mine = 0
    for pid, name in names.items():
        up = pid
        while up > 1 and up != os.getpid():
            up = parent.get(up, 0)
        mine += name == "bwrap" and up == os.getpid()
    return mine


def run_threads() -> int:
    """Agent and supervisor threads still alive (each run should leave none)."""
    return sum(t.name.startswith(("agent-", "background-")) for t in threading.enumerate())


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def watch(url: str, headers: dict, run_id: str, delays: list[float]) -> None:
    """Follow one run's SSE stream to its end, recording each event's delay."""
    with httpx.stream("GET", f"{url}{API}/{run_id}/events", headers=headers,
                      timeout=300) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                delays.append(time.time() - event["at"])


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--agents", type=int, default=20)
    parser.add_argument("--files", type=int, default=300)
    args = parser.parse_args()
    scripted = ScriptedModel()
    scripted.server.start()
    with tempfile.TemporaryDirectory(prefix="bench-bg-") as tmp:
        repo = make_repo(Path(tmp), args.files)
        server = run_server(Path(tmp) / "home", scripted.url,
                            workspace_roots=[str(repo.parent)],
                            max_runs_per_tenant=args.agents)
        headers = caller(server)
        threads0, rss0, bwrap0 = run_threads(), rss_mb(), bwraps()
        scripted.script = [{"calls": [("create_file", {"path": f"new{i}.txt",
                                                        "content": f"hello {i}\n"})]}
                           for i in range(args.agents)]
        body = {"repo": str(repo), "task": "create a file", "model": "scripted",
                "max_steps": 10}
        posts, delays, watchers, ids = [], [], [], []
        start = time.perf_counter()
        for _ in range(args.agents):
            t0 = time.perf_counter()
            resp = httpx.post(server.url + API, headers=headers, json=body, timeout=60)
            posts.append(time.perf_counter() - t0)
            resp.raise_for_status()
            run_id = resp.json()["id"]
            ids.append(run_id)
            watcher = threading.Thread(target=watch, args=(server.url, headers, run_id,
                                                           delays))
            watcher.start()
            watchers.append(watcher)
        for watcher in watchers:
            watcher.join()
        wall = time.perf_counter() - start
        statuses = [httpx.get(f"{server.url}{API}/{i}", headers=headers).json()["status"]
                    for i in ids]
        time.sleep(1)
        threads1, rss1, bwrap1 = run_threads(), rss_mb(), bwraps()
        kept = server.app.state.services.background.root / ids[0]
        du = subprocess.run(["du", "-sk", str(kept)], capture_output=True, text=True,
                            check=True)
        held = len(server.app.state.services.fleet.list("t1"))
        server.stop()
        print(f"agents: {args.agents} at once, repo {args.files} files; statuses: "
              f"{ {s: statuses.count(s) for s in set(statuses)} }")
        print(f"POST /v1/background-agents (sandbox acquire included): p50 "
              f"{statistics.median(posts) * 1000:.0f} ms, p95 {pct(posts, .95) * 1000:.0f} ms")
        print(f"event delay stored -> SSE watcher ({len(delays)} events): p50 "
              f"{statistics.median(delays) * 1000:.0f} ms, p95 {pct(delays, .95) * 1000:.0f} "
              f"ms, max {max(delays) * 1000:.0f} ms")
        print(f"wall time, all agents to their end: {wall:.1f} s")
        print(f"run threads alive {threads0} -> {threads1}; RSS {rss0:.0f} -> {rss1:.0f} MB; "
              f"bwrap processes {bwrap0} -> {bwrap1}")
        print(f"sandboxes still held: {held}; a finished run keeps {du.stdout.split()[0]} KB "
              "(its branch as a bundle; its sandbox is gone)")
    scripted.server.stop()


if __name__ == "__main__":
    os.nice(5)
    main()
