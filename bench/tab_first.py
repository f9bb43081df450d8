"""Tab's first suggestion in a file (issue 34 item 7): cold, prefilled, and after server start.

Positions are bench/tab.py's held-out cases (pinned sdists never used to tune Tab, fetched
with `pip download` on first use; the window the LSP sends: a ~3,000-character prefix), each
in a different file, so no request finds another's prompt in the KV cache.

* cold: `POST /v1/tab` at a position in a file the server has not seen;
* prefilled: `POST /v1/tab/prefill` with that window (what the LSP sends when the editor
  opens the file or pauses), 2 s of idle, then `POST /v1/tab`;
* first request: `codeplane serve` started afresh (its own home, a `[tab]` section), the
  time until its port answers, then one `POST /v1/tab` at once; with `preload = true` (the
  default) and with `preload = false` (the model loads on that request, as before).

    flock /tmp/codeplane-cpu.lock python bench/tab_first.py --cases 6 --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import tab as tab_bench

from codeplane.config import load_settings
from codeplane.models.engine import Engine
from codeplane.tab.context import Budget, build_request

MIN_PREFIX = 4000  # as the issue measured (the window sent is ~3,000 of them)
IDLE_S = 2.0  # the editor opened the file this long before the first suggestion


def cases(which: str, count: int, seed: int) -> list[tab_bench.Case]:
    """`count` held-out positions with at least `MIN_PREFIX` characters before them, each in
    a file of its own."""
    rng = random.Random(seed)
    out, seen = [], set()
    for case in tab_bench.make_cases(rng, tab_bench.sources(which), count * 30):
        if case.offset >= MIN_PREFIX and (case.project, case.path) not in seen:
            seen.add((case.project, case.path))
            out.append(case)
    return out[:count]


def window(case: tab_bench.Case, cursor_id: str) -> dict:
    return build_request(case.path, case.doc, case.offset, None, Budget(), cursor_id=cursor_id,
                         min_confidence=0.0)


def timed(http: httpx.Client, url: str, body: dict) -> tuple[float, dict]:
    start = time.perf_counter()
    reply = http.post(url, json=body)
    reply.raise_for_status()
    return (time.perf_counter() - start) * 1000, reply.json()


def in_process(args: argparse.Namespace) -> dict:
    """(a) cold and (b) prefilled, on one server whose model is loaded outside the timings."""
    picked = cases(args.set, 2 * args.cases, args.seed)
    engine = Engine(load_settings(tab={"model": args.model}))
    engine.info(args.model)
    url, server = tab_bench.serve(engine)
    rows = {"cold": [], "prefilled": []}
    with httpx.Client(timeout=600) as http:
        timed(http, f"{url}/v1/tab", window(picked[-1], "warmup"))  # first decode's buffers
        for i, case in enumerate(picked[:-1]):
            body = window(case, f"c{i}")
            if i % 2:
                prefix = body["prefix"]
                pre = {"path": body["path"], "text": prefix + body["suffix"],
                       "cursor": len(prefix), "cursor_id": body["cursor_id"]}
                timed(http, f"{url}/v1/tab/prefill", pre)
                time.sleep(IDLE_S)
            ms, got = timed(http, f"{url}/v1/tab", body)
            rows["prefilled" if i % 2 else "cold"].append(
                {"ms": round(ms), "prompt_tokens": got["prompt_tokens"],
                 "cached_tokens": got["cached_tokens"], "prefix_chars": len(body["prefix"])})
    server.should_exit = True
    engine.close()
    return {k: summary(v) for k, v in rows.items()}


def summary(rows: list[dict]) -> dict:
    ms = sorted(r["ms"] for r in rows)
    return {"n": len(ms), "p50_ms": round(statistics.median(ms)),
            "p95_ms": round(ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]), "rows": rows}


def first_request(case: tab_bench.Case, model: str, preload: bool) -> dict:
    """Start `codeplane serve` in a fresh home, wait for its port, send one /v1/tab."""
    with tempfile.TemporaryDirectory() as home, socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        models = Path(load_settings().home) / "models"
        (Path(home) / "models").symlink_to(models, target_is_directory=True)
        (Path(home) / "codeplane.toml").write_text(
            f'[tab]\nmodel = "{model}"\npreload = {str(preload).lower()}\n')
        env = {**os.environ, "CODEPLANE_HOME": home}
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "codeplane", "serve", "--host",
                                 "127.0.0.1", "--port", str(port)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            while True:
                try:
                    httpx.get(f"{url}/healthz", timeout=1)
                    break
                except httpx.TransportError:
                    time.sleep(0.05)
            port_ms = (time.perf_counter() - start) * 1000
            with httpx.Client(timeout=600) as http:
                ms, _ = timed(http, f"{url}/v1/tab", window(case, "first"))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    return {"port_open_ms": round(port_ms), "first_tab_ms": round(ms)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=6, help="positions per variant")
    ap.add_argument("--runs", type=int, default=3, help="fresh servers per preload setting")
    ap.add_argument("--set", default="heldout3", choices=sorted(tab_bench.SDISTS))
    ap.add_argument("--model", default="code-small")
    ap.add_argument("--seed", type=int, default=34)
    ap.add_argument("--skip-serve", action="store_true", help="only (a) and (b)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.cases < 1 or args.runs < 1:
        ap.error("--cases and --runs must be at least 1")
    result = {"load_before": os.getloadavg()[0], "in_process": in_process(args)}
    if not args.skip_serve:
        case = cases(args.set, 1, args.seed + 1)[0]
        result["first_request"] = {
            f"preload={p}": [first_request(case, args.model, p) for _ in range(args.runs)]
            for p in (True, False)}
    result["load_after"] = os.getloadavg()[0]
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
