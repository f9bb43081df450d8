"""The web UI's sign-in (audit 2026-11-28, L3: auth_matrix.py, bottom part), over real loopback
HTTP: the cookie is a server-side session, not the API key; sessions expire, end at sign-out
and with their key; the cookie is `Secure` behind a TLS proxy; a sign-in POST that did not
come from the sign-in form (login CSRF) is refused."""

from __future__ import annotations

import hashlib
import re
import time

import httpx
import pytest
from conftest import LiveServer, free_port, make_settings
from sqlalchemy import select, update
from upstreams.scripted import ui_sign_in as sign_in

from codeplane.gateway.keys import KeyStore
from codeplane.server.app import create_app
from codeplane.storage.tables import ui_sessions

SESSION, FORM = "codeplane_session", "codeplane_login"


def start(tmp_path, **serve) -> tuple[LiveServer, str]:
    settings = make_settings(tmp_path / "home", gateway={"auth": "on"}, serve=serve)
    _, key = KeyStore.from_settings(settings).create("alice", tenant="acme")
    return LiveServer(create_app(settings), free_port()).start(), key


@pytest.fixture
def server(tmp_path):
    live, key = start(tmp_path, ui_session_hours=2)
    yield live, key
    live.stop()


def form_token(url: str) -> tuple[str, str]:
    """The sign-in form's hidden token and the cookie that came with it."""
    page = httpx.get(f"{url}/ui/login")
    assert page.status_code == 200
    return re.search(r'name="csrf" value="([^"]+)"', page.text).group(1), page.cookies[FORM]


def session_of(reply: httpx.Response) -> str:
    assert reply.status_code == 303, reply.text[:300]
    return reply.cookies[SESSION]


def signed_in(url: str, session: str) -> bool:
    reply = httpx.get(f"{url}/ui", cookies={SESSION: session})
    assert reply.status_code in (200, 303)
    return reply.status_code == 200


def test_the_cookie_is_a_session_not_the_key(server):
    live, key = server
    reply = sign_in(live.url, key)
    session = session_of(reply)
    assert session != key and key not in reply.headers["set-cookie"]
    cookie = reply.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie and "max-age=7200" in cookie
    assert "secure" not in cookie  # plain http, no proxy
    assert signed_in(live.url, session)
    assert httpx.get(f"{live.url}/v1/background-agents",
                     cookies={SESSION: session}).status_code == 200
    for name in (SESSION, "codeplane_key"):  # the key itself is no cookie
        assert httpx.get(f"{live.url}/ui", cookies={name: key}).status_code == 303
    with live.app.state.services.db.read() as conn:  # stored hashed, never as sent
        rows = conn.execute(select(ui_sessions)).all()
    assert [r.id for r in rows] == [hashlib.sha256(session.encode()).hexdigest()]


def test_sessions_expire(server):
    live, key = server
    session = session_of(sign_in(live.url, key))
    assert signed_in(live.url, session)
    with live.app.state.services.db.write() as conn:  # two hours later
        conn.execute(update(ui_sessions).values(expires=time.time() - 1))
    assert not signed_in(live.url, session)
    session_of(sign_in(live.url, key))  # a new sign-in drops what has expired
    with live.app.state.services.db.read() as conn:
        assert len(conn.execute(select(ui_sessions)).all()) == 1


def test_sign_out_ends_the_session(server):
    live, key = server
    session = session_of(sign_in(live.url, key))
    other = session_of(sign_in(live.url, key))  # another browser
    out = httpx.post(f"{live.url}/ui/logout", cookies={SESSION: session})
    assert out.status_code == 200 and f'{SESSION}=""' in out.headers["set-cookie"]
    assert not signed_in(live.url, session)  # a copy of the cookie is worth nothing now
    assert signed_in(live.url, other)


def test_revoking_the_key_ends_its_sessions(server):
    live, key = server
    session = session_of(sign_in(live.url, key))
    KeyStore.from_settings(live.app.state.settings).revoke("alice")
    assert not signed_in(live.url, session)


def test_the_cookie_is_secure_behind_a_tls_proxy(tmp_path):
    live, key = start(tmp_path, trusted_proxies=["127.0.0.1"], proxy_header="x-forwarded-for")
    try:
        proxied = {"x-forwarded-for": "203.0.113.9", "x-forwarded-proto": "https"}
        reply = sign_in(live.url, key, proxied)
        assert session_of(reply) and "secure" in reply.headers["set-cookie"].lower()
        form = httpx.get(f"{live.url}/ui/login", headers=proxied)
        assert "secure" in form.headers["set-cookie"].lower()
        plain = sign_in(live.url, key, {"x-forwarded-for": "203.0.113.9"})
        assert "secure" not in plain.headers["set-cookie"].lower()
    finally:
        live.stop()


def test_a_sign_in_that_did_not_come_from_the_form_is_refused(server):
    """Login CSRF: another site's page posts its own key to /ui/login, signing the victim in
    as the attacker. Its form cannot carry the sign-in form's cookie (SameSite=Strict), so
    a field without the matching cookie counts for nothing."""
    live, key = server
    url = f"{live.url}/ui/login"
    field, cookie = form_token(live.url)
    attempts = [({"key": key}, {}),  # no token at all
                ({"key": key, "csrf": field}, {}),  # a token, but no cookie: cross-site
                ({"key": key, "csrf": "forged"}, {"cookie": f"{FORM}={cookie}"})]
    for data, headers in attempts:
        reply = httpx.post(url, data=data, headers=headers)
        assert reply.status_code == 403 and SESSION not in reply.cookies, data
    with live.app.state.services.db.read() as conn:
        assert conn.execute(select(ui_sessions)).all() == []
