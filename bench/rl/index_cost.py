"""What a training run's index costs: every task snapshot of a run's config (train and
held-out) synced with the product's indexer, as `codeplane rl train` does before its first
step (rl/index.py), then synced again, as a second run or a resume does.

    python bench/rl/index_cost.py examples/rl/curve.toml --home /tmp/rl-index

Prints one row per snapshot and pass (files, chunks embedded and reused, seconds) and the
totals; `--home` defaults to the config's `[search] home` (a fresh directory measures the
first run's cost, an existing one what a resume costs).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from codeplane.rl.config import load_config
from codeplane.rl.index import RunIndex
from codeplane.rl.run import split_tasks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path, help="a run's TOML (examples/rl/*.toml)")
    parser.add_argument("--home", help="the index's home (default: the config's)")
    args = parser.parse_args()
    cfg = load_config(args.config)
    search = cfg.search.model_copy(update={"home": args.home} if args.home else {})
    snapshots = [t.snapshot for split in ("train", "heldout") for t in split_tasks(cfg, split)]
    started = time.monotonic()
    index = RunIndex(search).open()
    opened = time.monotonic() - started
    try:
        for attempt in ("first", "again"):
            started = time.monotonic()
            reports = index.index(snapshots)
            for r in reports:
                print(json.dumps({"pass": attempt, "snapshot": Path(r.root).name,
                                  "files": r.files_scanned, "changed": r.files_changed,
                                  "chunks": r.chunks_total, "embedded": r.chunks_embedded,
                                  "reused": r.chunks_reused, "seconds": r.seconds}))
            print(json.dumps({"pass": attempt, "snapshots": len(reports),
                              "embedded": sum(r.chunks_embedded for r in reports),
                              "seconds": round(time.monotonic() - started, 1),
                              "server_start_seconds": round(opened, 1)}))
    finally:
        index.close()


if __name__ == "__main__":
    main()
