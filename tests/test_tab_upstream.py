"""`/v1/tab` through a batching deployment: a real llama.cpp `llama-server` on loopback serves
Tab's model calls (token prompt, healing grammar, log-probabilities) while the service keeps
its cache and typed-ahead paths; the embedded engine never loads the model."""

from __future__ import annotations

import math
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from conftest import WEIGHTS_HOME, LiveServer, free_port, make_settings

from codeplane.config import TabSettings
from codeplane.models.engine import Engine
from codeplane.tab.backend import constrained_logprobs, healing_grammar
from codeplane.tab.service import TabRequest, TabService

LLAMA_SERVER = WEIGHTS_HOME / "bin" / "llama-server"
WEIGHTS = WEIGHTS_HOME / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"  # code-small
# ` typing` + `.O` + `pt` + `i`: healing backs off `.Opti` (dynamic healing), which needs the
# upstream's vocabulary (read through /detokenize: backend.UpstreamTab.extends)
PREFIX = "import typing\n\n\ndef parse(value: str, default: typing.Opti"


@pytest.fixture(scope="module")
def llama_server():
    if not LLAMA_SERVER.exists():
        pytest.skip(f"{LLAMA_SERVER} not built (docs/deployment.md, 'Serving many users')")
    if not WEIGHTS.exists():
        pytest.skip(f"{WEIGHTS} not pulled")
    port = free_port()
    proc = subprocess.Popen(
        [str(LLAMA_SERVER), "-m", str(WEIGHTS), "--host", "127.0.0.1", "--port", str(port),
         "-np", "2", "-cb", "-c", "4096", "-t", "1", "--no-webui"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail("llama-server did not become ready")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def serve_with_upstream(tmp_path: Path, upstream: str) -> tuple[LiveServer, Engine]:
    from codeplane.server.app import create_app

    settings = make_settings(tmp_path / "home", tab={"upstream": upstream,
                                                     "upstream_timeout_s": 600})
    engine = Engine(settings)
    return LiveServer(create_app(settings, engine=engine), free_port()).start(), engine


@pytest.mark.model
def test_tab_on_llama_server_answers_as_the_embedded_engine_with_cache_and_typed_ahead(
        llama_server, tmp_path, engine):
    body = {"path": "parse.py", "prefix": PREFIX, "suffix": "\n", "cursor_id": "u1",
            "min_confidence": 0.0, "max_tokens": 4}  # builds may differ further on
    local = TabService(engine, TabSettings()).complete_sync(TabRequest(**body))
    server, own_engine = serve_with_upstream(tmp_path, llama_server)
    try:
        first = httpx.post(f"{server.url}/v1/tab", json=body, timeout=600)
        assert first.status_code == 200, first.text
        tab = first.json()
        # the same greedy, healed answer as the embedded engine (same GGUF, same prompt)
        assert tab["source"] == "model" and tab["text"] == local.text and tab["text"], tab
        assert tab["text"].startswith("onal"), tab  # the word is whole: `typing.Optional`
        # near-equal signals: kept tokens are counted by re-tokenizing the suggestion (the two
        # llama.cpp builds may split it one token apart), and a healed token's probability is
        # renormalised over the top 20 alternatives, not the whole vocabulary
        assert abs(tab["signals"]["tokens"] - local.signals["tokens"]) <= 1
        assert tab["signals"]["first_logprob"] == pytest.approx(
            local.signals["first_logprob"], abs=0.15)
        assert tab["confidence"] == pytest.approx(local.confidence, abs=0.1)
        assert tab["completion_tokens"] > 0 and tab["prompt_tokens"] >= 15  # the whole prompt
        assert own_engine.loaded() == []  # the server's own engine never loaded the model
        again = httpx.post(f"{server.url}/v1/tab", json=body, timeout=60).json()
        assert again["source"] == "cache" and again["text"] == tab["text"]
        typed = {**body, "prefix": PREFIX + tab["text"][0]}
        ahead = httpx.post(f"{server.url}/v1/tab", json=typed, timeout=60).json()
        assert ahead["source"] == "typed_ahead" and ahead["text"] == tab["text"][1:]
        stats = httpx.get(f"{server.url}/v1/tab/stats", timeout=10).json()
        assert stats["model_calls"] == 1
    finally:
        server.stop()
        own_engine.close()


@pytest.mark.model
def test_llama_server_answers_an_indented_line_with_code(llama_server, tmp_path):
    """The code-first grammar (an indentation-only line) is accepted by llama-server and
    holds: on an indented line after a blank one the model would otherwise answer blanks
    only."""
    from test_tab_server import FIND

    text = FIND.replace("            if file_loader is not None:\n", "            \n")
    cut = text.index("            \n                break") + 12
    body = {"path": "find.py", "prefix": text[:cut], "suffix": text[cut:],
            "cursor_id": "u2", "min_confidence": 0.0}
    server, own_engine = serve_with_upstream(tmp_path, llama_server)
    try:
        got = httpx.post(f"{server.url}/v1/tab", json=body, timeout=600)
        assert got.status_code == 200, got.text
        assert got.json()["text"] and not got.json()["text"][0].isspace(), got.json()
    finally:
        server.stop()
        own_engine.close()


def test_unreachable_upstream_is_a_503_not_a_500(tmp_path):
    server, engine = serve_with_upstream(tmp_path, f"http://127.0.0.1:{free_port()}")
    try:
        reply = httpx.post(f"{server.url}/v1/tab", json={"path": "a.py", "prefix": "x = "},
                           timeout=60)
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"]["code"] == "upstream_unavailable"
        assert "/tokenize" in reply.json()["error"]["message"]
        assert engine.loaded() == []
    finally:
        server.stop()
        engine.close()


def test_healing_grammar_escapes_everything_the_user_typed():
    grammar = healing_grammar('a"] | root ::= x\\')
    literal = grammar.split('"')[1]
    assert literal.startswith("a\\U00000022\\U0000005D")  # no raw quote can end the literal
    assert grammar.count('"') == 2 and grammar.endswith("[^\\x00]*")


def test_healing_grammar_can_require_code_first():
    """At an indentation-only line nothing is backed off and the output must start with
    code: the grammar is then only that character class."""
    assert healing_grammar("", code_next=True).startswith("root ::= [^ \\t\\r\\n")
    assert healing_grammar("ab", code_next=True).startswith('root ::= "ab" [^ \\t')
    assert healing_grammar("ab") == 'root ::= "ab" [^\\x00]*'


def test_healed_logprobs_are_renormalised_over_the_allowed_alternatives():
    def tok(i: int, text: str, lp: float, top=()) -> dict:
        return {"id": i, "bytes": list(text.encode()), "logprob": lp,
                "top_logprobs": [{"id": j, "bytes": list(t.encode()), "logprob": v}
                                 for j, t, v in top]}

    probs = [tok(1, "onal", math.log(0.1), [(9, "(", math.log(0.8)),
                                            (2, "on", math.log(0.1)), (1, "onal", math.log(0.1))]),
             tok(3, "[", math.log(0.5))]
    first, second = constrained_logprobs(probs, b"on")
    assert first == pytest.approx(math.log(0.5))  # "(" is not allowed; "on" and "onal" are
    assert second == pytest.approx(math.log(0.5))  # healed: reported as is
