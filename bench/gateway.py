"""Gateway overhead benchmark: latency added over a direct call, max sustained RPS and memory
over a soak, for codeplane's gateway and LiteLLM's proxy against the same loopback upstream.

    flock /tmp/codeplane-cpu.lock nice -n -5 python bench/gateway.py --rates 100,500 --soak-s 0
    flock /tmp/codeplane-cpu.lock nice -n -5 python bench/gateway.py --rates "" --max-s 0 \
        --soak-s 600                                            # the 10-minute memory soak
    python bench/gateway.py --targets codeplane --rates 500 --max-s 0 --soak-s 0   # one A/B

Every process is on 127.0.0.1: the fake upstream (tests/upstreams/server.py, asyncio), the
gateway (`codeplane serve --workers N` with `[gateway] auth = "on"` and a real key, as on a
team server), LiteLLM (`litellm` from a separate venv, default /opt/litellm-venv: `python -m
venv /opt/litellm-venv && /opt/litellm-venv/bin/pip install 'litellm[proxy]'`, its master key)
with the same number of workers, and an open-loop load generator in its own process (raw
sockets with keep-alive on uvloop, so it costs far less CPU than the servers it measures).

Open loop means request i is due at i/rate and its latency counts from that due time, so a
stall anywhere is in the percentiles instead of being hidden by sending later (coordinated
omission); the generator's own lateness is printed as `lag`. "Added" is target minus direct
at the same offered rate. Each row also prints the target's CPU per served request (its whole
process tree, from /proc) and how busy the machine was: at 100 % every core was taken and the
numbers measure the machine, not the gateway. Streams count only if they end with `[DONE]`.
The soak runs both gateways at once at fixed rates (half JSON, half streaming) and samples
each process tree's RSS every 10 s; the slope is fitted after the first minute.
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
    """Open loop (`rate` > 0): request i is due at `i / rate` whatever happened before, and
    its latency counts from that due time, not from when the generator got round to sending
    it, so a stall anywhere (gateway, generator, machine) shows up in the percentiles rather
    than being hidden by sending later (coordinated omission). `lag_p99_ms` is how late the
    generator itself sent; when it is large, the machine, not the target, was the limit.
    Closed loop (`closed` connections): each sends its next request when the last answered."""
    body = json.dumps({**BODY, "stream": stream}).encode()
    request = (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
               f"content-type: application/json\r\nauthorization: Bearer {key}\r\n"
               f"content-length: {len(body)}\r\n\r\n").encode() + body
    idle: list[tuple] = []
    latencies: list[float] = []
    lags: list[float] = []
    errors: dict[str, int] = {}
    opened = 0
    loop = asyncio.get_running_loop()
    now = time.perf_counter  # uvloop's loop.time() counts whole milliseconds

    async def one(due: float | None = None) -> None:
        nonlocal opened
        start = now() if due is None else due
        if due is not None:
            lags.append(now() - due)
        conn = idle.pop() if idle else None
        try:
            if conn is None:
                opened += 1
                conn = await asyncio.open_connection("127.0.0.1", port)
            conn[1].write(request)
            status, data = await _read_response(conn[0])
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
            if conn is not None:
                conn[1].close()
            return
        if status != 200 or (stream and b"[DONE]" not in data):
            errors[f"http{status}"] = errors.get(f"http{status}", 0) + 1
        else:
            latencies.append(now() - start)
        idle.append(conn)

    began = now()
    if closed:
        async def worker() -> None:
            while now() - began < seconds:
                await one()
        await asyncio.gather(*(worker() for _ in range(closed)))
    else:
        tasks, sent = set(), 0
        total = int(rate * seconds)
        while sent < total:
            due = min(total, int((now() - began) * rate) + 1)
            for i in range(sent, due):
                task = loop.create_task(one(began + i / rate))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            sent = due
            await asyncio.sleep(0.001)
        await asyncio.gather(*tasks)
    elapsed = now() - began

    def pct(values: list[float], p: float) -> float:
        values.sort()
        return values[min(len(values) - 1, int(p * len(values)))] * 1000 if values else \
            float("nan")

    return {"ok": len(latencies), "errors": errors, "rps": len(latencies) / elapsed,
            "p50_ms": pct(latencies, 0.50), "p99_ms": pct(latencies, 0.99),
            "max_ms": pct(latencies, 1.0), "lag_p99_ms": pct(lags, 0.99),
            "connections": opened}


# -- orchestration --------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(port: int, path: str, proc: subprocess.Popen, timeout: float = 300) -> None:
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


def tree(pid: int) -> list[int]:
    """A process and all its descendants (uvicorn's supervisor and workers, LiteLLM's)."""
    pids, out = [pid], []
    while pids:
        p = pids.pop()
        out.append(p)
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        pids += [int(k) for k in kids]
    return out


def rss_mb(pid: int) -> float:
    """Resident memory of a process tree, in MB."""
    total = 0
    for p in tree(pid):
        try:
            lines = Path(f"/proc/{p}/status").read_text().splitlines()
        except OSError:
            continue
        total += sum(int(line.split()[1]) for line in lines if line.startswith("VmRSS:"))
    return total / 1024


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by a process tree."""
    ticks = 0
    for p in tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def load(port: int, path: str, stream: bool, rate: float = 0, seconds: float = 5,
         closed: int = 0, key: str = "", pid: int | None = None) -> dict:
    """One generator run; adds the target's CPU per served request and how busy the whole
    machine was (1.0 = every core saturated)."""
    cpu0, (busy0, total0) = cpu_s(pid) if pid else 0.0, machine_busy()
    out = subprocess.run([sys.executable, __file__, "_load", str(port), path, str(int(stream)),
                          str(rate), str(seconds), str(closed), key or MASTER_KEY],
                         capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    busy1, total1 = machine_busy()
    result["machine_busy"] = (busy1 - busy0) / max(1, total1 - total0)
    if pid:
        result["cpu_ms_per_req"] = (cpu_s(pid) - cpu0) * 1000 / max(1, result["ok"])
    return result


def codeplane_key(env: dict) -> str:
    """A real key (the gate on, as on a team server): every request pays the key lookup, the
    rpm/tpm checks and the usage count a production request pays."""
    out = subprocess.run(["codeplane", "keys", "create", "bench", "--tenant", "bench",
                          "--json"], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["key"]


def start_all(args, work: Path, procs: dict) -> tuple[dict[str, int], dict[str, str]]:
    """Start upstream, codeplane and LiteLLM (into `procs`, so the caller can always stop
    them); return the port and the key of each target."""
    up_port, gw_port, ll_port = free_port(), free_port(), free_port()
    targets = args.targets.split(",")
    procs["direct"] = subprocess.Popen(
        [sys.executable, str(ROOT / "tests/upstreams/server.py"), "--port", str(up_port),
         "--chunks", str(args.chunks)], stderr=subprocess.DEVNULL)  # (a traceback per
    wait_ready(up_port, "/health", procs["direct"])  # open connection when interrupted)
    ports, keys = {"direct": up_port}, {"direct": MASTER_KEY}
    if "codeplane" in targets:
        home = work / "home"
        home.mkdir()
        (home / "codeplane.toml").write_text(
            # one generator on 127.0.0.1 stands for many clients: no per-address cap, and
            # the process cap left to the descriptor limit (server/edge.py)
            '[serve]\nmax_connections_per_ip = 1000000\nmax_connections = 1000000\n\n'
            f'[gateway]\nauth = "on"\n\n[[models]]\nname = "bench"\nprovider = "openai"\n'
            f'base_url = "http://127.0.0.1:{up_port}/v1"\nmodel = "up-model"\n')
        env = {**os.environ, "CODEPLANE_HOME": str(home)}
        keys["codeplane"] = codeplane_key(env)
        procs["codeplane"] = subprocess.Popen(
            ["codeplane", "serve", "--port", str(gw_port), "--log-level", "warning",
             "--workers", str(args.workers)], env=env, stdout=subprocess.DEVNULL)
        ports["codeplane"] = gw_port
    litellm = Path(args.litellm_venv) / "bin" / "litellm"
    if "litellm" in targets and litellm.exists():
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
            stdout=subprocess.DEVNULL, cwd=work,
            stderr=(Path(tempfile.gettempdir()) / f"gwbench-litellm-{ll_port}.log").open("w"))
        ports["litellm"], keys["litellm"] = ll_port, MASTER_KEY
    elif "litellm" in targets:
        print(f"LiteLLM not found at {litellm}; comparing codeplane with direct only")
    if "codeplane" in procs:
        wait_ready(gw_port, "/healthz", procs["codeplane"])
    if "litellm" in procs:
        try:
            wait_ready(ll_port, "/health/liveliness", procs["litellm"])
        except RuntimeError as exc:  # measure codeplane anyway; say why LiteLLM is missing
            print(f"LiteLLM did not start ({exc}); see its log in {tempfile.gettempdir()}")
            procs.pop("litellm").kill()
            del ports["litellm"], keys["litellm"]
    return ports, keys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", default="codeplane,litellm",
                        help="gateways to measure next to the direct call")
    parser.add_argument("--rates", default="100,500,1000", help="offered rates (\"\": none)")
    parser.add_argument("--modes", default="json,stream")
    parser.add_argument("--seconds", type=float, default=8, help="per rate, mode and target")
    parser.add_argument("--max-s", type=float, default=5,
                        help="closed-loop max-RPS run per mode and target (0: skip)")
    parser.add_argument("--soak-s", type=float, default=600, help="memory run length (0: skip)")
    parser.add_argument("--soak-rate", type=float, default=300,
                        help="codeplane's rate during the soak (half json, half streaming)")
    parser.add_argument("--soak-litellm-rate", type=float, default=30,
                        help="LiteLLM's rate during the soak: below its maximum, so its "
                             "memory shows leaks, not a growing backlog")
    parser.add_argument("--chunks", type=int, default=8, help="content chunks per stream")
    parser.add_argument("--litellm-venv", default="/opt/litellm-venv")
    parser.add_argument("--workers", type=int, default=2,
                        help="server processes for codeplane and for LiteLLM alike")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gwbench-"))
    procs: dict[str, subprocess.Popen] = {}
    path = "/v1/chat/completions"
    modes = [m == "stream" for m in args.modes.split(",")]
    try:
        ports, keys = start_all(args, work, procs)
        for name, port in ports.items():  # warm up connections and caches
            for stream in modes:
                load(port, path, stream, 100, 2, key=keys[name])
        for rate in [float(r) for r in args.rates.split(",") if r]:
            for stream in modes:
                result = {n: load(p, path, stream, rate, args.seconds, key=keys[n],
                                  pid=procs[n].pid) for n, p in ports.items()}
                print_row(rate, stream, result)
        if args.max_s:
            print(f"\nmax sustained RPS (closed loop, 32 connections, {args.max_s:g} s):")
            for stream in modes:
                result = {n: load(p, path, stream, closed=32, seconds=args.max_s, key=keys[n],
                                  pid=procs[n].pid) for n, p in ports.items()}
                print("  stream" if stream else "  json  ", "  ".join(
                    f"{n}={r['rps']:.0f} (p50 {r['p50_ms']:.1f} ms, "
                    f"errors {sum(r['errors'].values())})" for n, r in result.items()),
                    flush=True)
        if args.soak_s:
            soak(args, ports, keys, procs, path)
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
              f"{direct['p50_ms']:.2f} p99 {direct['p99_ms']:.2f} ms "
              f"(upstream CPU {direct['cpu_ms_per_req']:.2f} ms/req, generator lag p99 "
              f"{direct['lag_p99_ms']:.1f} ms, machine {direct['machine_busy']:.0%} busy)")]
    for name in ("codeplane", "litellm"):
        if name in result:
            r = result[name]
            parts.append(f"{name}: +{r['p50_ms'] - direct['p50_ms']:.2f} / "
                         f"+{r['p99_ms'] - direct['p99_ms']:.2f} ms (served {r['rps']:.0f} rps, "
                         f"max {r['max_ms']:.0f} ms, {r['cpu_ms_per_req']:.2f} ms CPU/req, "
                         f"lag p99 {r['lag_p99_ms']:.1f} ms, machine "
                         f"{r['machine_busy']:.0%} busy, {r['connections']} connections"
                         f"{', errors ' + json.dumps(r['errors']) if r['errors'] else ''})")
    print("\n    ".join(parts), flush=True)


def soak(args, ports: dict, keys: dict, procs: dict, path: str) -> None:
    """Both gateways at a constant rate at once (each half json, half streaming) for
    `soak_s`; RSS of each whole process tree sampled every 10 s. The slope is a least-squares
    fit over the samples after the first minute (allocators and caches warm up first)."""
    rates = {"codeplane": args.soak_rate, "litellm": args.soak_litellm_rate}
    targets = [n for n in rates if n in ports]
    print(f"\nmemory soak, {args.soak_s:.0f} s: " + ", ".join(
        f"{n} at {rates[n]:.0f} rps" for n in targets), flush=True)
    runners = [(n, subprocess.Popen(
        [sys.executable, __file__, "_load", str(ports[n]), path, str(stream),
         str(rates[n] / 2), str(args.soak_s), "0", keys[n]], stdout=subprocess.PIPE, text=True))
        for n in targets for stream in (0, 1)]
    began = time.monotonic()
    samples: dict[str, list[tuple[float, float]]] = {n: [] for n in targets}
    while any(r.poll() is None for _, r in runners):
        for n in targets:
            samples[n].append((time.monotonic() - began, rss_mb(procs[n].pid)))
        time.sleep(10)
    results: dict[str, list[dict]] = {n: [] for n in targets}
    for n, runner in runners:
        results[n].append(json.loads(runner.communicate()[0]))
    for n in targets:
        series = samples[n]
        values = [v for _, v in series]
        later = [(t, v) for t, v in series if t >= 60] or series
        served = sum(r["ok"] for r in results[n])
        errors: dict[str, int] = {}
        for r in results[n]:
            for kind, count in r["errors"].items():
                errors[kind] = errors.get(kind, 0) + count
        print(f"  {n}: RSS start {values[0]:.0f} MB, end {values[-1]:.0f} MB, max "
              f"{max(values):.0f} MB, slope after 1 min {slope(later) * 60:+.2f} MB/min; "
              f"{served} requests served, errors {errors or 'none'}, p99 "
              f"{max(r['p99_ms'] for r in results[n]):.1f} ms; samples "
              f"{[round(v) for v in values]}", flush=True)


def slope(series: list[tuple[float, float]]) -> float:
    """Least-squares MB per second."""
    if len(series) < 2:
        return 0.0
    n = len(series)
    mt = sum(t for t, _ in series) / n
    mv = sum(v for _, v in series) / n
    var = sum((t - mt) ** 2 for t, _ in series)
    return sum((t - mt) * (v - mv) for t, v in series) / var if var else 0.0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_load":
        import uvloop  # the generator's own CPU per request is what it costs the machine

        port, lpath, stream, rate, seconds, closed, key = sys.argv[2:9]
        print(json.dumps(uvloop.run(_load(int(port), lpath, stream == "1", float(rate),
                                          float(seconds), int(closed), key))))
    else:
        main()
