"""The web UI at `/ui`: a runs list with a launch form, a run page that shows tool calls,
terminal output and diffs live, and a fleet page (`/ui/fleet`: the tenant's sandboxes, the
pools' sizes and hit rates). Server-rendered with Jinja2; the live part is a small plain
script (`static/app.js`, served here: no CDN, no Node build) reading the run's SSE stream and
calling the same `/v1/background-agents` API as the CLI.

Signing in with an API key opens a server-side session (`KeyStore.open_session`): the
browser's HttpOnly, SameSite=Strict cookie holds the session's random token, which the auth
gate (`server/auth.py`) reads; never the key. A session lasts `serve.ui_session_hours`, ends
at sign-out and when its key is revoked; the cookie is `Secure` when the request came over
https, directly or through a trusted proxy that says so. The sign-in POST must carry the
token of a sign-in form this server rendered, matched against a SameSite=Strict cookie set
with the form (a double submit): another site's page cannot sign a visitor in under the
attacker's key (login CSRF). Pages send a Content-Security-Policy that allows only this
server's own script and style, so text from a run (which an agent, or whoever wrote the
repo, controls) can never run as script: the script inserts it with `textContent` only.
"""

from __future__ import annotations

import secrets
import time
from importlib.resources import files
from typing import Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, PackageLoader, select_autoescape

from codeplane.background.routes import get_run, service_of
from codeplane.core.errors import not_found
from codeplane.core.principal import principal_of
from codeplane.sandbox.roots import Roots

UI_COOKIE = "codeplane_session"  # the session's token; read by the auth gate (server/auth.py)
FORM_COOKIE = "codeplane_login"  # the sign-in form's token, matched at sign-in (login CSRF)
UI_HEADER = "x-codeplane-ui"  # the gate wants it with the cookie on unsafe methods (CSRF)
STATIC = {"app.js": "text/javascript", "app.css": "text/css"}
# The gate lets these through without a key: the sign-in form, what it needs to render, and
# sign-out (it ends the session its cookie names, so a forged one does no harm).
PUBLIC_PATHS = frozenset({"/ui/login", "/ui/logout", *(f"/ui/static/{n}" for n in STATIC)})
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
       "img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
FORM_MAX_AGE = 3600  # a sign-in form left open longer is reloaded
MAX_FIELD = 200  # longer than any key or token this server issues


def ui_router() -> APIRouter:
    """The UI's routes, with their template environment (built once per app)."""
    router = APIRouter(include_in_schema=False)
    templates = Environment(loader=PackageLoader("codeplane.background", "templates"),
                            autoescape=select_autoescape(default=True))

    def page(name: str, **context: Any) -> HTMLResponse:
        html = templates.get_template(name).render(**context)
        return HTMLResponse(html, headers={"content-security-policy": CSP,
                                                   "cache-control": "no-store",
                                                   "x-content-type-options": "nosniff"})

    def sign_in_form(request: Request, status: int = 200, error: str = "") -> HTMLResponse:
        """The form with a fresh token in a hidden field and in a cookie: only a form this
        server rendered, in this browser, can post both (SameSite=Strict keeps the cookie
        off other sites' requests)."""
        token = secrets.token_urlsafe(24)
        resp = page("login.html", csrf=token, error=error)
        resp.status_code = status
        resp.set_cookie(FORM_COOKIE, token, max_age=FORM_MAX_AGE, path="/ui/login",
                        **_cookie_flags(request))
        return resp

    @router.get("/ui/login")
    def login_form(request: Request) -> HTMLResponse:
        return sign_in_form(request)

    @router.post("/ui/login")
    async def login(request: Request) -> Response:
        """Check the form's token and the key, then open a session for the cookie the gate
        reads. The fields are read with the standard library: FastAPI's `Form` would add
        python-multipart as a dependency for two urlencoded fields (the body limit still
        applies)."""
        fields = parse_qs((await request.body()).decode("utf-8", "replace"))
        key, token = (_field(fields, name) for name in ("key", "csrf"))
        expected = request.cookies.get(FORM_COOKIE, "")
        if not (token and expected and secrets.compare_digest(token, expected)):
            return sign_in_form(request, 403, "The sign-in form expired or came from another "
                                              "site; sign in again here.")
        keys = request.app.state.services.keys
        found = keys.lookup(key) if key else None
        if found is None:
            return sign_in_form(request, error="That API key is not valid.")
        ttl = int(request.app.state.settings.serve.ui_session_hours * 3600)
        resp = RedirectResponse("/ui", 303)
        resp.set_cookie(UI_COOKIE, keys.open_session(found, ttl), max_age=ttl, path="/",
                        **_cookie_flags(request))
        resp.delete_cookie(FORM_COOKIE, path="/ui/login", **_cookie_flags(request))
        return resp

    @router.post("/ui/logout")
    def logout(request: Request) -> Response:
        """End the session the cookie names (a copy of the cookie is worth nothing after),
        clear the cookie and show the sign-in form."""
        session = request.cookies.get(UI_COOKIE, "")[:MAX_FIELD]
        if session:
            request.app.state.services.keys.close_session(session)
        resp = sign_in_form(request)
        resp.delete_cookie(UI_COOKIE, path="/", **_cookie_flags(request))
        return resp

    @router.get("/ui")
    def runs(request: Request) -> HTMLResponse:
        principal = principal_of(request)
        roots = Roots.of(request.app.state.settings.serve, principal.tenant)
        return page("runs.html", tenant=principal.tenant,
                    runs=service_of(request).store.list(principal.tenant),
                    roots=[str(r) for r in roots.paths])

    @router.get("/ui/runs/{run_id}")
    def run_page(run_id: str, request: Request) -> HTMLResponse:
        return page("run.html", tenant=principal_of(request).tenant,
                    run=get_run(request, run_id))

    @router.get("/ui/fleet")
    def fleet(request: Request) -> HTMLResponse:
        """The caller's sandboxes (another tenant's are not listed) and the pools: totals
        over all of them, per pool only for repos the caller holds a sandbox of."""
        tenant = principal_of(request).tenant
        fleet = request.app.state.services.fleet
        boxes = sorted((b.describe() for b in fleet.list(tenant)), key=lambda b: b["created"])
        return page("fleet.html", tenant=tenant, boxes=boxes, stats=fleet.stats(tenant),
                    now=time.time())

    @router.get("/ui/static/{name}")
    def static(name: str) -> Response:
        if name not in STATIC:
            raise not_found(f"no static file {name!r}")
        body = files("codeplane.background").joinpath("static", name).read_bytes()
        return Response(body, media_type=STATIC[name],
                        headers={"x-content-type-options": "nosniff"})

    return router


def _field(fields: dict[str, list[str]], name: str) -> str:
    return (fields.get(name) or [""])[0].strip()[:MAX_FIELD]


def _cookie_flags(request: Request) -> dict[str, Any]:
    """HttpOnly, SameSite=Strict, and Secure when the request came over https (directly, or
    through a trusted proxy that says so: the gate set the scheme)."""
    return {"httponly": True, "samesite": "strict", "secure": request.url.scheme == "https"}
