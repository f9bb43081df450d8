"""End-to-end query latency of `codeplane search` (client + real server over loopback HTTP):
dense-only, hybrid and hybrid --files, on one repository of the benchmark indexed for real.

    python bench/search/latency.py --lock /tmp/codeplane-cpu.lock [--repo psf/requests]

The repository's HEAD is exported from its mirror (`git archive`, nothing executed) with the
benchmark's `.codeplaneignore` (tests and docs out), indexed by a real sync, then every
localisation and docstring query of that repository is run through `indexing.query.search`
(server embedding + LanceDB + client BM25 + fusion + snippets) and timed. The Python process
start of the CLI (~0.5 s imports) is not included: an agent or editor keeps one process.
`--lock` takes the shared CPU lock around the timed queries only (indexing the repository
first embeds ~450 chunks, which on a busy machine would hold the lock for many minutes), and
the load average is printed next to the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "tests"))

from build import PINNED, load
from conftest import LiveServer, free_port, make_settings
from corpus import mirror

from codeplane.indexing.query import search
from codeplane.indexing.sync import SyncLock, sync
from codeplane.server.app import create_app

IGNORE = "tests/\ntest/\ntesting/\ndocs/\ndoc/\nexamples/\n.github/\n"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repo", default="psf/requests")
    parser.add_argument("--lock", type=Path, help="flock this file around the timed queries")
    args = parser.parse_args()
    queries = [row["query"] for name in ("localisation", "docstring") for row in load(name)
               if row["repo"] == args.repo]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        root = work / "repo"
        root.mkdir()
        archive = subprocess.run(["git", "--git-dir", str(mirror(args.repo)), "archive",
                                  PINNED.get(args.repo, "HEAD")],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "x", "-C", str(root)], input=archive, check=True)
        (root / ".codeplaneignore").write_text(IGNORE)
        live = LiveServer(create_app(make_settings(work / "server")), free_port()).start()
        try:
            cfg = make_settings(work / "client", server=live.url)
            dense_cfg = make_settings(work / "client", server=live.url,
                                      indexing={"fusion": "dense"})
            report = sync(root, cfg)
            print(f"{args.repo}: {report.chunks_total} chunks indexed in {report.seconds:.0f} s")
            # the indexer's file lock is a plain flock: reused for the shared CPU lock
            with SyncLock(args.lock) if args.lock else contextlib.nullcontext():
                print(f"load average before: {os.getloadavg()}")
                for label, settings, files in (("dense only", dense_cfg, False),
                                               ("hybrid", cfg, False),
                                               ("hybrid --files", cfg, True)):
                    search(root, queries[0], 10, settings, files=files)  # warm caches
                    times = []
                    for q in queries:
                        started = time.perf_counter()
                        search(root, q, 10, settings, files=files)
                        times.append(1000 * (time.perf_counter() - started))
                    print(f"{label}: {len(times)} queries, p50 {statistics.median(times):.0f} "
                          f"ms, p95 {percentile(times, 0.95):.0f} ms")
                print(f"load average after: {os.getloadavg()}")
        finally:
            live.stop()


if __name__ == "__main__":
    main()
