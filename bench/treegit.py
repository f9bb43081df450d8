"""What keeping git off the host costs: the post-command sweep (gitguard: walk, rename, strip
setuid bits), a background run's per-tool diff and final commit made inside the sandbox
(sandbox/treegit.py) against the host-side git they replaced, and a fleet base cloned
`--no-local` against a local clone.

    flock /tmp/codeplane-cpu.lock python bench/treegit.py [--files 3000] [--rounds 15]

Prints p50/p95 in milliseconds per measure. Needs bubblewrap (the sandbox) and git.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from fleet import make_repo

from codeplane.sandbox import BwrapRunner, treegit
from codeplane.sandbox.clone import SAFE_GIT, git_env
from codeplane.sandbox.gitguard import GitGuard


def timed(fn: Callable[[], object], rounds: int) -> str:
    """p50 / p95 of `rounds` calls, in ms."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    times.sort()
    p95 = times[min(len(times) - 1, round(0.95 * (len(times) - 1)))]
    return f"p50 {statistics.median(times):8.1f}  p95 {p95:8.1f}"


def host_diff(ws: Path, base: str) -> str:
    """The replaced way: host git over the tree, a scratch index (what a planted config
    would run in)."""
    with tempfile.TemporaryDirectory() as scratch:
        env = {**git_env(), "GIT_INDEX_FILE": f"{scratch}/index"}
        for args in (["read-tree", base], ["add", "-A"]):
            subprocess.run(["git", *SAFE_GIT, *args], cwd=ws, env=env, check=True)
        return subprocess.run(["git", *SAFE_GIT, "diff", "--cached", base], cwd=ws, env=env,
                              check=True, capture_output=True, text=True).stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=3000, help="files in the test repo")
    parser.add_argument("--rounds", type=int, default=15, help="calls per measure")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-treegit-"))
    try:
        repo = make_repo(work / "repo", args.files)
        ws = work / "ws"
        subprocess.run(["git", "clone", "-q", str(repo), str(ws)], check=True, env=git_env())
        base = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ws, check=True, text=True,
                              capture_output=True).stdout.strip()
        (ws / "d1" / "f1.py").write_text("changed = True\n")
        (ws / "new.py").write_text("new = 1\n")
        runner = BwrapRunner(ws)
        print(f"{args.files} files, {args.rounds} rounds, load {os.getloadavg()[0]:.1f}")
        print(f"sweep before a command      {timed(lambda: GitGuard(ws), args.rounds)}")
        guard = GitGuard(ws)
        print(f"sweep after a command       {timed(guard.neutralise, args.rounds)}")
        print(f"diff, host git (replaced)   {timed(lambda: host_diff(ws, base), args.rounds)}")
        print("diff, in the sandbox        "
              f"{timed(lambda: treegit.diff(runner, ws, base, 1 << 20), args.rounds)}")
        print("commit+patch+bundle, sandbox "
              f"{timed(lambda: treegit.commit(runner, ws, base, 'b', 'm', 't'), args.rounds)}")
        clones = iter(range(10 ** 6))

        def clone(*flags: str) -> None:
            dest = work / f"base{next(clones)}"
            subprocess.run(["git", *SAFE_GIT, "clone", "-q", *flags, "--no-checkout", "--",
                            str(repo), str(dest)], check=True, env=git_env())
            subprocess.run(["git", "-C", str(dest), "checkout", "-q", "--detach", base],
                           check=True, env=git_env())
            shutil.rmtree(dest)

        rounds = max(3, args.rounds // 3)
        print(f"base clone, local           {timed(clone, rounds)}")
        print(f"base clone, --no-local      {timed(lambda: clone('--no-local'), rounds)}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
