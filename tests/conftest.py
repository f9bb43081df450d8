"""Shared fixtures: isolated CODEPLANE_HOMEs that share the real pulled weights, one engine per
test session (loading a model costs seconds; its workers are processes), one in-process model
for tests of `LocalModel`'s own logic, and a real server on a loopback port."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from codeplane.config import Settings, load_settings
from codeplane.models.engine import Engine, LocalModel
from codeplane.models.registry import ModelRegistry
from codeplane.sandbox.microvm import unavailable as microvm_unavailable
from codeplane.server.edge import EdgeConfig

WEIGHTS_HOME = Path(os.environ.get("CODEPLANE_TEST_WEIGHTS_HOME", "~/.codeplane")).expanduser()


# A tool whose call every chat model gets right: the OpenAI-compatible server's and the
# grammar's tests ask for the weather in Paris.
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}


def make_settings(home: Path, **overrides) -> Settings:
    """Settings for a fresh home whose models/ points at the shared pulled weights."""
    home.mkdir(parents=True, exist_ok=True)
    models = home / "models"
    if not models.exists():
        models.symlink_to(WEIGHTS_HOME / "models", target_is_directory=True)
    return load_settings(home=home, **overrides)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return make_settings(tmp_path / "home")


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    """An empty workspace directory (sandbox and tool tests)."""
    root = tmp_path / "ws"
    root.mkdir()
    return root


class LoopbackListener:
    """A TCP listener on the host's 127.0.0.1 that records every connection it accepts: what a
    sandbox must never reach."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.accepted: list = []
        threading.Thread(target=lambda: self.accepted.append(self.sock.accept()),
                         daemon=True).start()


@pytest.fixture
def loopback_listener():
    listener = LoopbackListener()
    yield listener
    listener.sock.close()


@pytest.fixture(scope="session")
def session_settings(tmp_path_factory) -> Settings:
    return make_settings(tmp_path_factory.mktemp("session") / "home")


@pytest.fixture(scope="session")
def engine(session_settings: Settings):
    eng = Engine(session_settings)
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def local_model(session_settings: Settings) -> LocalModel:
    """code-small loaded in the test process, for tests of the model's own logic (KV
    cache, grammar); product code reaches models through the engine's workers only."""
    model = LocalModel(ModelRegistry(session_settings).get("code-small"), session_settings)
    yield model
    model.llama.close()


class LiveServer:
    def __init__(self, app, port: int) -> None:
        self.app, self.port = app, port
        self.url = f"http://127.0.0.1:{port}"
        options = {"host": "127.0.0.1", "port": port, "log_level": "warning"}
        settings = getattr(app.state, "settings", None)  # a codeplane app: as `serve` runs it
        config = EdgeConfig(app, settings.serve, **options) if settings is not None \
            else uvicorn.Config(app, **options)  # a stand-in for something off this machine
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def start(self) -> LiveServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{self.url}/healthz", timeout=1)
                return self
            except httpx.TransportError:
                time.sleep(0.05)
        raise RuntimeError("server did not start")

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)


def bench_script(name: str):
    """A script under bench/ (e.g. "apply.py", "agent/run.py"), imported by path: the
    benchmarks are not a package."""
    path = Path(__file__).parents[1] / "bench" / name
    spec = importlib.util.spec_from_file_location(f"bench_{path.parent.name}_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def live_server(session_settings: Settings, engine: Engine):
    """One real HTTP server (all compartments mounted) sharing the session engine."""
    from codeplane.server.app import create_app

    server = LiveServer(create_app(session_settings, engine=engine), free_port()).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def pool_fleet(tmp_path_factory):
    """One sandbox fleet for the session's `pool`-backend tests (no warm pool: every test's
    repo is new, so a pool would only make sandboxes nobody asks for)."""
    from codeplane.config import FleetSettings
    from codeplane.sandbox.fleet import Fleet

    fleet = Fleet(tmp_path_factory.mktemp("pool-fleet"), FleetSettings(pool_size=0))
    yield fleet
    fleet.close()


@pytest.fixture
def open_backend(request):
    """`open(name, root)`: the workspace of `root` on the named backend, as a test parametrised
    over `BACKENDS` wants it; for `pool`, root's files are committed to a git repository and
    the sandbox comes from the session's fleet. Every workspace opened is closed after."""
    from codeplane.sandbox import Backends, BackendServices, open_workspace

    opened = []

    def open_(name: str, root: Path, network: bool = False):
        if name != "pool":
            opened.append(open_workspace(root, name, network))
            return opened[-1]
        git = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost", "-C", str(root)]
        for argv in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "files"]):
            subprocess.run([*git, *argv], check=True, capture_output=True)
        services = BackendServices(fleet=request.getfixturevalue("pool_fleet"), tenant="tests")
        opened.append(Backends(services).open(root, name, network))
        return opened[-1]

    yield open_
    for workspace in opened:
        workspace.close()


def pytest_collection_modifyitems(config, items) -> None:
    """The tests that run once per backend of the table run on `microvm` only where it can
    boot (KVM); tests/test_microvm.py covers it under emulation otherwise."""
    problem = microvm_unavailable()
    if problem is None:
        return
    skip = pytest.mark.skip(reason=f"microvm backend unavailable here: {problem}")
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and any(isinstance(v, str) and v == "microvm"
                                        for v in callspec.params.values()):
            item.add_marker(skip)


@pytest.fixture(scope="module")
def provider():
    """The scripted OpenAI-compatible model on loopback: replays tool calls, so agent runs are
    deterministic (one server per test module)."""
    from upstreams.scripted import ScriptedModel

    p = ScriptedModel()
    p.server.start()
    yield p
    p.server.stop()


@pytest.fixture
def scripted(provider):
    """The module's scripted model with an empty script and request log."""
    return provider.reset()
