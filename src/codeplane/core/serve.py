"""`codeplane serve` as a child process on a free loopback port: how a program that is not the
server (the quickstart, a training run's search, benchmarks) runs the product's server as a
user starts it, without importing the composition root that sits above it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

START_TIMEOUT_S = 120.0  # building the app (database migrations, services) on a loaded machine


class ServerDidNotStart(RuntimeError):
    """The child exited or never answered /healthz; its own output says why."""


@contextmanager
def child_server(home: Path, config_file: Path | None = None,
                 timeout: float = START_TIMEOUT_S) -> Iterator[str]:
    """`codeplane serve` with CODEPLANE_HOME=`home` until the block ends; its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "codeplane", "serve", "--port", str(port), "--log-level",
           "warning"]
    if config_file is not None and config_file.is_file():
        cmd += ["--config", str(config_file)]
    server = subprocess.Popen(cmd, env={**os.environ, "CODEPLANE_HOME": str(home)})
    try:
        _wait_healthy(url, server, timeout)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(url: str, server: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
    raise ServerDidNotStart(f"the server did not come up at {url} (see its output above)")
