"""Wall-clock speedup of running one turn's independent tool calls concurrently vs. one by one.

The batches are what a model emits when told to gather context in one turn: 4 calls of
read_file / grep / file_search over a real code tree (this repository's src/ and tests/, plus
four standard-library packages). Both modes go through the agent's own
scheduler (`Agent._execute`), so conflict handling and result ordering are included.

    flock /tmp/codeplane-cpu.lock python bench/agent/parallel.py [--repeat 15]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import sysconfig
import time
from pathlib import Path

from codeplane.agent.env import local_environment
from codeplane.agent.loop import Agent, AgentConfig
from codeplane.core.chat import HttpChatModel

REPO = Path(__file__).resolve().parents[2]
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def calls(*pairs: tuple[str, dict]) -> list[dict]:
    return [{"id": f"c{i}", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, (n, a) in enumerate(pairs)]


BATCHES = {
    "4x read_file (repo)": (REPO, calls(
        ("read_file", {"path": "src/codeplane/agent/loop.py"}),
        ("read_file", {"path": "src/codeplane/rl/rollout.py"}),  # 400 lines, as tools.py
        ("read_file", {"path": "src/codeplane/sandbox/runner.py"}),
        ("read_file", {"path": "src/codeplane/config/__init__.py"}))),
    "4x grep (repo)": (REPO, calls(
        ("grep", {"pattern": r"def \w+\(", "include": "*.py"}),
        ("grep", {"pattern": "import httpx"}),
        ("grep", {"pattern": "TODO|FIXME"}),
        ("grep", {"pattern": "class .*Error", "path": "src"}))),
    "2 read + 2 grep (repo)": (REPO, calls(
        ("read_file", {"path": "src/codeplane/agent/env.py"}),
        ("grep", {"pattern": "Limits\\("}),
        ("read_file", {"path": "README.md"}),
        ("file_search", {"query": "test_*.py"}))),
    "4x grep (stdlib pkgs)": (STDLIB, calls(
        ("grep", {"pattern": "def __init__", "path": "asyncio"}),
        ("grep", {"pattern": "raise ValueError", "path": "email"}),
        ("grep", {"pattern": "import (os|sys)$", "path": "unittest"}),
        ("grep", {"pattern": "class \\w+Error", "path": "tkinter"}))),
}


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (rg, ruff), user + system."""
    me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                                  resource.RUSAGE_CHILDREN))
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def timed(agent: Agent, batch: list[dict]) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds, and the longest single call's wall seconds."""
    start, cpu = time.perf_counter(), cpu_seconds()
    results = agent._execute(1, batch)
    elapsed = time.perf_counter() - start
    assert all(r.ok for r in results), [r.output for r in results if not r.ok]
    return elapsed, cpu_seconds() - cpu, max(r.seconds for r in results)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    model = HttpChatModel("http://127.0.0.1:9/v1", "unused")  # no model call is made
    cores = len(os.sched_getaffinity(0))
    print(f"{'batch':26s} {'serial ms':>10s} {'parallel ms':>12s} {'speedup':>8s} "
          f"{'cpu ms':>7s} {'longest ms':>10s} {'ceiling':>8s}   ({cores} cores)")
    for label, (root, batch) in BATCHES.items():
        env = local_environment(root)
        modes = {p: Agent(model, env, AgentConfig(parallel=p)) for p in (False, True)}
        timed(modes[False], batch)  # warm the page cache
        samples: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
        for _ in range(args.repeat):
            for parallel, agent in modes.items():
                samples[parallel].append(timed(agent, batch))
        serial, par = (statistics.median(s[0] for s in samples[p]) for p in (False, True))
        cpu = statistics.median(s[1] for s in samples[False])
        longest = statistics.median(s[2] for s in samples[False])
        # no schedule beats the CPU work spread over every core, or the longest call
        ceiling = serial / max(cpu / cores, longest)
        print(f"{label:26s} {serial * 1000:10.1f} {par * 1000:12.1f} {serial / par:7.2f}x "
              f"{cpu * 1000:7.1f} {longest * 1000:10.1f} {ceiling:7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
