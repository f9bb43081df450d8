"""The server writes its usage into the event lake: gateway usage, apply outcomes and agent
steps land as Parquet rows of the caller's tenant, with no source code in them."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from upstreams.scripted import ScriptedModel, caller, run_server, wait_end

from codeplane.events import query
from codeplane.storage import ObjectStore

pytestmark = pytest.mark.model  # one Tab request runs the real code-small


@pytest.fixture
def scripted():
    model = ScriptedModel()
    model.server.start()
    yield model
    model.server.stop()


def test_requests_land_in_the_event_lake_per_tenant(tmp_path: Path, scripted,
                                                     engine) -> None:
    roots = tmp_path / "roots"
    (roots / "ws").mkdir(parents=True)
    (roots / "ws" / "secret_code.py").write_text("TOKEN_VALUE = 'do-not-leak'\n")
    server = run_server(tmp_path / "home", scripted.url, engine=engine,
                        workspace_roots=[str(roots)])
    try:
        alice = caller(server, "alice")
        scripted.script = [{"content": "hi"}]
        chat = httpx.post(f"{server.url}/v1/chat/completions", headers=alice, timeout=30,
                          json={"model": "scripted", "messages": [{"role": "user",
                                                                   "content": "hi"}]})
        assert chat.status_code == 200, chat.text
        applied = httpx.post(f"{server.url}/v1/apply", headers=alice, timeout=30,
                             json={"path": "a.py", "original": "x = 1\n",
                                   "edit": "<<<<<<< SEARCH\nx = 1\n=======\nx = 2\n>>>>>>> REPLACE\n",
                                   "method": "deterministic"})
        assert applied.status_code == 200 and applied.json()["ok"], applied.text
        scripted.script = [{"calls": [("read_file", {"path": "secret_code.py"})]},
                           {"content": "done"}]
        run = httpx.post(f"{server.url}/v1/agent/runs", headers=alice, timeout=30,
                         json={"task": "look", "path": str(roots / "ws"), "model": "scripted",
                               "stream": False})
        assert run.status_code == 200, run.text
        wait_end(server.url, run.json()["id"], alice)
        tab = httpx.post(f"{server.url}/v1/tab", headers=alice, timeout=120, json={
            "path": "m.py", "prefix": "def add(a, b):\n    return ", "suffix": "\n",
            "language": "python", "max_tokens": 8, "min_confidence": 0.0})
        assert tab.status_code == 200 and tab.json()["shown"], tab.text
    finally:
        server.stop()  # the shutdown flushes the event log
    store_dir = server.app.state.settings.server_dir / "objects"
    store = ObjectStore.open(str(store_dir))
    con = query.connect(store)
    usage = con.execute("SELECT tenant, model, prompt_tokens + completion_tokens "
                        "FROM gateway_usage").fetchall()
    assert usage and all(row[0] == "alice" and row[1] == "scripted" for row in usage)
    assert con.execute("SELECT tenant, ok, format FROM apply_outcome").fetchall() == [
        ("alice", True, "search_replace")]
    assert con.execute("SELECT tenant, language FROM tab_shown").fetchall() == [
        ("alice", "python")]
    steps = con.execute("SELECT tool FROM agent_step WHERE tenant = 'alice'").fetchall()
    assert ("read_file",) in steps
    lake = b"".join(p.read_bytes() for p in store_dir.rglob("*.parquet"))
    assert lake and b"do-not-leak" not in lake
