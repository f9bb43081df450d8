"""`codeplane quickstart`: the first thing a new user runs. Installs the built-in models, starts
a real server on a free loopback port, and shows a FIM completion and a tool call through the
same OpenAI-compatible HTTP API every client uses."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
from rich.panel import Panel
from rich.syntax import Syntax

from codeplane.clikit import console, fail
from codeplane.config import Settings
from codeplane.models.cli import pull_with_progress
from codeplane.models.pull import WeightsError
from codeplane.models.registry import ModelRegistry

FIM_PREFIX = 'def is_palindrome(text: str) -> bool:\n    """Return True if text reads the same backwards."""\n'
FIM_SUFFIX = "\n\nprint(is_palindrome('level'))\n"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}


def run(settings: Settings, fim_model: str, chat_model: str) -> None:
    registry = ModelRegistry(settings)
    for name in dict.fromkeys([fim_model, chat_model]):
        try:
            pull_with_progress(registry.get(name), settings, force=False)
        except (KeyError, WeightsError) as exc:
            fail(str(exc))
        console.print(f"[green]✓[/] model {name} installed")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "CODEPLANE_HOME": str(settings.home)}
    cmd = [sys.executable, "-m", "codeplane", "serve", "--port", str(port), "--log-level", "warning"]
    if settings.config_file and settings.config_file.is_file():
        cmd += ["--config", str(settings.config_file)]
    server = subprocess.Popen(cmd, env=env)
    try:
        _wait_healthy(url)
        console.print(f"[green]✓[/] server up at {url}")
        with httpx.Client(base_url=url, timeout=300) as client:
            _show_fim(client, fim_model)
            _show_tool_call(client, chat_model)
    finally:
        server.terminate()
        server.wait(timeout=30)
    console.print("\nNext: [bold]codeplane serve[/] keeps the server up on "
                  f"{settings.serve.host}:{settings.serve.port}; any OpenAI client works "
                  "against it (base_url=http://127.0.0.1:8300/v1).")


def _show_fim(client: httpx.Client, model: str) -> None:
    start = time.perf_counter()
    reply = client.post("/v1/completions", json={
        "model": model, "prompt": FIM_PREFIX, "suffix": FIM_SUFFIX, "max_tokens": 48,
        "temperature": 0, "stop": ["\n\n"]})
    _check(reply)
    middle = reply.json()["choices"][0]["text"]
    took = time.perf_counter() - start
    console.print(Panel(Syntax(FIM_PREFIX + middle + FIM_SUFFIX, "python"),
                        title=f"FIM completion by {model} ({took:.1f}s, cold)"))


def _show_tool_call(client: httpx.Client, model: str) -> None:
    start = time.perf_counter()
    reply = client.post("/v1/chat/completions", json={
        "model": model, "temperature": 0, "max_tokens": 128, "tools": [WEATHER_TOOL],
        "messages": [{"role": "user", "content": "What's the weather in Paris right now?"}]})
    _check(reply)
    message = reply.json()["choices"][0]["message"]
    took = time.perf_counter() - start
    shown = json.dumps(message.get("tool_calls") or message, indent=2)
    console.print(Panel(shown, title=f"tool call by {model} ({took:.1f}s, cold)"))


def _check(reply: httpx.Response) -> None:
    if reply.status_code != 200:
        fail(f"server answered {reply.status_code}: {reply.text}")


def _wait_healthy(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
    fail(f"server did not come up at {url} within {timeout:.0f}s")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
