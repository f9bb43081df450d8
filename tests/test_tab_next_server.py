"""Next-edit Tab against the real model: superseded requests are cancelled (as FIM Tab's,
tests/test_tab_server.py), the show/hide rule hides what it says no to, and shown
suggestions and their outcomes land in the event lake with the rule's signals."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import httpx
import pytest
from test_lsp_nextedit import SHAPES
from test_tab_server import occupied
from upstreams.scripted import caller, run_server, wait_for

from codeplane.config import TabSettings
from codeplane.core.principal import LOCAL_TENANT
from codeplane.events import query
from codeplane.models.jobs import JobContext
from codeplane.models.speculative import decode
from codeplane.storage import ObjectStore
from codeplane.tab import nextedit
from codeplane.tab.nextedit import NextRequest, next_edit
from codeplane.tab.service import TabRequest, TabService

pytestmark = pytest.mark.model

TEXT = SHAPES.replace("total += area(", "total += surface(")  # the user renamed one call
RENAME = {"path": "shapes.py", "line": 8, "before": "        total += area(w, h)\n",
          "after": "        total += surface(w, h)\n"}


def body(**extra) -> dict:
    return {"path": "shapes.py", "text": TEXT, "cursor": {"line": 8, "character": 0},
            "edits": [RENAME], "max_tokens": 24, **extra}


def test_newer_next_edit_cancels_the_older_one(engine):
    """A newer next-edit request for the same document (cursor) drops the older one while
    it waits for the model; the newer one is answered."""
    svc = TabService(engine, TabSettings())
    results: dict[str, nextedit.NextResult] = {}

    def ask(name: str) -> None:
        req = NextRequest(**body(cursor_id="file:///shapes.py", request_id=name))
        results[name] = asyncio.run(next_edit(svc, req, LOCAL_TENANT))

    older = threading.Thread(target=ask, args=("older",))
    newer = threading.Thread(target=ask, args=("newer",))
    with occupied(engine):  # the model is busy: the older request queues
        older.start()
        wait_for(lambda: engine.status()["code-small"].waiting == 1, what="for the queue")
        newer.start()  # the user edited again: a newer request for the same document
        wait_for(lambda: engine.status()["code-small"].waiting == 2 or not older.is_alive(),
                 what="for the newer request")
    older.join(timeout=120)
    newer.join(timeout=300)
    assert results["older"].source == "cancelled" and results["older"].suggestion is None
    assert results["older"].prompt_tokens == 0  # dropped before touching the model
    assert results["newer"].source != "cancelled" and results["newer"].request_id == "newer"


def test_the_rule_hides_and_shown_edits_reach_the_lake(tmp_path: Path, engine, monkeypatch):
    server = run_server(tmp_path / "home", None, engine=engine)
    try:
        alice, bob = caller(server, "alice"), caller(server, "bob")
        url = f"{server.url}/v1/tab/next"
        monkeypatch.setattr(nextedit, "NEXT_MIN_PROBABILITY", 1.01)  # the rule says no
        hidden = httpx.post(url, headers=alice, json=body(), timeout=300).json()
        assert hidden["source"] == "hidden" and hidden["suggestion"] is None, hidden
        assert hidden["jump"] is None and hidden["id"] is None
        assert set(hidden["signals"]) == set(nextedit.NextSignals.__dataclass_fields__)
        monkeypatch.setattr(nextedit, "NEXT_MIN_PROBABILITY", 0.0)  # the rule says yes
        shown = httpx.post(url, headers=alice, json=body(), timeout=300).json()
        assert shown["suggestion"] and shown["id"] and shown["probability"] is not None, shown
        assert 0.0 <= shown["probability"] <= 1.0
        feedback = {"id": shown["id"], "outcome": "accepted", "shown_ms": 900}
        stolen = httpx.post(f"{server.url}/v1/tab/feedback", headers=bob, json=feedback,
                            timeout=30)
        assert stolen.status_code == 404  # another tenant cannot report on it
        took = httpx.post(f"{server.url}/v1/tab/feedback", headers=alice, json=feedback,
                            timeout=30)
        assert took.status_code == 200, took.text
        again = httpx.post(f"{server.url}/v1/tab/feedback", headers=alice, json=feedback,
                            timeout=30)
        assert again.status_code == 404  # once
        bad = httpx.post(url, headers=alice, timeout=30,
                         json={**body(), "cursor": {"line": 99, "character": 0}})
        assert bad.status_code in (400, 422)
    finally:
        server.stop()  # the shutdown flushes the event log
    con = query.connect(ObjectStore.open(str(server.app.state.settings.server_dir / "objects")))
    rows = con.execute("SELECT tenant, suggestion_id, source, probability, changed_lines, "
                       "distance FROM tab_next_shown").fetchall()
    assert rows == [("alice", shown["id"], shown["source"], shown["probability"],
                     shown["signals"]["changed_lines"], shown["signals"]["distance"])]
    accepted = con.execute("SELECT tenant, suggestion_id, after_ms, min_logprob "
                           "FROM tab_next_accepted").fetchall()
    assert accepted == [("alice", shown["id"], 900.0, shown["signals"]["min_logprob"])]
    assert con.execute("SELECT count(*) FROM tab_shown").fetchone()[0] == 0  # FIM's own


def test_decoded_logprobs_do_not_depend_on_drafting(local_model):
    """The log-probabilities the rule reads are each kept token's own: the same whether the
    token came in an accepted draft (many rows a pass) or one pass each."""
    model = local_model
    prompt = model.tokenize("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n")
    draft = model.tokenize("    return a - b\n\n\ndef mul(a, b):\n    return a * b\n")
    fast = decode(model, prompt, [draft], 16, True, logprobs=True)
    model.kv.truncate(0)
    plain = decode(model, prompt, [draft], 16, False, logprobs=True)
    assert fast.accepted > 0 and fast.text == plain.text
    assert len(fast.logprobs) == fast.output_tokens == len(plain.logprobs)
    assert fast.logprobs == pytest.approx(plain.logprobs, abs=1e-2)
    assert all(lp <= 0 for lp in fast.logprobs) and min(fast.logprobs) < -1e-6
    assert decode(model, prompt, [draft], 4, True).logprobs == []  # apply's: not asked


def test_next_edit_runs_on_the_next_model_when_one_is_set(engine):
    """`[tab] next_model` (a next-edit adapter) is the model next edit asks for; FIM's
    `model` stays. A name the engine does not know is named in the error."""
    svc = TabService(engine, TabSettings(next_model="no-such-next-model"))
    with pytest.raises(Exception, match="no-such-next-model"):
        asyncio.run(next_edit(svc, NextRequest(**body()), LOCAL_TENANT))
    answered = asyncio.run(next_edit(TabService(engine, TabSettings()),
                                     NextRequest(**body()), LOCAL_TENANT))
    assert answered.source != "cancelled"


def test_the_route_checks_the_model_next_edit_runs_on(tmp_path: Path, engine):
    """`/v1/tab/next` checks and records `[tab] next_model`, not FIM's `[tab] model`: a next
    model the engine does not know is a 404 naming it, never a 5xx."""
    from conftest import LiveServer, free_port, make_settings

    from codeplane.server.app import create_app

    settings = make_settings(tmp_path / "home", tab={"next_model": "no-such-next-model"})
    server = LiveServer(create_app(settings, engine=engine), free_port()).start()
    try:
        got = httpx.post(f"{server.url}/v1/tab/next", headers=caller(server, "alice"),
                         json=body(), timeout=60)
    finally:
        server.stop()
    assert got.status_code == 404 and "no-such-next-model" in got.text, got.text


def test_a_documents_next_request_reuses_its_prompt_across_fim(engine, local_model):
    """The second next-edit request in a document evaluates only what changed since the
    first (its newest edit and the window), though a FIM request in another file used the
    model in between: the prompt's KV is kept in the tenant's slot for the document. Another
    tenant's request for the same document reuses none of it."""
    svc = TabService(engine, TabSettings())
    doc = '    """Area of a rectangle of the given width and height, in square units."""\n'
    first_edit = {"path": "shapes.py", "line": 1, "after": doc,
                  "before": '    """Area of a rectangle."""\n'}
    text = TEXT.replace(first_edit["before"], doc)
    first = NextRequest(**{**body(), "text": text, "edits": [first_edit],
                           "cursor": {"line": 1, "character": 0}})
    second = NextRequest(**{**body(), "text": text, "edits": [first_edit, RENAME]})
    prompts = [[t for piece, control in nextedit.prompt_parts(r, r.format)[0]
                for t in local_model.tokenize(piece, special=control)] for r in (first, second)]
    shared = local_model.kv.common_prefix(*prompts)
    assert shared > 32  # the history the two share is worth a slot (slots.MIN_GAIN)
    asyncio.run(next_edit(svc, first, LOCAL_TENANT))
    fim = TabRequest(path="other.py", prefix="def double(x):\n    return ", suffix="\n")
    assert asyncio.run(svc.complete(fim, LOCAL_TENANT)).source == "model"
    again = asyncio.run(next_edit(svc, second, LOCAL_TENANT))
    assert again.prompt_tokens == len(prompts[1]) and again.cached_tokens == shared
    other = asyncio.run(next_edit(svc, second, "bob"))
    assert other.cached_tokens == 0


RUN = '''import sys


def main(args):
    print("starting")
    print("reading %d files" % len(args))
    print "parsing"
    data = parse(args)
    if not data:
        return 1
    write(data)
    return 0
'''


def test_a_rewrite_that_rejoins_the_window_stops_and_is_the_same_file(local_model):
    """Once the `window` rewrite has copied `JOIN_LINES` window lines after its change, the
    rest of the window is spliced in instead of decoded: the suggestion makes the same file
    as a full decode's, from fewer output tokens. (On this case code-small adds an import
    at the top and copies the rest; the point is the copy, not the import.)"""
    edits = [{"path": "run.py", "line": 4, "before": '    print "starting"\n',
              "after": '    print("starting")\n'},
             {"path": "run.py", "line": 5, "before": '    print "reading %d files" % len(args)\n',
              "after": '    print("reading %d files" % len(args))\n'}]
    req = NextRequest(path="run.py", text=RUN, cursor={"line": 5, "character": 0}, edits=edits,
                      format="window")
    settings = TabSettings()

    def run(join_lines: int | None) -> nextedit.Prediction:
        local_model.kv.truncate(0)
        ctx = JobContext(local_model, threading.Event(), lambda _event: None)
        return nextedit.predict(ctx, settings, req, LOCAL_TENANT, join_lines=join_lines)

    full, early = run(None), run(nextedit.JOIN_LINES)
    assert full.suggestion is not None, full.raw  # the model changes a line, copies the rest
    assert early.suggestion.apply(RUN) == full.suggestion.apply(RUN)
    assert early.completion_tokens < full.completion_tokens, (early.raw, full.raw)


MAIN = "import shapes\n\n\ndef run():\n    return shapes.area(1, 2)\n"


def test_a_rename_with_none_left_in_its_file_jumps_into_another_open_file(tmp_path: Path,
                                                                        engine):
    """The user renamed the only call in main.py; shapes.py, open beside it, still has the
    old name: the answer's jump is shapes.py's first occurrence (the `def`). The other
    file's text serves this request only: it is not in the prompt."""
    server = run_server(tmp_path / "home", None, engine=engine)
    text = MAIN.replace("shapes.area(", "shapes.surface(")
    rename = {"path": "main.py", "line": 4, "before": "    return shapes.area(1, 2)\n",
              "after": "    return shapes.surface(1, 2)\n"}
    ask = {"path": "main.py", "text": text, "cursor": {"line": 4, "character": 24},
           "edits": [rename], "max_tokens": 24,
           "open_files": [{"path": "notes.md", "text": "nothing to rename here\n"},
                          {"path": "shapes.py", "text": SHAPES}]}
    try:
        got = httpx.post(f"{server.url}/v1/tab/next", headers=caller(server, "alice"),
                         json=ask, timeout=300)
    finally:
        server.stop()
    assert got.status_code == 200, got.text
    assert got.json()["jump"] == {"path": "shapes.py", "line": 0}, got.json()
    sent = NextRequest(**ask)
    parts, _, _ = nextedit.prompt_parts(sent, sent.format)
    assert not any("def area" in piece for piece, _ in parts)


CHECK = ("def check(value1, value2):\n    if value1 is None:\n        return 'first'\n"
         "    if not value2:\n        return 'second'\n    return None\n")


def test_a_kind_of_change_answers_without_the_model(tmp_path: Path, engine):
    """`if not value1:` -> `if value1 is None:` one line above `if not value2:`: the route
    answers with that line changed alike (`tab/kinds.py`, source `parallel`), shown with an
    id, and evaluates no token: the model was not asked - nor by the pause's prefill."""
    server = run_server(tmp_path / "home", None, engine=engine)
    ask = {"path": "check.py", "text": CHECK, "cursor": {"line": 1, "character": 22},
           "edits": [{"path": "check.py", "line": 1, "before": "    if not value1:\n",
                      "after": "    if value1 is None:\n"}]}
    try:
        pre = httpx.post(f"{server.url}/v1/tab/next/prefill", headers=caller(server, "alice"),
                         json=ask, timeout=300)
        got = httpx.post(f"{server.url}/v1/tab/next", headers=caller(server, "alice"),
                         json=ask, timeout=300)
        stats = httpx.get(f"{server.url}/v1/tab/stats", headers=caller(server, "alice"),
                          timeout=30).json()
    finally:
        server.stop()
    assert got.status_code == 200, got.text
    answer = got.json()
    assert answer["suggestion"] == {"start_line": 3, "end_line": 4,
                                    "text": "    if value2 is None:\n"}, answer
    assert answer["source"] == "parallel" and answer["id"]
    assert answer["prompt_tokens"] == answer["completion_tokens"] == 0
    assert pre.status_code == 200 and pre.json()["evaluated_tokens"] == 0, pre.text
    assert stats["next_calls"] == stats["next_prefills"] == 0, stats
