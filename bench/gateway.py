"""Gateway overhead benchmark: latency added over a direct call, max sustained RPS and memory
growth, for codeplane's gateway and LiteLLM's proxy against the same loopback upstream.

    flock /tmp/codeplane-cpu.lock python bench/gateway.py            # full run (~14 min)
    python bench/gateway.py --seconds 4 --soak-s 60                   # quick look

Every process is on 127.0.0.1: the fake upstream (tests/upstreams/server.py, asyncio), the
gateway (`codeplane serve`), LiteLLM (`litellm` from a separate venv, default
/opt/litellm-venv: `python -m venv /opt/litellm-venv && /opt/litellm-venv/bin/pip install
'litellm[proxy]'`), and an open-loop load generator in its own process (raw asyncio sockets
with keep-alive, so the generator costs far less CPU than the servers it measures).
Latency is measured per request from its send time; "added" is target minus direct at the
same offered rate. Streams count as successful only if they end with `[DONE]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MASTER_KEY = "sk-" + os.urandom(32).hex()  # LiteLLM refuses to start without a strong one
BODY = {"model": "bench", "max_tokens": 16,
        "messages": [{"role": "user", "content": "Say hello in five words."}]}


# -- load generator (runs as a subprocess: `gateway.py _load ...`) ----------------------------

async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    lower = head.lower()
    if b"transfer-encoding: chunked" in lower:
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return status, b"".join(parts)
            parts.append((await reader.readexactly(size + 2))[:-2])
    at = lower.index(b"content-length:") + 15
    length = int(lower[at:lower.index(b"\r\n", at)])
    return status, await reader.readexactly(length)


async def _load(port: int, path: str, stream: bool, rate: float, seconds: float,
                closed: int, key: str) -> dict:
    body = json.dumps({**BODY, "stream": stream}).encode()
    request = (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
               f"content-type: application/json\r\nauthorization: Bearer {key}\r\n"
               f"content-length: {len(body)}\r\n\r\n").encode() + body
    idle: list[tuple] = []
    latencies: list[float] = []
    errors: dict[str, int] = {}
    loop = asyncio.get_running_loop()

    async def one() -> None:
        conn = idle.pop() if idle else await asyncio.open_connection("127.0.0.1", port)
        start = loop.time()
        try:
            conn[1].write(request)
            status, data = await _read_response(conn[0])
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
            conn[1].close()
            return
        if status != 200 or (stream and b"[DONE]" not in data):
            errors[f"http{status}"] = errors.get(f"http{status}", 0) + 1
        else:
            latencies.append(loop.time() - start)
        idle.append(conn)

    began = loop.time()
    if closed:
        async def worker() -> None:
            while loop.time() - began < seconds:
                await one()
        await asyncio.gather(*(worker() for _ in range(closed)))
    else:
        tasks, sent, lag = set(), 0, 0.0
        total = int(rate * seconds)
        while sent < total:
            now = loop.time()
            due = min(total, int((now - began) * rate) + 1)
            lag = max(lag, now - (began + sent / rate))
            for _ in range(due - sent):
                task = loop.create_task(one())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            sent = due
            await asyncio.sleep(0.002)
        await asyncio.gather(*tasks)
    elapsed = loop.time() - began
    latencies.sort()

    def pct(p: float) -> float:
        return latencies[min(len(latencies) - 1, int(p * len(latencies)))] * 1000 if \
            latencies else float("nan")

    return {"ok": len(latencies), "errors": errors, "rps": len(latencies) / elapsed,
            "p50_ms": pct(0.50), "p99_ms": pct(0.99)}


# -- orchestration --------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(port: int, path: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process for port {port} exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}{path}", timeout=2).status_code < 500:
                return  # (llama-server answers 503 while it loads its model)
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"port {port} did not come up")


def rss_mb(pid: int) -> float:
    """Resident memory of a process and its children (uvicorn's workers)."""
    total = 0
    pids = [pid] + [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    for p in pids:
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


def load(port: int, path: str, stream: bool, rate: float = 0, seconds: float = 5,
         closed: int = 0) -> dict:
    out = subprocess.run([sys.executable, __file__, "_load", str(port), path, str(int(stream)),
                          str(rate), str(seconds), str(closed), MASTER_KEY],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def start_all(args, work: Path, procs: dict) -> dict[str, int]:
    """Start upstream, codeplane and LiteLLM (into `procs`, so the caller can always stop
    them); return the port of each target."""
    up_port, gw_port, ll_port = free_port(), free_port(), free_port()
    procs["upstream"] = subprocess.Popen(
        [sys.executable, str(ROOT / "tests/upstreams/server.py"), "--port", str(up_port),
         "--chunks", str(args.chunks)])
    wait_ready(up_port, "/health", procs["upstream"])
    home = work / "home"
    home.mkdir()
    (home / "codeplane.toml").write_text(
        f'[[models]]\nname = "bench"\nprovider = "openai"\n'
        f'base_url = "http://127.0.0.1:{up_port}/v1"\nmodel = "up-model"\n')
    env = {**os.environ, "CODEPLANE_HOME": str(home)}
    procs["codeplane"] = subprocess.Popen(
        ["codeplane", "serve", "--port", str(gw_port), "--log-level", "warning",
         "--workers", str(args.workers)], env=env,
        stdout=subprocess.DEVNULL)
    litellm = Path(args.litellm_venv) / "bin" / "litellm"
    if litellm.exists():
        (work / "litellm.yaml").write_text(
            "model_list:\n  - model_name: bench\n    litellm_params:\n"
            f"      model: openai/up-model\n      api_base: http://127.0.0.1:{up_port}/v1\n"
            "      api_key: sk-bench\nlitellm_settings:\n  set_verbose: false\n")
        procs["litellm"] = subprocess.Popen(
            [str(litellm), "--config", str(work / "litellm.yaml"), "--port", str(ll_port),
             "--host", "127.0.0.1", "--num_workers", str(args.workers)],
            env={**os.environ, "LITELLM_LOG": "ERROR", "LITELLM_MODE": "PRODUCTION",
                 "LITELLM_MASTER_KEY": MASTER_KEY,
                 "DISABLE_SCHEMA_UPDATE": "true"},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=work)
    else:
        print(f"LiteLLM not found at {litellm}; comparing codeplane with direct only")
    wait_ready(gw_port, "/healthz", procs["codeplane"])
    if "litellm" in procs:
        wait_ready(ll_port, "/health/liveliness", procs["litellm"], timeout=180)
    ports = {"direct": up_port, "codeplane": gw_port, "litellm": ll_port}
    return {k: v for k, v in ports.items() if k == "direct" or k in procs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="100,500,1000")
    parser.add_argument("--seconds", type=float, default=8, help="per rate, mode and target")
    parser.add_argument("--soak-s", type=float, default=600, help="memory run length")
    parser.add_argument("--soak-rate", type=float, default=100)
    parser.add_argument("--chunks", type=int, default=8, help="content chunks per stream")
    parser.add_argument("--litellm-venv", default="/opt/litellm-venv")
    parser.add_argument("--workers", type=int, default=2,
                        help="server processes for codeplane and for LiteLLM alike")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gwbench-"))
    procs: dict[str, subprocess.Popen] = {}
    path = "/v1/chat/completions"
    try:
        ports = start_all(args, work, procs)
        for port in ports.values():  # warm up connections, JIT-free but cache-warm
            load(port, path, False, 100, 2)
            load(port, path, True, 100, 2)
        rows = []
        for rate in [float(r) for r in args.rates.split(",")]:
            for stream in (False, True):
                result = {n: load(p, path, stream, rate, args.seconds) for n, p in ports.items()}
                rows.append((rate, stream, result))
                print_row(rate, stream, result)
        print("\nmax sustained RPS (closed loop, 32 connections, 5 s):")
        for stream in (False, True):
            result = {n: load(p, path, stream, closed=32, seconds=5) for n, p in ports.items()}
            print("  stream" if stream else "  json  ", "  ".join(
                f"{n}={r['rps']:.0f} (p50 {r['p50_ms']:.1f} ms, errors {sum(r['errors'].values())})"
                for n, r in result.items()))
        soak(args, ports, procs, path)
    finally:
        stop(procs, work)


def stop(procs: dict[str, subprocess.Popen], work: Path) -> None:
    """Interrupt every process started, kill what does not exit, remove the work dir."""
    for proc in procs.values():
        proc.send_signal(signal.SIGINT)
    for proc in procs.values():
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
    shutil.rmtree(work, ignore_errors=True)


def print_row(rate: float, stream: bool, result: dict) -> None:
    direct = result["direct"]
    parts = [(f"{rate:>5.0f} rps {'stream' if stream else 'json  '} | direct p50 "
             f"{direct['p50_ms']:.2f} p99 {direct['p99_ms']:.2f} ms")]
    for name in ("codeplane", "litellm"):
        if name in result:
            r = result[name]
            parts.append(f"{name}: +{r['p50_ms'] - direct['p50_ms']:.2f} / "
                         f"+{r['p99_ms'] - direct['p99_ms']:.2f} ms (achieved {r['rps']:.0f} rps"
                         f"{', errors ' + json.dumps(r['errors']) if r['errors'] else ''})")
    print(" | ".join(parts), flush=True)


def soak(args, ports: dict, procs: dict, path: str) -> None:
    """Both gateways at a constant rate (half streaming) at once; RSS sampled throughout."""
    targets = [n for n in ("codeplane", "litellm") if n in ports]
    print(f"\nmemory: {args.soak_rate:.0f} rps each (alternating json/stream runs of 30 s) "
          f"for {args.soak_s:.0f} s", flush=True)
    start_rss = {n: rss_mb(procs[n].pid) for n in targets}
    began, samples, flip = time.monotonic(), [], False
    while time.monotonic() - began < args.soak_s:
        chunk = min(30.0, args.soak_s - (time.monotonic() - began))
        if chunk < 1:
            break
        runners = [subprocess.Popen([sys.executable, __file__, "_load", str(ports[n]), path,
                                     str(int(flip)), str(args.soak_rate), str(chunk), "0",
                                     MASTER_KEY],
                                    stdout=subprocess.PIPE, text=True) for n in targets]
        results = [json.loads(r.communicate()[0]) for r in runners]
        samples.append({n: rss_mb(procs[n].pid) for n in targets})
        errs = {n: sum(r["errors"].values()) for n, r in zip(targets, results, strict=True)}
        if any(errs.values()):
            print(f"  errors during soak: {errs}")
        flip = not flip
    for name in targets:
        series = [s[name] for s in samples]
        first = series[0] if series else start_rss[name]
        end = series[-1] if series else start_rss[name]
        print(f"  {name}: RSS {start_rss[name]:.0f} MB at start, {first:.0f} MB after 30 s, "
              f"{end:.0f} MB at end ({(end - first) / first * 100:+.1f}% after warm-up); "
              f"samples {[round(v) for v in series]}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_load":
        port, lpath, stream, rate, seconds, closed, key = sys.argv[2:9]
        print(json.dumps(asyncio.run(_load(int(port), lpath, stream == "1", float(rate),
                                           float(seconds), int(closed), key))))
    else:
        main()
