"""The gateway's faster stack keeps its guarantees: an upstream redirect is never followed
(aiohttp would follow one by default), any JSON an upstream streams is relayed (orjson alone
cannot write integers past 64 bits), and `codeplane serve --workers N` runs N processes on
one port whose combined load on a deployment stays within its `max_parallel`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import httpx
import pytest
from conftest import LiveServer, free_port, make_settings
from upstreams.server import Upstream

from codeplane.models.engine import Engine
from codeplane.server.app import create_app

CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


class _Recorder(BaseHTTPRequestHandler):
    """Answers every request with a redirect to `target`, or (as the target) records it."""

    target = ""
    seen: ClassVar[list[dict]] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        if self.target:
            self.send_response(307)
            self.send_header("location", self.target)
        else:
            type(self).seen.append(dict(self.headers))
            self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def _serve(handler: type) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("stream", [False, True])
def test_an_upstream_redirect_is_never_followed(tmp_path, monkeypatch, stream):
    """A deployment that answers 307 elsewhere (a hijacked or misconfigured upstream) fails
    like a broken one: the request and the deployment's API key never reach the target."""
    target = _serve(type("Target", (_Recorder,), {"seen": []}))
    redirect = _serve(type("Redirect", (_Recorder,), {
        "target": f"http://127.0.0.1:{target.server_port}/v1/chat/completions"}))
    monkeypatch.setenv("UP_KEY", "sk-upstream-secret")
    settings = make_settings(tmp_path / "home", models=[{
        "name": "chat", "provider": "openai", "api_key_env": "UP_KEY", "model": "m",
        "base_url": f"http://127.0.0.1:{redirect.server_port}/v1"}])
    server = LiveServer(create_app(settings, engine=Engine(settings)), free_port()).start()
    try:
        reply = httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, "stream": stream})
        assert reply.status_code == 502
        assert "redirect" in reply.json()["error"]["message"]
        assert target.RequestHandlerClass.seen == []
    finally:
        server.stop()
        target.shutdown()
        redirect.shutdown()


class _BigNumbers(BaseHTTPRequestHandler):
    """An upstream whose stream chunk carries an integer past 64 bits."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        chunk = {"id": "c", "object": "chat.completion.chunk", "seed": 2**70,
                 "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}
        body = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_a_stream_chunk_with_a_huge_integer_is_relayed(tmp_path):
    upstream = _serve(_BigNumbers)
    settings = make_settings(tmp_path / "home", models=[{
        "name": "chat", "provider": "openai", "model": "m",
        "base_url": f"http://127.0.0.1:{upstream.server_port}/v1"}])
    server = LiveServer(create_app(settings, engine=Engine(settings)), free_port()).start()
    try:
        with httpx.stream("POST", f"{server.url}/v1/chat/completions",
                          json={**CHAT, "stream": True}) as reply:
            lines = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
        assert reply.status_code == 200
        assert json.loads(lines[0])["seed"] == 2**70
        assert lines[-1] == "[DONE]"
    finally:
        server.stop()
        upstream.shutdown()


@pytest.mark.parametrize("stream", [False, True])
def test_a_huge_integer_in_a_request_still_reaches_the_upstream(tmp_path, stream):
    """A tool schema with an integer past 64 bits (valid JSON, refused by orjson) is
    forwarded, not answered with a 500."""
    up = Upstream(name="up").start()
    settings = make_settings(tmp_path / "home", models=[{
        "name": "chat", "provider": "openai", "model": "m", "base_url": up.url}])
    server = LiveServer(create_app(settings, engine=Engine(settings)), free_port()).start()
    tool = ('{"type": "function", "function": {"name": "f", "parameters": {"type": "object", '
            '"properties": {"n": {"type": "integer", "maximum": 1180591620717411303424}}}}}')
    body = ('{"model": "chat", "max_tokens": 8, "stream": ' + json.dumps(stream)
            + ', "messages": [{"role": "user", "content": "hi"}], "tools": [' + tool + ']}')
    try:
        reply = httpx.post(f"{server.url}/v1/chat/completions", content=body,
                           headers={"content-type": "application/json"})
        assert reply.status_code == 200, reply.text
        sent = up.bodies[-1]["tools"][0]["function"]["parameters"]
        assert sent["properties"]["n"]["maximum"] == 2**70
    finally:
        server.stop()
        up.stop()


def _codeplane(home: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "CODEPLANE_HOME": str(home)}
    return subprocess.Popen([sys.executable, "-c", "from codeplane.cli import main; main()",
                             *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _wait_up(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        try:
            httpx.get(f"{url}/healthz", timeout=2)
            return
        except httpx.HTTPError:
            time.sleep(0.3)
    raise AssertionError("server did not come up")


def _worker_pids(parent: int) -> set[int]:
    """uvicorn's worker processes: spawned children of the serving process."""
    children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    return {int(pid) for pid in children
            if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")}


def test_workers_serve_one_port_within_a_deployments_max_parallel(tmp_path):
    """Two worker processes each get half of the deployment's max_parallel, so together
    they never put more than max_parallel requests on the upstream at once."""
    up = Upstream(name="slow", delay_s=0.2).start()
    home = tmp_path / "home"
    make_settings(home)
    (home / "codeplane.toml").write_text(
        f'[[models]]\nname = "chat"\nprovider = "openai"\nbase_url = "{up.url}"\n'
        'model = "m"\nmax_parallel = 2\n')
    port = free_port()
    proc = _codeplane(home, "serve", "--port", str(port), "--workers", "2",
                      "--log-level", "warning")
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_up(url, proc)
        assert len(_worker_pids(proc.pid)) == 2
        with ThreadPoolExecutor(12) as pool:
            codes = list(pool.map(
                lambda _: httpx.post(f"{url}/v1/chat/completions", json=CHAT,
                                     timeout=60).status_code, range(12)))
        assert codes == [200] * 12
        assert up.hits == 12
        assert up.max_active <= 2
    finally:
        proc.terminate()
        proc.wait(30)
        up.stop()
