"""Tab's first suggestion in a file (issue 34 item 7): cold, prefilled, and after server start.

Positions are bench/tab.py's held-out cases (pinned sdists never used to tune Tab, fetched
with `pip download` on first use; the window the LSP sends: a ~3,000-character prefix), each
in a different file, so no request finds another's prompt in the KV cache.

* cold: `POST /v1/tab` at a position in a file the server has not seen (answered from the
  short window, `[tab] cold_prompt_tokens`); then, once the full window's background prefill
  is done, the same position from another cursor (no LRU hit): the full window, cached;
* prefilled: `POST /v1/tab/prefill` with that window (what the LSP sends when the editor
  opens the file or pauses), 2 s of idle, then `POST /v1/tab`;
* first request: `codeplane serve` started afresh (its own home, a `[tab]` section), the
  time until its port answers, then one `POST /v1/tab` at once; with `preload = true` (the
  default) and with `preload = false` (the model loads on that request, as before).

`--quality N` instead asks N held-out positions twice on one engine: cold (the short
window) and after the background prefill (the full window), and counts how often the two
answers are the same and how often each is the author's line (exact: load-independent).

    flock /tmp/codeplane-cpu.lock python bench/tab_first.py --cases 6 --runs 3
    flock /tmp/codeplane-cpu.lock python bench/tab_first.py --quality 20 --json q.json
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
from codeplane.tab.service import TabRequest, TabService, TabSettings

MIN_PREFIX = 4000  # as the issue measured (the window sent is ~3,000 of them)
IDLE_S = 2.0  # the editor opened the file this long before the first suggestion
# where an answer's time went: the server's whole handling (latency_ms), of it the model
# path in the worker (model_ms), of that the prompt's evaluation and the decode
SPENT = ("window", "prompt_tokens", "cached_tokens", "completion_tokens", "latency_ms",
         "model_ms", "prompt_ms", "decode_ms")


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
    rows = {"cold": [], "then": [], "prefilled": []}
    with httpx.Client(timeout=600) as http:
        timed(http, f"{url}/v1/tab", window(picked[-1], "warmup"))  # first decode's buffers
        prefilled(http, url)  # and the warm-up's background prefill done
        for i, case in enumerate(picked[:-1]):
            body = window(case, f"c{i}")
            if i % 2:
                prefix = body["prefix"]
                pre = {"path": body["path"], "text": prefix + body["suffix"],
                       "cursor": len(prefix), "cursor_id": body["cursor_id"]}
                timed(http, f"{url}/v1/tab/prefill", pre)
                time.sleep(IDLE_S)
            ms, got = timed(http, f"{url}/v1/tab", body)
            rows["prefilled" if i % 2 else "cold"].append(row(ms, got, body))
            if got["window"] == "short":
                prefilled(http, url)
                ms, got = timed(http, f"{url}/v1/tab", {**body, "cursor_id": f"then{i}"})
                rows["then"].append(row(ms, got, body))
    server.should_exit = True
    engine.close()
    return {k: summary(v) for k, v in rows.items() if v}


def row(ms: float, got: dict, body: dict) -> dict:
    return {"ms": round(ms), **{k: got[k] for k in SPENT}, "prefix_chars": len(body["prefix"])}


def prefilled(http: httpx.Client, url: str) -> None:
    """Wait until no prefill is queued or running (a cold answer's background prefill)."""
    while http.get(f"{url}/v1/tab/stats").json()["prefills_pending"]:
        time.sleep(0.1)


def quality(args: argparse.Namespace) -> dict:
    """Short-window answers against full-window answers at the same held-out positions."""
    load_before = os.getloadavg()[0]
    engine = Engine(load_settings(tab={"model": args.model}))
    svc = TabService(engine, TabSettings(model=args.model, cold_prompt_tokens=args.cold_tokens))
    rows = []
    try:
        for i, case in enumerate(cases(args.set, args.quality, args.seed)):
            body = window(case, f"q{i}")
            short = svc.complete_sync(TabRequest(**body))
            while svc.pending_prefills():
                time.sleep(0.1)
            full = svc.complete_sync(TabRequest(**{**body, "cursor_id": f"full{i}"}))
            rows.append({"path": case.path, "kind": case.kind, "short_window": short.window,
                         "short_prompt": short.prompt_tokens, "full_prompt": full.prompt_tokens,
                         "full_cached": full.cached_tokens, "same": short.text == full.text,
                         "short_output": short.completion_tokens, "short_ms": short.latency_ms,
                         "short_prompt_ms": short.prompt_ms, "short_decode_ms": short.decode_ms,
                         **{f"{k}_exact": tab_bench.line_scores(r.text, case.reference)["exact"]
                            for k, r in (("short", short), ("full", full))}})
    finally:
        engine.close()
    shorts = [r for r in rows if r["short_window"] == "short"]
    return {"load_before": load_before, "positions": len(rows), "short_window": len(shorts),
            **{k: sum(r[k] for r in shorts) for k in ("same", "short_exact", "full_exact")},
            **({"short_ms_p50": statistics.median(r["short_ms"] for r in shorts),
                "short_ms_max": max(r["short_ms"] for r in shorts)} if shorts else {}),
            "rows": rows}


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
                ms, got = timed(http, f"{url}/v1/tab", window(case, "first"))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    return {"port_open_ms": round(port_ms), "first_tab_ms": round(ms),
            "load": os.getloadavg()[0], **{k: got.get(k) for k in SPENT}}  # None: older


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=6, help="positions per variant")
    ap.add_argument("--runs", type=int, default=3, help="fresh servers per preload setting")
    ap.add_argument("--set", default="heldout3", choices=sorted(tab_bench.SDISTS))
    ap.add_argument("--model", default="code-small")
    ap.add_argument("--seed", type=int, default=34)
    ap.add_argument("--skip-serve", action="store_true", help="only (a) and (b)")
    ap.add_argument("--serve-only", action="store_true", help="only (c): fresh servers")
    ap.add_argument("--quality", type=int, default=0,
                    help="instead: short- vs full-window answers at this many positions")
    ap.add_argument("--cold-tokens", type=int, default=TabSettings().cold_prompt_tokens,
                    help="--quality's short window ([tab] cold_prompt_tokens)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.cases < 1 or args.runs < 1:
        ap.error("--cases and --runs must be at least 1")
    if args.quality:
        return report(quality(args), args.json)
    result = {"load_before": os.getloadavg()[0]}
    if not args.serve_only:
        result["in_process"] = in_process(args)
    if not args.skip_serve:
        case = cases(args.set, 1, args.seed + 1)[0]
        runs = [(p, first_request(case, args.model, p))  # alternating: the same load for both
                for _ in range(args.runs) for p in (True, False)]
        result["first_request"] = {f"preload={p}": [r for q, r in runs if q == p]
                                   for p in (True, False)}
    report(result, args.json)


def report(result: dict, path: Path | None) -> None:
    result["load_after"] = os.getloadavg()[0]
    print(json.dumps(result, indent=1))
    if path:
        path.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
