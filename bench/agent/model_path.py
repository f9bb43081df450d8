"""Per-reply cost of the two ChatModel paths a run can take to the same deployment:
`HttpChatModel` to the server's own `/v1/chat/completions` (what server runs did before: a
loopback HTTP request, then the gateway) and `GatewayChatModel` (what they do now: the gateway
in-process). The deployment is the fake OpenAI upstream (`tests/upstreams/server.py`, 5
streamed chunks), so the numbers are the path's overhead, not a model's speed.

    flock /tmp/codeplane-cpu.lock python bench/agent/model_path.py [--replies 200]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from codeplane.config import load_settings
from codeplane.core.chat import ChatModel, HttpChatModel, Sampling
from codeplane.core.metrics import Metrics
from codeplane.gateway.chat import GatewayChatModel
from codeplane.gateway.providers.base import ProviderServices
from codeplane.gateway.router import Client, Gateway
from codeplane.server.app import create_app

UPSTREAM = Path(__file__).resolve().parents[2] / "tests" / "upstreams" / "server.py"
MESSAGES = [{"role": "user", "content": "hi"}]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_up(url: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def timed(model: ChatModel, replies: int) -> list[float]:
    """Milliseconds per reply (after 10 warm-up replies)."""
    out = []
    for i in range(replies + 10):
        start = time.perf_counter()
        turn = model.complete(MESSAGES, [], Sampling(max_tokens=16))
        assert turn.message["content"], turn
        if i >= 10:
            out.append((time.perf_counter() - start) * 1000)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replies", type=int, default=200)
    args = parser.parse_args()
    up_port, port = free_port(), free_port()
    upstream = subprocess.Popen([sys.executable, str(UPSTREAM), "--port", str(up_port)])
    try:
        wait_up(f"http://127.0.0.1:{up_port}/")
        settings = load_settings(home=Path(tempfile.mkdtemp()), models=[
            {"name": "fake", "provider": "openai", "base_url": f"http://127.0.0.1:{up_port}/v1",
             "model": "up-model"}])
        app = create_app(settings)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                               log_level="warning"))
        threading.Thread(target=server.run, daemon=True).start()
        wait_up(f"http://127.0.0.1:{port}/healthz")
        loop = asyncio.new_event_loop()  # a gateway of its own, on a loop of its own
        threading.Thread(target=loop.run_forever, daemon=True).start()
        metrics = Metrics()
        models = {"http via the server (before)": HttpChatModel(f"http://127.0.0.1:{port}/v1",
                                                                  "fake"),
                  "gateway in-process (now)": GatewayChatModel(
                      Gateway(settings, ProviderServices(app.state.engine, metrics), metrics), "fake",
                      Client("agent", "127.0.0.1"), loop)}
        for name, model in models.items():
            ms = timed(model, args.replies)
            print(f"{name:32s} median {statistics.median(ms):6.2f} ms  "
                  f"p90 {statistics.quantiles(ms, n=10)[-1]:6.2f} ms  ({args.replies} replies)")
        server.should_exit = True
    finally:
        upstream.terminate()


if __name__ == "__main__":
    main()
