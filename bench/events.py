"""Event lake benchmark: emit, flush and query speed on a store (a directory or S3).

Prints events/s for `emit` (validation + buffering, what a request handler pays), flush
throughput (Parquet encoding + object store writes), and the time `codeplane events stats` and
a filtered query take over what was written. The store should be fresh or dedicated to the
benchmark (each run adds its events).

Usage:
  python bench/events.py --store /tmp/lake --events 200000 --tenants 20
  AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... AWS_ENDPOINT_URL=http://127.0.0.1:8333 \\
      python bench/events.py --store s3://bucket/bench

Wrap runs in `flock /tmp/codeplane-cpu.lock` on shared machines.
"""

from __future__ import annotations

import argparse
import random
import time
from datetime import UTC, datetime, timedelta

from codeplane.events import query as lake
from codeplane.events.log import EventLog
from codeplane.storage import ObjectStore

START = datetime(2026, 11, 1, tzinfo=UTC)


def _emit(events: EventLog, count: int, tenants: int, days: int) -> float:
    rng = random.Random(7)
    t0 = time.perf_counter()
    for i in range(count):
        at = START + timedelta(seconds=rng.randrange(days * 86400))
        tenant = f"tenant-{rng.randrange(tenants)}"
        if i % 10 < 7:
            events.emit("tab_shown", tenant, {"suggestion_id": f"s{i}", "model": "code-small",
                                              "latency_ms": rng.uniform(20, 400), "chars": 30,
                                              "confidence": 0.8, "source": "model",
                                              "language": "python"}, at=at)
        elif i % 10 < 9:
            events.emit("tab_accepted", tenant, {"suggestion_id": f"s{i}", "after_ms": 700.0},
                        at=at)
        else:
            events.emit("gateway_usage", tenant, {"model": rng.choice(["a", "b", "c"]),
                                                  "prompt_tokens": 900, "completion_tokens": 40,
                                                  "latency_ms": rng.uniform(50, 900)}, at=at)
    return time.perf_counter() - t0


def _timed(fn, *args):
    t0 = time.perf_counter()
    result = fn(*args)
    return result, (time.perf_counter() - t0) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", required=True, help="directory or s3://bucket/prefix")
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--tenants", type=int, default=20)
    parser.add_argument("--days", type=int, default=3)
    args = parser.parse_args()
    store = ObjectStore.open(args.store)
    events = EventLog(store, flush_events=10**9, flush_seconds=3600,
                      max_pending=args.events + 1)
    emit_s = _emit(events, args.events, args.tenants, args.days)
    keys, flush_ms = _timed(events.flush)
    events.close()
    print(f"store: {store.url}")
    print(f"emit: {args.events} events in {emit_s:.2f} s = {args.events / emit_s:,.0f} events/s "
          f"({emit_s / args.events * 1e6:.1f} us each)")
    print(f"flush: {len(keys)} files in {flush_ms:.0f} ms = "
          f"{args.events / flush_ms * 1000:,.0f} events/s")
    stats, stats_ms = _timed(lake.stats, store)
    print(f"stats over {len(store.list('events'))} files: {stats_ms:.0f} ms "
          f"(shown {stats['tab']['shown']}, accept rate {stats['tab']['accept_rate']:.3f})")
    sql = ("SELECT count(*), quantile_cont(latency_ms, 0.95) FROM tab_shown "
           f"WHERE tenant = 'tenant-1' AND day = '{START:%Y-%m-%d}'")
    _, query_ms = _timed(lake.query, store, sql)
    print(f"query one tenant-day: {query_ms:.0f} ms")


if __name__ == "__main__":
    main()
