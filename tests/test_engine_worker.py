"""The engine's worker processes with the real small model: a model's worker killed with
SIGKILL (what a segfault in llama.cpp or the OOM killer does) fails the request in flight with
a clear error, never the server; the next request gets a fresh worker; /metrics counts the
restart; a worker that keeps crashing is not restarted in a loop. And llama.cpp's extra buffer
types (the AMX path that crashes, issue #30) are off unless configured."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from conftest import LiveServer, free_port, make_settings
from upstreams.scripted import wait_for

from codeplane.models import engine as engine_module
from codeplane.models.engine import Engine, EngineCrashed, LocalModel
from codeplane.models.registry import ModelRegistry
from codeplane.server.app import create_app

pytestmark = pytest.mark.model

MODEL = "code-small"
COUNT = [{"role": "user", "content": "Count from 1 to 5000 in words, comma separated."}]
TAB = {"path": "calc.py", "prefix": "def add(a, b):\n    return ", "suffix": "\n",
       "max_tokens": 8, "min_confidence": 0.0}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A server with an engine of its own: its workers get killed here."""
    settings = make_settings(tmp_path_factory.mktemp("crash") / "home")
    engine = Engine(settings)
    server = LiveServer(create_app(settings, engine=engine), free_port()).start()
    yield server, engine
    server.stop()
    engine.close()


def worker_pid(engine: Engine) -> int:
    engine.info(MODEL)  # started, loaded
    pid = engine.status()[MODEL].pid
    assert pid is not None and pid != os.getpid()
    return pid


def restarts(server: LiveServer) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    line = f'codeplane_engine_worker_restarts_total{{model="{MODEL}"}} '
    return float(next(row for row in text.splitlines() if row.startswith(line)).split()[-1])


def test_kill_during_a_streaming_chat_ends_the_stream_with_an_error(served, caplog):
    server, engine = served
    pid = worker_pid(engine)
    before = restarts(server)
    body = {"model": MODEL, "max_tokens": 2000, "temperature": 0, "stream": True,
            "messages": COUNT}
    events: list[str] = []
    with (caplog.at_level(logging.INFO, logger="codeplane.engine"),
          httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                       timeout=120) as reply):
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[len("data: "):])
            if sum(map(_has_text, events)) == 1 and _has_text(events[-1]):
                os.kill(pid, signal.SIGKILL)  # the first token is out: decoding is under way
    assert sum(map(_has_text, events)) < 100  # cut short (2,000 tokens were asked for)
    assert events[-1] != "[DONE]"
    error = json.loads(events[-1])["error"]
    assert "crashed (SIGKILL)" in error["message"] and error["type"] == "server_error", error
    # the log names the cause and the worker's last output
    crash = next(r.getMessage() for r in caplog.records if "died (SIGKILL)" in r.getMessage())
    assert f"worker {pid} died" in crash and f"worker {pid}: loading model {MODEL}" in crash

    again = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "max_tokens": 4, "temperature": 0, "messages": COUNT})
    assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"]
    assert engine.status()[MODEL].pid not in (None, pid)  # a fresh worker answered
    assert restarts(server) == before + 1
    assert 'codeplane_engine_worker_crashes_total{cause="SIGKILL",model="code-small"}' in \
        httpx.get(f"{server.url}/metrics").text
    assert httpx.get(f"{server.url}/healthz").status_code == 200  # the server never went down


def _has_text(event: str) -> bool:
    chunk = json.loads(event) if event != "[DONE]" else {}
    return any(c.get("delta", {}).get("content") for c in chunk.get("choices", []))


def test_kill_during_a_tab_request_is_a_503_and_the_queued_one_runs_on_a_new_worker(served):
    server, engine = served
    pid = worker_pid(engine)
    before = restarts(server)
    replies: dict[str, httpx.Response] = {}

    def tab(cursor: str) -> threading.Thread:
        def post() -> None:
            replies[cursor] = httpx.post(f"{server.url}/v1/tab", timeout=120,
                                         json={**TAB, "cursor_id": cursor})

        thread = threading.Thread(target=post)
        thread.start()
        return thread

    os.kill(pid, signal.SIGSTOP)  # the request reaches the worker but is not answered
    try:
        first = tab("in-flight")
        wait_for(lambda: engine.status()[MODEL].job == "tab.suggest", what="for the job")
        second = tab("queued")
        wait_for(lambda: engine.status()[MODEL].waiting == 1, what="for the queued one")
    finally:
        os.kill(pid, signal.SIGKILL)
    first.join(120)
    second.join(120)
    crashed = replies["in-flight"]
    assert crashed.status_code == 503, crashed.text
    assert crashed.json()["error"]["code"] == "engine_crashed"
    assert "SIGKILL" in crashed.json()["error"]["message"]
    served_after = replies["queued"]
    assert served_after.status_code == 200 and served_after.json()["source"] == "model"
    assert restarts(server) == before + 1
    assert server._thread.is_alive()  # the server (this process) served throughout


EMBEDDER = "embedder:local:bge-small-code"  # the server's local embedder, in its own worker


def test_kill_during_an_embedding_is_a_503_and_the_next_one_runs_on_a_new_worker(served):
    """The ONNX embedder runs native code too: its worker dies, the server does not."""
    server, engine = served
    body = {"model": "default", "input": ["def add(a, b):\n    return a + b"]}
    first = httpx.post(f"{server.url}/v1/embeddings", timeout=120, json=body)
    assert first.status_code == 200, first.text
    pid = engine.status()[EMBEDDER].pid
    assert pid not in (None, os.getpid())
    replies: list[httpx.Response] = []
    os.kill(pid, signal.SIGSTOP)  # the request reaches the worker but is not answered
    try:
        post = threading.Thread(target=lambda: replies.append(
            httpx.post(f"{server.url}/v1/embeddings", timeout=120, json=body)))
        post.start()
        wait_for(lambda: engine.status()[EMBEDDER].job == "embed", what="for the job")
    finally:
        os.kill(pid, signal.SIGKILL)
    post.join(120)
    assert replies[0].status_code == 503, replies[0].text
    error = replies[0].json()["error"]
    assert error["code"] == "engine_crashed" and "SIGKILL" in error["message"], error
    again = httpx.post(f"{server.url}/v1/embeddings", timeout=120, json=body)
    assert again.status_code == 200, again.text
    assert again.json()["data"] == first.json()["data"]  # the same model, reloaded
    assert engine.status()[EMBEDDER].pid not in (None, pid)
    metrics = httpx.get(f"{server.url}/metrics").text
    assert f'codeplane_engine_worker_restarts_total{{model="{EMBEDDER}"}} 1.0' in metrics
    assert server._thread.is_alive()  # the server (this process) served throughout


def test_a_worker_that_keeps_crashing_is_not_restarted_in_a_loop(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_module, "BACKOFF_S", 30.0)
    engine = Engine(make_settings(tmp_path / "home"))
    try:
        for crash in (1, 2):
            pid = worker_pid(engine)
            os.kill(pid, signal.SIGSTOP)
            failed: list[BaseException] = []
            call = threading.Thread(target=lambda out=failed: out.extend(_crash(engine)))
            call.start()
            wait_for(lambda: engine.status()[MODEL].job == "render_chat", what="for the job")
            os.kill(pid, signal.SIGKILL)
            call.join(60)
            assert isinstance(failed[0], EngineCrashed) and failed[0].model == MODEL
            # the first crash restarts at once; the second backs off
            assert failed[0].retry_after is None if crash == 1 else failed[0].retry_after >= 29
        with pytest.raises(EngineCrashed, match="restarts in") as refused:
            engine.run_sync(MODEL, "render_chat", COUNT)
        assert refused.value.retry_after > 20
        status = engine.status()[MODEL]
        assert status.pid is None and status.restarts == 1  # no process was started for it
        assert status.crashes == {"SIGKILL": 2}
    finally:
        engine.close()


def _crash(engine: Engine) -> list[BaseException]:
    try:
        engine.run_sync(MODEL, "render_chat", COUNT)
    except EngineCrashed as exc:
        return [exc]
    return []


def test_extra_buffer_types_are_off_unless_configured(local_model, served, tmp_path):
    """Issue #30: llama.cpp's AMX buffer type segfaults on some Xeons; every model the engine
    loads disables the extra (repacking) buffer types unless `[engine]` turns them on."""
    assert local_model.llama.model_params.use_extra_bufts is False
    assert served[1].info(MODEL).extra_buffer_types is False  # as its worker loaded it
    settings = make_settings(tmp_path / "on", engine={"extra_buffer_types": True})
    model = LocalModel(ModelRegistry(settings).get(MODEL), settings)
    try:
        assert model.llama.model_params.use_extra_bufts is True
        assert model.info().extra_buffer_types is True
    finally:
        model.llama.close()


SERVER = """
import sys, time
from conftest import make_settings
from codeplane.models.engine import Engine
engine = Engine(make_settings(__import__("pathlib").Path(sys.argv[1])))
engine.info("code-small")
print(engine.status()["code-small"].pid, flush=True)
time.sleep(600)
"""


def test_a_worker_whose_server_dies_exits(tmp_path):
    """No orphans: the worker ends when its server is killed (its socket reads EOF)."""
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(tmp_path / "home")],
                              stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).parent)
    try:
        worker = int(server.stdout.readline())
        assert _running(worker)
    finally:
        server.kill()
        server.wait()
    wait_for(lambda: not _running(worker), what=f"for worker {worker} to exit")


def _running(pid: int) -> bool:
    """Alive and not a zombie (an exited worker waits for init to reap it)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status
