"""Accept/reject feedback: `POST /v1/tab/feedback` on a real server on loopback with the auth
gate on, two tenants, then the Parquet rows in the event lake and the accept rate the
`codeplane events stats` command reports."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from upstreams.scripted import caller, run_server

from codeplane.events import query
from codeplane.storage import ObjectStore
from codeplane.tab import decision
from codeplane.tab.decision import Signals

pytestmark = pytest.mark.model  # the suggestions come from the real code-small

PROMPT = {"path": "m.py", "prefix": "def add(a, b):\n    return ", "suffix": "\n",
          "language": "python", "max_tokens": 8, "min_confidence": 0.0}


def suggest(url: str, headers: dict, cursor: str) -> dict:
    """A shown suggestion (the /v1/tab answer)."""
    tab = httpx.post(f"{url}/v1/tab", headers=headers, timeout=120,
                     json={**PROMPT, "cursor_id": cursor})
    assert tab.status_code == 200 and tab.json()["shown"], tab.text
    assert tab.json()["id"] and len(tab.json()["text"]) > 1, tab.text
    return tab.json()


def cli(headers: dict, *args: str) -> dict:
    env = {**os.environ, "CODEPLANE_API_KEY": headers["authorization"].split()[1]}
    out = subprocess.run([sys.executable, "-m", "codeplane", *args], capture_output=True,
                         text=True, timeout=120, check=False, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def feedback(url: str, headers: dict | None, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/tab/feedback", headers=headers, json=body, timeout=30)


def test_feedback_lands_in_the_lake_for_its_tenant_only(tmp_path: Path, engine) -> None:
    server = run_server(tmp_path / "home", None, engine=engine, gateway={"auth": "on"})
    try:
        alice, bob = caller(server, "alice"), caller(server, "bob")
        shown_first = suggest(server.url, alice, "c1")
        first, text = shown_first["id"], shown_first["text"]
        # typed-ahead serves the rest of the same suggestion: same id, not a new "shown"
        ahead = httpx.post(f"{server.url}/v1/tab", headers=alice, timeout=120, json={
            **PROMPT, "cursor_id": "c1", "prefix": PROMPT["prefix"] + text[0]}).json()
        assert ahead["source"] == "typed_ahead" and ahead["id"] == first, ahead
        # the CLI client sends the key ($CODEPLANE_API_KEY) for both calls
        source = tmp_path / "m.py"
        source.write_text(PROMPT["prefix"] + "\n")
        shown = cli(alice, "complete", str(source), "--line", "2", "--col", "12", "--json",
                    "--min-confidence", "0", "--server", server.url)
        second = shown["id"]
        assert second and second != first, shown

        assert feedback(server.url, None, id=first, outcome="accepted",
                        shown_ms=5).status_code == 401  # behind the gate
        stolen = feedback(server.url, bob, id=first, outcome="rejected", shown_ms=5)
        assert stolen.status_code == 404, stolen.text  # another tenant's suggestion
        ok = feedback(server.url, alice, id=first, outcome="accepted", shown_ms=812.5)
        assert ok.status_code == 200 and ok.json()["recorded"], ok.text
        again = feedback(server.url, alice, id=first, outcome="accepted", shown_ms=900)
        assert again.status_code == 404  # reported once
        assert cli(alice, "tab-feedback", second, "rejected", "--shown-ms", "1500",
                   "--server", server.url, "--json") == {"id": second, "outcome": "rejected",
                                                         "recorded": True}
    finally:
        server.stop()  # the shutdown flushes the event log
    store = ObjectStore.open(str(server.app.state.settings.server_dir / "objects"))
    con = query.connect(store)
    assert con.execute("SELECT tenant, suggestion_id, after_ms, language, chars > 0 "
                       "FROM tab_accepted").fetchall() == [("alice", first, 812.5, "python",
                                                            True)]
    assert con.execute("SELECT tenant, suggestion_id, after_ms FROM tab_rejected"
                       ).fetchall() == [("alice", second, 1500.0)]
    assert con.execute("SELECT count(*) FROM tab_shown").fetchone() == (2,)
    stats = query.stats(store, "alice")["tab"]
    assert (stats["shown"], stats["accepted"], stats["rejected"]) == (2, 1, 1)
    assert stats["accept_rate"] == 0.5
    assert query.stats(store, "bob")["tab"]["accepted"] == 0
    # the decision's signals are in the lake next to the outcome: enough to refit it
    columns = ", ".join(f.name for f in dataclasses.fields(Signals))
    sent = Signals(**shown_first["signals"])
    for kind in ("tab_shown", "tab_accepted"):
        row = con.execute(f"SELECT {columns}, confidence FROM {kind} WHERE suggestion_id = ?",
                          [first]).fetchone()
        assert Signals(*row[:-1]) == sent and sent.tokens > 0, (kind, row)
        assert decision.probability(Signals(*row[:-1])) == pytest.approx(row[-1], abs=2e-3)


@pytest.mark.parametrize("body, field", [
    ({"outcome": "accepted", "shown_ms": 1}, "id"),
    ({"id": "t1", "outcome": "maybe", "shown_ms": 1}, "outcome"),
    ({"id": "t1\nDROP", "outcome": "accepted", "shown_ms": 1}, "id"),
    ({"id": "t" * 65, "outcome": "accepted", "shown_ms": 1}, "id"),
    ({"id": "t1", "outcome": "accepted", "shown_ms": -1}, "shown_ms"),
    ({"id": "t1", "outcome": "accepted", "shown_ms": 1, "code": "x = 1"}, "code"),
])
def test_bad_feedback_is_a_clear_400(live_server, body: dict, field: str) -> None:
    response = httpx.post(f"{live_server.url}/v1/tab/feedback", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]["message"]


def test_unknown_suggestion_is_404(live_server) -> None:
    response = httpx.post(f"{live_server.url}/v1/tab/feedback", timeout=30,
                          json={"id": "tnever", "outcome": "rejected", "shown_ms": 3})
    assert response.status_code == 404 and "tnever" in response.json()["error"]["message"]
