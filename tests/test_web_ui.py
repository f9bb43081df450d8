"""The web UI at /ui, in a real headless Chromium (Debian's `chromium`, driven by
Playwright's Python API; never a downloaded browser) against a real server whose agent uses
the scripted model: sign in, launch, watch events appear live, stop, follow up, download the
patch. Screenshots are kept under $CODEPLANE_TEST_ARTIFACTS (or the test's tmp dir) and their
paths printed. Also the gate's cookie rules over plain HTTP."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
import test_background as shared
from upstreams.scripted import caller, run_server, ui_session, ui_sign_in

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
XSS = '<img id="injected" src="x">'
repo = shared.repo  # the same git repo fixture (the scripted model is conftest's)


@pytest.fixture
def server(provider, repo, tmp_path):
    """Keys required even on loopback (auth = "on"), so the UI has to sign in."""
    provider.reset()
    live = run_server(tmp_path / "home", provider.url, gateway={"auth": "on"},
                      workspace_roots=[str(repo.parent)])
    yield live
    live.stop()


@pytest.fixture
def artifacts(tmp_path: Path) -> Path:
    root = Path(os.environ.get("CODEPLANE_TEST_ARTIFACTS", tmp_path / "artifacts"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def test_cookie_sign_in_rules(server):
    """Unauthenticated pages redirect to sign-in; a session cookie counts, but on a POST
    only with the UI header (a cross-site form cannot set it); a bad key is refused.
    (Sessions themselves: tests/security/test_ui_sessions.py.)"""
    url = server.url
    key = caller(server)["authorization"][7:]
    assert httpx.get(url + "/ui").status_code == 303
    assert httpx.get(url + "/ui").headers["location"] == "/ui/login"
    assert httpx.get(url + "/v1/background-agents").status_code == 401
    assert httpx.get(url + "/ui/login").status_code == 200
    assert "script-src 'self'" in httpx.get(url + "/ui/login").headers["content-security-policy"]
    assert httpx.get(url + "/ui/static/app.js").status_code == 200
    wrong = ui_sign_in(url, "cp-wrong")
    assert "not valid" in wrong.text and "codeplane_session" not in wrong.cookies
    login = ui_sign_in(url, key)
    assert login.status_code == 303 and "httponly" in login.headers["set-cookie"].lower()
    assert "samesite=strict" in login.headers["set-cookie"].lower()
    jar = {"codeplane_session": login.cookies["codeplane_session"]}
    assert httpx.get(url + "/ui", cookies=jar).status_code == 200
    assert httpx.get(url + "/v1/background-agents", cookies=jar).status_code == 200
    cancel = url + "/v1/background-agents/nope/cancel"
    assert httpx.post(cancel, cookies=jar).status_code == 401  # forged cross-site POST
    assert httpx.post(cancel, cookies=jar, headers={"x-codeplane-ui": "1"}).status_code == 404
    assert httpx.get(url + "/ui", cookies={"codeplane_session": "cp-wrong"}).status_code == 303


def test_fleet_page_is_tenant_scoped(server, provider, repo):
    """A tenant's fleet page lists its own sandboxes and pool totals; another tenant's page
    shows neither those sandboxes nor the repo they came from."""
    provider.script = [shared.HANG]
    run = shared.launch(server, repo)
    jar, other = ui_session(server), ui_session(server, "t2")
    try:
        mine = httpx.get(server.url + "/ui/fleet", cookies=jar)
        assert mine.status_code == 200 and f"background {run['id']}" in mine.text
        assert str(repo) in mine.text and "All pools (1)" in mine.text
        theirs = httpx.get(server.url + "/ui/fleet", cookies=other)
        assert theirs.status_code == 200 and "No sandboxes." in theirs.text
        assert run["id"] not in theirs.text and str(repo) not in theirs.text
        assert "All pools (1)" in theirs.text  # the totals are numbers only
        api = httpx.get(server.url + "/v1/sandboxes", headers=caller(server, "t2")).json()
        assert api["data"] == [] and str(repo) not in str(api)
        assert httpx.get(server.url + "/ui/fleet").status_code == 303  # signed out
    finally:
        httpx.post(f"{server.url}/v1/background-agents/{run['id']}/cancel",
                   headers=caller(server))


def test_launch_watch_stop_follow_up_and_download_in_chromium(server, provider, repo,
                                                              artifacts, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    key = caller(server)["authorization"][7:]
    provider.script = [
        {"calls": [("create_file", {"path": "hello.txt", "content": "hello\n"})]},
        {"calls": [("run_terminal_cmd", {"command": "echo working-now; sleep 44.5"})]},
        {"content": "All done after the follow-up."}]
    shots = []
    with sync_api.sync_playwright() as play:
        browser = play.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        context = browser.new_context(accept_downloads=True,
                                      viewport={"width": 1200, "height": 900})
        page = context.new_page()
        expect = sync_api.expect

        def shot(name: str) -> None:
            path = artifacts / f"web-ui-{name}.png"
            page.screenshot(path=str(path), full_page=True)
            shots.append(path)

        try:
            page.goto(server.url + "/ui")
            expect(page).to_have_url(server.url + "/ui/login")
            page.fill("#key", "cp-not-a-key")
            page.click("#sign-in")
            expect(page.locator("#login-error")).to_be_visible()
            page.fill("#key", key)
            page.click("#sign-in")
            expect(page).to_have_url(server.url + "/ui")
            page.fill("#task", f"create hello.txt containing hello {XSS}")
            page.fill("#repo", str(repo))
            page.fill("#model", "scripted")
            shot("1-launch-form")
            page.click("#launch-button")
            page.wait_for_url("**/ui/runs/*")
            run_id = page.url.rsplit("/", 1)[1]
            # events appear as they happen: the file write, its diff, the running command
            expect(page.locator(".event.diff pre")).to_contain_text("+hello")
            expect(page.locator(".event.tool_start").nth(1)).to_contain_text("working-now")
            assert page.locator("#injected").count() == 0  # the task shows as text
            expect(page.locator(".event.turn_start")).to_contain_text(XSS)
            shot("2-run-live")
            # the fleet page (another tab, same sign-in): the run's sandbox, the pools
            fleet = context.new_page()
            fleet.set_viewport_size({"width": 1200, "height": 700})
            fleet.goto(server.url + "/ui")
            fleet.click("#nav-fleet")
            expect(fleet).to_have_url(server.url + "/ui/fleet")
            expect(fleet.locator("#sandboxes")).to_contain_text(f"background {run_id}")
            expect(fleet.locator("#sandboxes")).to_contain_text(str(repo))
            expect(fleet.locator("#pools .totals")).to_contain_text("All pools (1)")
            fleet.screenshot(path=str(artifacts / "web-ui-fleet.png"), full_page=True)
            shots.append(artifacts / "web-ui-fleet.png")
            fleet.close()
            page.click("#stop")
            expect(page.locator("#status")).to_have_text("cancelled", timeout=20_000)
            expect(page.locator(".event.tool_result").nth(1)).to_contain_text("cancel")
            shot("3-stopped")
            with page.expect_download() as download:
                page.click("#download")
            patch = Path(download.value.path()).read_text()
            assert "+++ b/hello.txt" in patch and download.value.suggested_filename == \
                f"codeplane-{run_id}.patch"
            page.fill("#follow-up-text", "say you are done")
            page.click("#send")
            expect(page.locator("#status")).to_have_text("completed", timeout=20_000)
            expect(page.locator(".event .model", has_text="All done")).to_have_count(1)
            shot("4-follow-up-done")
            page.goto(server.url + "/ui")
            expect(page.locator("#runs")).to_contain_text(run_id)
            shot("5-runs-list")
            page.click("text=Sign out")
            expect(page.locator("#key")).to_be_visible()
            page.goto(server.url + "/ui")  # the cookie is gone
            expect(page).to_have_url(server.url + "/ui/login")
        finally:
            browser.close()
            print("screenshots:", *map(str, shots), sep="\n  ")
    assert len(shots) == 6 and all(p.stat().st_size > 5000 for p in shots)
