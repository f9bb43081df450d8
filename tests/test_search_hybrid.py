"""Hybrid search end to end: a real client and a real server (FastAPI + LanceDB + bge-small) over
loopback HTTP; the client fuses the server's dense hits with its local BM25 index, ranks files
with `--files`, and finds definitions by name. Dense-only runs of the same queries show what
the lexical side adds."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import LiveServer, free_port, make_settings

from codeplane.agent import toolset as T
from codeplane.agent.env import local_environment
from codeplane.agent.services import tool_services
from codeplane.agent.tools import default_toolset
from codeplane.indexing.lexical import Shape, analyse, defines, path_match
from codeplane.indexing.query import search
from codeplane.indexing.rank import (
    CHUNK_WEIGHTS,
    FILE_WEIGHTS,
    Weights,
    fuse_chunks,
    is_documentation,
    is_test,
    rank_files,
)
from codeplane.indexing.sync import sync
from codeplane.server.app import create_app

execute = default_toolset().execute  # one call as the agent makes it

KINDS = ("refund", "invoice", "payout", "dispute", "charge", "subscription", "transfer", "coupon")
HOOKS = {f"hooks/{kind}.py": f'''def on_{kind}_event(event, store):
    """Record a {kind} notification sent by the payment provider and acknowledge it."""
    store.save(event.id, event.payload)
    return {{"ok": True}}
''' for kind in KINDS}
SHOP = {
    **HOOKS,
    "CHANGES.md": """## 2.1

- Coupon notifications from the payment provider are acknowledged once per event.
""",
    "hooks/dedupe.py": '''SEEN_WINDOW_S = 600


def already_seen(store, event_id):
    return store.has(event_id, within=SEEN_WINDOW_S)
''',
    "net/redirects.py": '''def follow_redirects(response, session, limit=10):
    """Follow HTTP redirects until a final response, giving up after too many of them."""
    seen = 0
    while response.is_redirect:
        seen += 1
        if seen > limit:
            raise RuntimeError("too many redirects")
        response = session.get(response.headers["location"])
    return response
''',
    "net/hops.py": '''from net.errors import TooManyHops

MAX_HOPS = 8


def walk(relay, start):
    path = [start]
    while relay.next(path[-1]) is not None:
        if len(path) >= MAX_HOPS:
            raise TooManyHops(len(path))
        path.append(relay.next(path[-1]))
    return path
''',
    "net/errors.py": '''class TooManyHops(Exception):
    """A relay chain longer than allowed."""
''',
    "billing/invoice.py": '''from decimal import Decimal


def compute_invoice_total(lines, tax_rate):
    """Sum line items and add sales tax, rounding to cents."""
    subtotal = sum(Decimal(l.price) * l.quantity for l in lines)
    return (subtotal * (1 + Decimal(tax_rate))).quantize(Decimal("0.01"))
''',
    "billing/sku.py": '''def normalise_sku_code(raw):
    """Upper-case a stock keeping unit and strip separators."""
    return raw.replace("-", "").replace(" ", "").upper()
''',
    "orders/intake.py": '''from billing.sku import normalise_sku_code


def accept(order):
    order.sku = normalise_sku_code(order.sku)
    order.alt = normalise_sku_code(order.alt or "")
    return order


def reject(order):
    order.sku = normalise_sku_code(order.sku)
    return None
''',
    "orders/returns.py": '''from billing.sku import normalise_sku_code


def restock(item):
    return normalise_sku_code(item.sku), normalise_sku_code(item.batch)
''',
}


@pytest.fixture(scope="module")
def shop(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hybrid")
    server_cfg = make_settings(tmp / "server-home")
    live = LiveServer(create_app(server_cfg), free_port()).start()
    root = tmp / "shop"
    for rel, text in SHOP.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    cfg = make_settings(tmp / "client-home", server=live.url)
    sync(root, cfg)
    dense_cfg = make_settings(tmp / "client-home", server=live.url, indexing={"fusion": "dense"})
    yield root, cfg, dense_cfg
    live.stop()


def test_a_constant_named_in_a_request_finds_its_file_where_dense_alone_does_not(shop) -> None:
    root, cfg, dense_cfg = shop
    query = "payment provider notifications are recorded twice: widen SEEN_WINDOW_S"
    dense = search(root, query, 3, dense_cfg, files=True).results
    hybrid = search(root, query, 3, cfg, files=True).results
    assert "hooks/dedupe.py" not in [r["path"] for r in dense]  # eight look-alike handlers win
    assert hybrid[0]["path"] == "hooks/dedupe.py"


def test_files_mode_returns_each_file_once_with_its_best_chunk(shop) -> None:
    root, cfg, _ = shop
    rows = search(root, "normalise_sku_code", 10, cfg, files=True).results
    paths = [r["path"] for r in rows]
    assert len(paths) == len(set(paths))
    assert paths[0] == "billing/sku.py"
    assert "def normalise_sku_code" in rows[0]["snippet"]


def test_an_identifier_query_ranks_its_definition_above_its_call_sites(shop) -> None:
    root, cfg, _ = shop
    top = search(root, "normalise_sku_code", 3, cfg).results[0]
    assert (top["path"], top["start_line"]) == ("billing/sku.py", 1)


def test_prose_queries_still_rank_by_meaning(shop) -> None:
    root, cfg, _ = shop
    top = search(root, "add sales tax to the sum of line items", 3, cfg).results[0]
    assert top["path"] == "billing/invoice.py"


def test_code_only_drops_the_changelog_that_repeats_the_request(shop) -> None:
    """`--code`: where in the code would the change go, not which notes mention it."""
    root, cfg, _ = shop
    query = "acknowledge coupon notifications from the payment provider once per event"
    everything = [r["path"] for r in search(root, query, 10, cfg, files=True).results]
    code = [r["path"] for r in search(root, query, 10, cfg, files=True, code=True).results]
    assert "CHANGES.md" in everything
    assert "CHANGES.md" not in code and code[0] == "hooks/coupon.py"
    assert all(p.endswith(".py") for p in code)


def test_cli_files_flag_and_path_outside_the_current_directory(shop, tmp_path) -> None:
    """The README's `codeplane search "..." --path ~/src/myrepo` must work from anywhere."""
    root, cfg, _ = shop
    env = {**os.environ, "CODEPLANE_HOME": str(cfg.home), "CODEPLANE_SERVER": cfg.server}
    done = subprocess.run([sys.executable, "-m", "codeplane", "search", "TooManyHops raised",
                           "--path", str(root), "--files", "--json", "--limit", "2"],
                          check=False, cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "net/" in done.stdout.split('"path"', 2)[1]
    inside = subprocess.run([sys.executable, "-m", "codeplane", "search", "TooManyHops",
                             "--path", str(root / "billing"), "--json"],
                            check=False, cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert inside.returncode == 0, inside.stderr
    assert "net/" not in inside.stdout


def test_agent_codebase_search_can_rank_files(shop) -> None:
    root, cfg, _ = shop
    res = execute(local_environment(root), "codebase_search",
                  {"query": "where would a change to normalise_sku_code go", "files": True},
                  T.ToolContext(services=tool_services(cfg)))
    heads = [line.split(":")[0] for line in res.output.splitlines() if " (score " in line]
    assert res.ok and "billing/sku.py" in heads
    assert len(heads) == len(set(heads)) == res.data["count"]  # one entry per file


def test_query_shapes() -> None:
    assert analyse("normalise_sku_code").shape == Shape.IDENTIFIER
    assert analyse("Add type annotation for `Request.hooks`").shape == Shape.MIXED
    assert analyse("bump QX_TTL for sessions").shape == Shape.MIXED
    assert analyse("Releases the connection back to the pool.").shape == Shape.PROSE
    assert "the" not in analyse("fix the config loader").terms


def test_path_and_definition_signals() -> None:
    q = analyse("config loading ignores `from_prefixed_env`")
    assert path_match(q, "src/flask/config.py") == 1.0
    assert path_match(q, "src/config/app.py") == 0.5
    assert path_match(q, "src/flask/app.py") == 0.0
    assert defines(q, "    def from_prefixed_env(self, prefix):\n        ...") == 1.0
    assert defines(q, "    app.config.from_prefixed_env()") == 0.0


def test_fusion_mixes_normalised_lists_and_ranks_files() -> None:
    q = analyse("parse the retry header")
    dense = [(("a.py", 1, 5), 0.81), (("b.py", 1, 9), 0.80), (("c.py", 3, 4), 0.60)]
    lexical = [(("b.py", 1, 9), 12.0), (("d.py", 1, 2), 9.0), (("e.py", 1, 2), 1.0)]
    w = Weights(dense=0.5, lexical=0.5, define=0.0, second=0.0, path=0.0)
    fused = fuse_chunks(q, dense, lexical, lambda key: None, w)
    assert fused[0][0] == ("b.py", 1, 9)  # second by meaning, first by words: best together
    assert {k for k, _ in fused} == {("a.py", 1, 5), ("b.py", 1, 9), ("c.py", 3, 4),
                                      ("d.py", 1, 2), ("e.py", 1, 2)}
    assert [k for k, _ in fused].index(("d.py", 1, 2)) > 1
    withheld = fuse_chunks(q, dense, lexical, lambda key: None, w,
                           unembedded=frozenset({("d.py", 1, 2)}))
    assert withheld[1][0] == ("d.py", 1, 2)  # no dense score to lose: its lexical one stands in
    files = rank_files(q, [(("x/retry.py", 1, 2), 0.5), (("y.py", 1, 2), 0.55)],
                       Weights(dense=1, lexical=0, define=0, second=0, path=0.2))
    assert files[0][0] == "x/retry.py"  # its name says "retry"


def ranked_files(q, dense: list) -> list[str]:
    """Files ranked as `search --files` ranks them, from dense hits alone."""
    w = FILE_WEIGHTS[q.shape]
    return [path for path, _, _ in rank_files(q, fuse_chunks(q, dense, [], lambda key: None, w), w)]


def test_file_ranking_puts_the_code_above_a_changelog_that_repeats_the_request() -> None:
    """A changelog entry restates the request word for word, so its chunk outscores the code
    that has to change; in file ranking documentation is demoted, not dropped."""
    q = analyse("retry the request when the server sends Retry-After")
    chunks = [(("CHANGES.rst", 10, 14), 0.95), (("docs/usage.md", 1, 9), 0.9),
              (("src/client/retries.py", 20, 48), 0.6), (("src/client/auth.py", 1, 30), 0.2)]
    files = ranked_files(q, chunks)
    assert files[0] == "src/client/retries.py"
    assert set(files) == {"CHANGES.rst", "docs/usage.md", "src/client/retries.py",
                          "src/client/auth.py"}  # still there, below the code it matched
    assert files.index("CHANGES.rst") < files.index("src/client/auth.py")
    assert [is_documentation(p) for p in ("README", "docs/api.rst", "HISTORY.md",
                                          "LICENSE.txt", "notes.txt")] == [True] * 5
    assert [is_documentation(p) for p in ("src/readers.py", "requirements-dev.txt",
                                          "pyproject.toml", "docs/conf.py", "app/history.py",
                                          "licenses/")] == [False] * 6


def test_file_ranking_puts_the_code_above_tests_that_name_the_behaviour() -> None:
    """A test named after the behaviour (`test_retry_after_header`) matches a request's words
    better than the code that implements it; with tests indexed, tests held 40% of the top 5."""
    q = analyse("retry the request when the server sends Retry-After")
    chunks = [(("tests/test_retries.py", 5, 30), 0.97), (("src/client/retries_test.go", 1, 9), 0.93),
              (("web/retry.spec.ts", 1, 9), 0.9), (("src/client/retries.py", 20, 48), 0.6),
              (("src/client/auth.py", 1, 30), 0.2)]
    files = ranked_files(q, chunks)
    assert files[0] == "src/client/retries.py"
    assert len(files) == 5  # demoted, not dropped
    assert files.index("tests/test_retries.py") < files.index("src/client/auth.py")
    top = fuse_chunks(q, chunks, [], lambda key: None, CHUNK_WEIGHTS[q.shape])[0][0]
    assert top == ("src/client/retries.py", 20, 48)  # chunk search (no --files) too
    asked = analyse("the tests of retrying when the server sends Retry-After")
    assert ranked_files(asked, chunks)[0] == "tests/test_retries.py"  # asked for: not demoted
    assert [is_test(p) for p in ("tests/test_a.py", "pkg/tests/data.json", "test_cli.py",
                                 "pkg/a_test.go", "web/a.test.ts", "src/test/java/FooTest.java",
                                 "conftest.py", "spec/models/user_spec.rb")] == [True] * 8
    assert [is_test(p) for p in ("src/flask/testing.py", "numpy/testing/utils.py", "latest.py",
                                 "contest.py", "testdata.py", "docs/tests.rst")] == [False] * 6

