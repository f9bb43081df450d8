"""What the server database costs on the hot paths: a fresh schema migration (every new
server home), a budgeted gateway call's reserve + settle, a tokens-per-minute take, a
requests-per-minute (or per-IP) take, and an agent-run event stored (each one write
transaction). Prints numbers; no pass/fail.

    python bench/database.py                                 # embedded SQLite in a temp dir
    python bench/database.py --url postgresql://u:p@127.0.0.1:5432/db   # a PostgreSQL
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from codeplane.agent.records import RunRecords
from codeplane.gateway.admission import SharedBuckets
from codeplane.gateway.keys import KeyStore
from codeplane.storage import Database, Replica
from codeplane.storage.tables import rate_buckets


def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1000)
    return out


def report(name: str, ms: list[float]) -> None:
    ms = sorted(ms)
    print(f"{name:28s} p50 {statistics.median(ms):7.3f} ms   p99 {ms[int(len(ms) * 0.99)]:7.3f} ms"
          f"   (n={len(ms)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="database URL (default: a fresh SQLite file)")
    parser.add_argument("-n", type=int, default=500)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="codeplane-dbbench-"))
    if args.url is None:
        report("fresh migration (SQLite)", timed(
            lambda: Database(f"sqlite:///{scratch / f'm{time.monotonic_ns()}.db'}").upgrade(),
            20))
    db = Database(args.url or f"sqlite:///{scratch / 'bench.db'}")
    db.upgrade()
    replica = Replica(db, lease_s=30)
    keys = KeyStore(db, replica)
    key, secret = keys.create(f"bench-{time.monotonic_ns()}", budget_tokens=10**12, tpm=10**9)

    def call() -> None:
        keys.reserve(key, 45)
        keys.settle(key, 45, 12)

    report(f"budget reserve+settle ({db.dialect})", timed(call, args.n))
    report(f"tpm take ({db.dialect})", timed(lambda: keys.take_rate(key, 45), args.n))
    report(f"key lookup, snapshot ({db.dialect})", timed(lambda: keys.lookup(secret), args.n))
    buckets = SharedBuckets(db, rate_buckets, rate_buckets.c.name)
    report(f"rpm take ({db.dialect})",
           timed(lambda: buckets.take(f"rpm:{key.id}", 10**9, 1), args.n))
    runs, run_id, seq = RunRecords(db, replica), f"bench-{time.monotonic_ns()}", iter(range(1, 10**9))
    runs.claim("bench", run_id, limit=10**6)
    event = {"type": "tool_result", "output": "x" * 2000}  # a typical tool output's size
    report(f"agent event append ({db.dialect})",
           timed(lambda: runs.append(run_id, next(seq), event), args.n))
    db.close()


if __name__ == "__main__":
    main()
