"""Tab for many users: aggregate completion throughput and p95 latency for 1, 4 and 16
simulated typists, on the embedded engine and on an upstream that batches.

Each user types through a real source file (httpx, rich from site-packages; users start at
different files and offsets) and, whenever they pause, asks for the rest of the line: a
fill-in-the-middle completion of code-small (greedy, `max_tokens` 24, stop at the newline)
with 1,500-2,000 characters before the cursor and 500 after. Users wait for their answer,
then type on for a human pause (0.2-0.8 s) before the next request: a closed loop, so a slow
backend shows up as fewer requests served and longer waits, never as an unbounded queue.

Backends, each behind `codeplane serve` on 127.0.0.1:
- embedded: `POST /v1/completions` on the server's own llama.cpp engine (`model =
  "code-small"`, one request at a time per model); the request carries `suffix`;
- batched: the same call to llama.cpp's `llama-server` with parallel slots and continuous
  batching (`-np 4 -cb`, same GGUF file), registered as a `[[models]]` deployment
  (`provider = "openai"`, `max_parallel = 4`); it has no `suffix` field, so the request
  carries the same FIM prompt spelled with the model's FIM tokens;
- tab: `POST /v1/tab` (one `cursor_id` per user) on the embedded engine: the Tab service's
  prompt layout, healing, cache and typed-ahead answers (a user who typed the start of the
  last suggestion is answered without the model);
- tab-batched: the same `POST /v1/tab` on a second server whose `[tab] upstream` is that
  llama-server: Tab's model calls go there, its caches stay in the server.

    flock /tmp/codeplane-cpu.lock python bench/tab_users.py          # ~6 minutes
    python bench/tab_users.py --users 1,4 --seconds 15 --backends embedded

`llama-server` is looked up at ~/.codeplane/bin/llama-server (how to build it: docs/
deployment.md, "Serving many users"); without it only the embedded rows are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import rich
from gateway import free_port, stop, wait_ready  # bench/gateway.py, next to this script

FILES = [Path(httpx.__file__).parent / "_client.py", Path(rich.__file__).parent / "table.py",
         Path(httpx.__file__).parent / "_models.py", Path(rich.__file__).parent / "text.py"]
WEIGHTS = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"  # code-small
LLAMA_SERVER = Path("~/.codeplane/bin/llama-server").expanduser()
BEFORE, AFTER = 1500, 500
MAX_TOKENS = 24


def request_body(backend: str, prefix: str, suffix: str, user: int = 0) -> dict:
    """The same completion, in the form each backend accepts (see the module docstring)."""
    if backend.startswith("tab"):
        return {"path": f"user{user}.py", "prefix": prefix, "suffix": suffix,
                "cursor_id": f"user{user}", "max_tokens": MAX_TOKENS, "min_confidence": 0.0}
    common = {"max_tokens": MAX_TOKENS, "temperature": 0, "stop": ["\n"]}
    if backend == "embedded":
        return {"model": "code-small", "prompt": prefix, "suffix": suffix, **common}
    return {"model": "code-small-batched",
            "prompt": f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>", **common}


async def typist(client: httpx.AsyncClient, url: str, backend: str, user: int, until: float,
                 latencies: list[float], errors: list[str], sources: list[str]) -> None:
    """One user typing through a file; a request at every pause, answered before moving on."""
    rng = random.Random(user)
    text = FILES[user % len(FILES)].read_text()
    cursor = rng.randrange(BEFORE, len(text) - AFTER)
    while time.monotonic() < until:
        cursor = min(cursor + rng.randint(3, 12), len(text) - AFTER)  # typed since the pause
        # The window starts on a 512-character grid, as an editor plugin's context would:
        # consecutive requests then share their prefix and reuse the KV cache.
        begin = (cursor - BEFORE) // 512 * 512
        body = request_body(backend, text[begin:cursor], text[cursor:cursor + AFTER], user)
        start = time.monotonic()
        try:
            reply = await client.post(url, json=body, timeout=300)
            if reply.status_code == 200:
                latencies.append(time.monotonic() - start)
                sources.append(reply.json().get("source", "model"))
            else:
                errors.append(f"http{reply.status_code}")
        except httpx.HTTPError as exc:
            errors.append(type(exc).__name__)
        await asyncio.sleep(rng.uniform(0.2, 0.8))


async def run_users(port: int, backend: str, users: int, seconds: float) -> dict:
    path = "/v1/tab" if backend.startswith("tab") else "/v1/completions"
    url = f"http://127.0.0.1:{port}{path}"
    latencies: list[float] = []
    errors: list[str] = []
    sources: list[str] = []
    limits = httpx.Limits(max_connections=users + 4)
    async with httpx.AsyncClient(limits=limits, trust_env=False) as client:
        warm = request_body(backend, "def add(a, b):\n    ", "\n")
        await client.post(url, json=warm, timeout=300)  # model loaded, caches warm
        began = time.monotonic()
        await asyncio.gather(*(typist(client, url, backend, u, began + seconds, latencies,
                                      errors, sources) for u in range(users)))
        elapsed = time.monotonic() - began
    latencies.sort()

    def pct(p: float) -> float:
        return latencies[min(len(latencies) - 1, int(p * len(latencies)))] * 1000 \
            if latencies else float("nan")

    return {"backend": backend, "users": users, "completions": len(latencies),
            "per_s": len(latencies) / elapsed, "p50_ms": pct(0.5), "p95_ms": pct(0.95),
            "errors": len(errors),
            "model_share": sources.count("model") / len(sources) if sources else 0.0}


def start(args, work: Path, procs: dict) -> dict[str, int]:
    """llama-server (if built and asked for) and the `codeplane serve`s in front of it; each
    backend's server port."""
    toml, tab_toml = "", ""
    if "batched" in args.backends:
        port = free_port()
        procs["llama-server"] = subprocess.Popen(
            [str(LLAMA_SERVER), "-m", str(Path(args.models_dir).expanduser() / WEIGHTS),
             "--host", "127.0.0.1", "--port", str(port), "-np", str(args.slots), "-cb",
             "-c", str(2048 * args.slots), "-t", str(args.threads), "--no-webui"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_ready(port, "/health", procs["llama-server"], timeout=300)
        toml = (f'[[models]]\nname = "code-small-batched"\nprovider = "openai"\n'
                f'base_url = "http://127.0.0.1:{port}/v1"\nmodel = "code-small"\n'
                f'max_parallel = {args.slots}\n')
        tab_toml = (f'[tab]\nupstream = "http://127.0.0.1:{port}"\n'
                    f'upstream_parallel = {args.slots}\nupstream_timeout_s = 300\n')
    ports = {}
    for name, backends, text in (("codeplane", ("embedded", "batched", "tab"), toml),
                                 ("codeplane-tab-upstream", ("tab-batched",), tab_toml)):
        wanted = [b for b in backends if b in args.backends.split(",")]
        if wanted:
            port = serve(name, work / name, text, args.models_dir, procs)
            ports.update({b: port for b in wanted})
    return ports


def serve(name: str, home: Path, toml: str, models_dir: str, procs: dict) -> int:
    """One `codeplane serve` with its own home and `toml`; its port."""
    home.mkdir()
    (home / "models").symlink_to(Path(models_dir).expanduser(), target_is_directory=True)
    (home / "codeplane.toml").write_text(toml)
    port = free_port()
    procs[name] = subprocess.Popen(
        ["codeplane", "serve", "--port", str(port), "--log-level", "warning"],
        env={**os.environ, "CODEPLANE_HOME": str(home)}, stdout=subprocess.DEVNULL)
    wait_ready(port, "/healthz", procs[name], timeout=300)
    return port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", default="1,4,16")
    parser.add_argument("--seconds", type=float, default=45, help="per backend and user count")
    parser.add_argument("--backends", default="embedded,batched,tab,tab-batched")
    parser.add_argument("--slots", type=int, default=4, help="llama-server parallel slots")
    parser.add_argument("--threads", type=int, default=2, help="llama-server threads")
    parser.add_argument("--models-dir", default="~/.codeplane/models")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    if "batched" in args.backends and not LLAMA_SERVER.exists():
        print(f"{LLAMA_SERVER} not found: embedded rows only")
        args.backends = ",".join(b for b in args.backends.split(",") if "batched" not in b)
    work = Path(tempfile.mkdtemp(prefix="tabusers-"))
    procs: dict[str, subprocess.Popen] = {}
    rows = []
    try:
        ports = start(args, work, procs)
        for backend in args.backends.split(","):
            for users in [int(u) for u in args.users.split(",")]:
                row = asyncio.run(run_users(ports[backend], backend, users, args.seconds))
                rows.append(row)
                print(f"{backend:>11} {users:>3} users: {row['per_s']:6.2f} completions/s, "
                      f"p50 {row['p50_ms']:7.0f} ms, p95 {row['p95_ms']:7.0f} ms "
                      f"({row['completions']} served, {row['model_share']:.0%} by the model, "
                      f"{row['errors']} errors)", flush=True)
    finally:
        stop(procs, work)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    sys.exit(main())
