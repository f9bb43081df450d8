"""The `openai` embedder kind (`models/embed_openai.py`, one module + one row of
`models/embedders.py`): a team's GPU server behind an OpenAI-compatible `/v1/embeddings`,
here a fake served as real loopback HTTP that returns deterministic vectors (a hashed bag of
words), used through indexing and search - embedded by the server, and by the client - and
failing as a 503, not a 500, when it answers with the wrong shape. And the embedders of one
server process: each model loads once, shared by search and the gateway."""

from __future__ import annotations

import hashlib
import re

import httpx
import numpy as np
import pytest
from conftest import LiveServer, free_port, make_settings
from indexkit import tenant_app, write
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from codeplane.indexing.query import IndexUnavailable, search_workspace
from codeplane.indexing.sync import sync
from codeplane.models.embed import EmbedderUnavailable
from codeplane.models.embedders import Embedders

DIM = 64
KEY = "gpu-team-secret"
FILES = {
    "billing/invoice.py": "def compute_invoice_total(lines, tax):\n"
                          "    \"\"\"Invoice total: sum the lines, add the sales tax.\"\"\"\n"
                          "    return sum(lines) * (1 + tax)\n",
    "utils/durations.py": "def parse_duration(text):\n"
                          "    \"\"\"Hours and minutes such as 1h30m, in seconds.\"\"\"\n"
                          "    return 3600 * int(text[0])\n",
}


def vector(text: str) -> list[float]:
    """Words hashed into DIM buckets: texts that share words point the same way."""
    v = np.zeros(DIM)
    for word in re.findall(r"[a-z]+", text.lower()):
        v[int(hashlib.sha256(word.encode()).hexdigest(), 16) % DIM] += 1
    return (v if v.any() else np.eye(DIM)[0]).tolist()


class GpuServer:
    """What the team's GPU server saw: each request's model, key and number of texts."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, int]] = []
        self.dim = DIM

    def app(self) -> Starlette:
        async def embeddings(request: Request) -> JSONResponse:
            body = await request.json()
            texts = body["input"]
            self.requests.append((body["model"], request.headers.get("authorization", ""),
                                  len(texts)))
            return JSONResponse({"object": "list", "model": body["model"], "data": [
                {"object": "embedding", "index": i, "embedding": vector(t)[:self.dim]}
                for i, t in enumerate(texts)]})

        return Starlette(routes=[Route("/v1/embeddings", embeddings, methods=["POST"]),
                                 Route("/healthz", lambda _: JSONResponse({}))])


@pytest.fixture(scope="module")
def gpu():
    fake = GpuServer()
    live = LiveServer(fake.app(), free_port()).start()
    yield fake, live.url
    live.stop()


def spec(url: str) -> dict:
    return {"kind": "openai", "base_url": f"{url}/v1", "model": "team-embed", "dim": DIM,
            "api_key_env": "TEAM_GPU_KEY"}


@pytest.fixture(scope="module")
def server(gpu, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("TEAM_GPU_KEY", KEY)
    cfg = make_settings(tmp_path_factory.mktemp("server") / "home",
                        indexing={"embedder": spec(gpu[1])})
    live = LiveServer(tenant_app(cfg), free_port()).start()
    yield live
    live.stop()
    mp.undo()


@pytest.mark.parametrize("mode", ["server", "client"])
def test_a_gpu_server_embeds_for_indexing_and_search(gpu, server, tmp_path, monkeypatch,
                                                     mode) -> None:
    fake, url = gpu
    monkeypatch.setenv("TEAM_GPU_KEY", KEY)
    fake.requests.clear()
    root = tmp_path / "shop"
    write(root, FILES)
    indexing = {"fusion": "dense"}  # the server's (dense) ranking alone: the GPU's vectors
    if mode == "client":
        indexing |= {"embed": "client", "embedder": spec(url)}
    cfg = make_settings(tmp_path / "client", server=server.url, indexing=indexing)
    embedders = Embedders(indexing.get("embedder")) if mode == "client" else None
    report = sync(root, cfg, embedders=embedders)
    assert report.chunks_embedded >= 2
    hits = search_workspace(root, "the invoice total with sales tax", 2, cfg,
                            embedders=embedders)
    assert [h["path"] for h in hits] == ["billing/invoice.py", "utils/durations.py"]
    hits = search_workspace(root, "parse hours and minutes", 2, cfg, embedders=embedders)
    assert hits[0]["path"] == "utils/durations.py"
    assert {(model, auth) for model, auth, _ in fake.requests} == {("team-embed", f"Bearer {KEY}")}
    assert sum(n for *_, n in fake.requests) == report.chunks_embedded + 2  # + two queries


def test_a_malformed_reply_is_a_503_not_vectors(gpu, server, tmp_path) -> None:
    fake, _ = gpu
    root = tmp_path / "shop"
    write(root, FILES)
    cfg = make_settings(tmp_path / "client", server=server.url)
    sync(root, cfg)
    fake.dim = 3  # vectors of the wrong size
    try:
        with pytest.raises(IndexUnavailable, match=r"shape \(1, 3\).*HTTP 503"):
            search_workspace(root, "invoice", 2, cfg)
    finally:
        fake.dim = DIM


def test_bad_settings_are_named(gpu) -> None:
    with pytest.raises(EmbedderUnavailable, match=r"indexing\.embedder\.api_key: Extra"):
        Embedders({**spec(gpu[1]), "api_key": "sk-in-the-file"})
    with pytest.raises(EmbedderUnavailable, match=r"indexing\.embedder\.base_url"):
        Embedders({**spec(gpu[1]), "base_url": "gpu:8000"})
    with pytest.raises(EmbedderUnavailable, match="'tei' is not an embedder; one of local, openai"):
        Embedders({"kind": "tei"})


def test_a_server_loads_each_embedding_model_once(tmp_path) -> None:
    """Search and the gateway's /v1/embeddings (the model by name and as `default`) share one
    instance per model, loaded by one worker process of the server's engine; a second model
    gets one more."""
    app = tenant_app(make_settings(tmp_path / "server"))
    live = LiveServer(app, free_port()).start()
    try:
        root = tmp_path / "shop"
        write(root, FILES)
        cfg = make_settings(tmp_path / "client", server=live.url)
        sync(root, cfg)
        assert search_workspace(root, "invoice total", 1, cfg)
        for model in ("default", "bge-small-code", "bge-small", "bge-small"):
            reply = httpx.post(f"{live.url}/v1/embeddings", timeout=120,
                               json={"model": model, "input": ["def add(a, b)"]})
            assert reply.status_code == 200, reply.text
        workers = {name: status for name, status in
                   app.state.services.engine.status().items() if name.startswith("embedder:")}
    finally:
        live.stop()
    assert sorted(workers) == ["embedder:local:bge-small", "embedder:local:bge-small-code"]
    assert all(s.pid is not None and s.restarts == 0 and not s.crashes
               for s in workers.values())

