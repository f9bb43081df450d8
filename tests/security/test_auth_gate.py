"""The auth gate, attacked over real loopback HTTP: every route of the app x {no key, wrong key,
revoked key} with auth on and with `auto` on a non-loopback bind; 401 before any body parsing;
Host-header and proxy-header spoofing; tenants on the principal; refusing to start exposed."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from conftest import LiveServer, free_port, make_settings
from fastapi import Request
from fastapi.routing import APIRoute
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from typer.testing import CliRunner

from codeplane.config import ConfigError
from codeplane.core.principal import LOCAL_TENANT, principal_of
from codeplane.gateway.keys import KeyStore
from codeplane.server.app import OPEN_PATHS, create_app
from codeplane.server.auth import check_exposure

ROUTERS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models",
           "/v1/gateway/status", "/v1/agent/runs", "/v1/index/workspaces/{ws}", "/v1/tab",
           "/v1/apply", "/metrics", "/openapi.json", "/docs", "/v1/background-agents", "/ui")


def whoami(request: Request) -> dict:
    principal = principal_of(request)
    return {"tenant": principal.tenant, "key_id": principal.key_id}


def serve(tmp_path, engine, host: str = "127.0.0.1", **gateway) -> tuple[LiveServer, dict]:
    """A live server on 127.0.0.1 that believes it is bound to `host`, with one active key
    (tenant "acme"), one revoked key, and a /whoami route added after the gate was built."""
    settings = make_settings(tmp_path / "home", gateway=gateway, serve={"host": host})
    store = KeyStore.from_settings(settings)
    _, good = store.create("ci", tenant="acme")
    _, revoked = store.create("old")
    store.revoke("old")
    app = create_app(settings, engine=engine)
    app.add_api_route("/whoami", whoami)
    server = LiveServer(app, free_port()).start()
    return server, {"good": good, "revoked": revoked}


def all_routes(routes) -> list[Route]:
    """Every endpoint, however deep: FastAPI >= 0.16x keeps an included router as one entry
    (its `original_router`), Starlette mounts keep theirs in `.routes`."""
    out = []
    for route in routes:
        nested = getattr(route, "original_router", None) or getattr(route, "app", None)
        if isinstance(route, Route | APIRoute):
            out.append(route)
        elif isinstance(route, Mount) and isinstance(route.app, StaticFiles):  # a file in it
            out.append(Route(f"{route.path}/x", lambda _: None, methods=["GET"]))
        elif nested is not None and hasattr(nested, "routes"):
            out += all_routes(nested.routes)
        else:
            raise AssertionError(f"cannot enumerate {route!r}: teach this test about it")
    return out


def requests_for(app) -> list[tuple[str, str]]:
    """(method, concrete path) for every route the app serves, parameters filled in."""
    out = []
    for route in all_routes(app.routes):
        path = re.sub(r"\{[^}]+\}", "x", route.path)
        out += [(m, path) for m in sorted(route.methods - {"HEAD"})]
    return out


@pytest.fixture
def auth_on(tmp_path, engine):
    server, keys = serve(tmp_path, engine, auth="on")
    yield server, keys
    server.stop()


@pytest.fixture
def exposed_auto(tmp_path, engine):
    server, keys = serve(tmp_path, engine, host="0.0.0.0", auth="auto")
    yield server, keys
    server.stop()


def _refused_everywhere(server: LiveServer, headers: dict) -> None:
    routes = requests_for(server.app)
    templates = {r.path for r in all_routes(server.app.routes)}
    assert set(ROUTERS) <= templates, "the enumeration must cover every router"
    for method, path in routes:
        reply = httpx.request(method, server.url + path, headers=headers, content=b"{bad json",
                              timeout=30)
        expected = 200 if path in OPEN_PATHS else 401
        if (method, path) == ("POST", "/ui/login"):
            expected = 403  # not from the sign-in form (login CSRF): refused before the key
        if expected == 401 and path.startswith("/ui") and method == "GET":
            expected = 303  # a web UI page sends the browser to its sign-in form instead
            assert reply.headers["location"] == "/ui/login"
        assert reply.status_code == expected, (method, path, reply.text[:200])
        if expected == 401:  # 401 before 400: the malformed body was never parsed
            assert reply.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("mode", ["auth_on", "exposed_auto"])
@pytest.mark.parametrize("who", ["none", "wrong", "revoked"])
def test_every_route_refuses_callers_without_a_valid_key(request, mode, who):
    server, keys = request.getfixturevalue(mode)
    headers = {"none": {}, "wrong": {"authorization": "Bearer cp-not-a-key"},
               "revoked": {"authorization": f"Bearer {keys['revoked']}"}}[who]
    _refused_everywhere(server, headers)


def test_a_valid_key_passes_and_carries_its_tenant(auth_on):
    server, keys = auth_on
    for header in ({"authorization": f"Bearer {keys['good']}"}, {"x-api-key": keys["good"]}):
        reply = httpx.get(f"{server.url}/whoami", headers=header)
        assert reply.status_code == 200
        assert reply.json()["tenant"] == "acme" and reply.json()["key_id"]
        assert httpx.get(f"{server.url}/v1/gateway/status", headers=header).status_code == 200
        assert httpx.get(f"{server.url}/openapi.json", headers=header).status_code == 200


def test_host_header_spoofing_changes_nothing(exposed_auto, tmp_path, engine):
    server, _ = exposed_auto
    for host in ("127.0.0.1", "localhost", f"127.0.0.1:{server.port}", "[::1]"):
        reply = httpx.get(f"{server.url}/whoami", headers={"host": host})
        assert reply.status_code == 401, host
    laptop, _ = serve(tmp_path / "laptop", engine)  # loopback auto: open, whatever the Host
    try:
        for host in ("evil.example", "10.0.0.7"):
            reply = httpx.get(f"{laptop.url}/whoami", headers={"host": host})
            assert reply.json() == {"tenant": LOCAL_TENANT, "key_id": None}
    finally:
        laptop.stop()


@pytest.mark.parametrize("header", [{"x-forwarded-for": "203.0.113.9"},
                                    {"x-forwarded-for": "127.0.0.1"},
                                    {"forwarded": "for=127.0.0.1"}, {"x-real-ip": "127.0.0.1"}])
def test_requests_relayed_by_an_untrusted_proxy_are_remote(tmp_path, engine, header):
    """A same-host reverse proxy connects from loopback: without `trusted_proxies` anything
    it relays needs a key, even when the relayed headers claim loopback."""
    server, keys = serve(tmp_path, engine)
    try:
        assert httpx.get(f"{server.url}/whoami").status_code == 200
        assert httpx.get(f"{server.url}/whoami", headers=header).status_code == 401
        good = {"authorization": f"Bearer {keys['good']}", **header}
        assert httpx.get(f"{server.url}/whoami", headers=good).json()["tenant"] == "acme"
    finally:
        server.stop()


def test_a_trusted_proxy_is_believed_about_the_client(tmp_path, engine):
    settings = make_settings(tmp_path / "home", serve={"trusted_proxies": ["127.0.0.0/8"],
                                                       "proxy_header": "x-forwarded-for"})
    server = LiveServer(create_app(settings, engine=engine), free_port()).start()
    try:
        remote = httpx.get(f"{server.url}/v1/models",
                           headers={"x-forwarded-for": "127.0.0.1, 203.0.113.9"})
        assert remote.status_code == 401  # the hop the proxy added is remote
        local = httpx.get(f"{server.url}/v1/models",
                          headers={"x-forwarded-for": "203.0.113.9, 127.0.0.1"})
        assert local.status_code == 200
        assert httpx.get(f"{server.url}/v1/models",
                         headers={"forwarded": 'for="[2001:db8::1]:443"'}).status_code == 401
    finally:
        server.stop()


def test_placeholder_keys_pass_only_on_a_keyless_loopback_server(tmp_path, engine):
    """OpenAI SDKs send some key; a keyless laptop accepts it as local, a server with keys
    refuses it."""
    placeholder = {"authorization": "Bearer unused"}
    keyless = LiveServer(create_app(make_settings(tmp_path / "laptop"), engine=engine),
                         free_port()).start()
    keyed, _ = serve(tmp_path, engine)
    try:
        assert httpx.get(f"{keyless.url}/v1/models", headers=placeholder).status_code == 200
        assert httpx.get(f"{keyed.url}/v1/models", headers=placeholder).status_code == 401
        assert httpx.get(f"{keyed.url}/v1/models").status_code == 200  # still a laptop
    finally:
        keyless.stop()
        keyed.stop()


def test_serve_refuses_to_listen_beyond_loopback_without_a_key(tmp_path, monkeypatch):
    from codeplane.cli import app

    home = tmp_path / "home"
    monkeypatch.setenv("CODEPLANE_HOME", str(home))
    run = CliRunner().invoke
    for host in ("0.0.0.0", "::", "192.0.2.10"):
        result = run(app, ["serve", "--host", host, "--port", str(free_port())])
        assert result.exit_code == 2, result.output
        assert "codeplane keys create NAME --tenant T" in result.output
    created = run(app, ["keys", "create", "ci", "--tenant", "acme", "--json"])
    assert json.loads(created.output)["tenant"] == "acme"
    settings = make_settings(home)
    check_exposure(settings.serve, "0.0.0.0", "auto", KeyStore.from_settings(settings))
    with pytest.raises(ConfigError, match="auth = \"off\""):
        check_exposure(settings.serve, "0.0.0.0", "off", KeyStore.from_settings(settings))
    check_exposure(settings.serve, "127.0.0.1", "off", KeyStore.from_settings(settings))
    assert run(app, ["keys", "revoke", "ci"]).exit_code == 0
    result = run(app, ["serve", "--host", "0.0.0.0", "--port", str(free_port())])
    assert result.exit_code == 2 and "keys create" in result.output


def test_tenants_default_to_the_key_name_and_old_key_files_load(tmp_path):
    settings = make_settings(tmp_path / "home")
    store = KeyStore.from_settings(settings)
    key, _ = store.create("alice")
    assert key.tenant == "alice"
    with pytest.raises(ValueError, match="tenant"):
        store.create("bob", tenant="../etc")
    legacy = {"keys": [{"id": "ab12cd34", "name": "legacy", "hash": "0" * 64, "hint": "cp-abcd",
                        "created": 0.0, "priority": "agent", "revoked": False}]}
    (settings.server_dir / "keys.json").write_text(json.dumps(legacy))
    names = [(k.name, k.tenant) for k in KeyStore.from_settings(settings).all()]
    assert names == [("legacy", "legacy"), ("alice", "alice")]  # imported into the database


def test_metrics_are_gated_unless_made_public(tmp_path, engine):
    gated, keys = serve(tmp_path / "gated", engine, auth="on")
    settings = make_settings(tmp_path / "public", gateway={"auth": "on"},
                             serve={"public_metrics": True})
    public = LiveServer(create_app(settings, engine=engine), free_port()).start()
    try:
        assert httpx.get(f"{gated.url}/metrics").status_code == 401
        assert httpx.get(f"{gated.url}/metrics",
                         headers={"x-api-key": keys["good"]}).status_code == 200
        assert httpx.get(f"{public.url}/metrics").status_code == 200
        assert httpx.get(f"{public.url}/v1/models").status_code == 401
    finally:
        gated.stop()
        public.stop()


def test_a_broken_key_file_fails_closed_not_500(tmp_path, engine, monkeypatch):
    server, keys = serve(tmp_path, engine, auth="on")
    try:
        with server.app.state.services.db.write() as conn:  # before the gate's first look
            conn.exec_driver_sql("DROP TABLE api_keys")  # a broken, unreadable key store
        reply = httpx.get(f"{server.url}/v1/models", headers={"x-api-key": keys["good"]})
        assert reply.status_code == 401  # every key refused, the server still answers
    finally:
        server.stop()
    (tmp_path / "home" / "server" / "keys.json").write_text("{not json")  # a legacy file
    monkeypatch.setenv("CODEPLANE_HOME", str(tmp_path / "home"))
    from codeplane.cli import app

    result = CliRunner().invoke(app, ["serve", "--host", "0.0.0.0", "--port", str(free_port())])
    assert result.exit_code == 2 and "keys.json is not valid JSON" in result.output


def test_docs_render_air_gapped(live_server) -> None:
    """/docs loads Swagger UI from this server, never from a CDN (air-gapped users saw a blank
    page), and the assets it names are served."""
    import re

    page = httpx.get(f"{live_server.url}/docs", timeout=30)
    assert page.status_code == 200
    urls = re.findall(r"""(?:src|href)=["']([^"']+)""", page.text)
    urls += re.findall(r"""url: ?["']([^"']+)""", page.text)
    assert urls and not [u for u in urls if re.match(r"(https?:)?//", u)], urls
    for url in urls:
        assert httpx.get(f"{live_server.url}{url}", timeout=30).status_code == 200, url
