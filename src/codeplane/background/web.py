"""The web UI at `/ui`: a runs list with a launch form, a run page that shows tool calls,
terminal output and diffs live, and a fleet page (`/ui/fleet`: the tenant's sandboxes, the
pools' sizes and hit rates). Server-rendered with Jinja2; the live part is a small plain
script (`static/app.js`, served here: no CDN, no Node build) reading the run's SSE stream and
calling the same `/v1/background-agents` API as the CLI.

Signing in stores the API key in an HttpOnly, SameSite=Strict cookie that the auth gate reads
(`server/auth.py`); pages send a Content-Security-Policy that allows only this server's own
script and style, so text from a run (which an agent, or whoever wrote the repo, controls) can
never run as script: the script inserts it with `textContent` only.
"""

from __future__ import annotations

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

UI_COOKIE = "codeplane_key"  # the signed-in key; read by the auth gate (server/auth.py)
UI_HEADER = "x-codeplane-ui"  # the gate wants it with the cookie on unsafe methods (CSRF)
STATIC = {"app.js": "text/javascript", "app.css": "text/css"}
# The gate lets these through without a key: the sign-in form, what it needs to render, and
# sign-out (it only clears the cookie, so a forged one does no harm).
PUBLIC_PATHS = frozenset({"/ui/login", "/ui/logout", *(f"/ui/static/{n}" for n in STATIC)})
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
       "img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
COOKIE_MAX_AGE = 12 * 3600
MAX_KEY = 200  # longer than any key this server issues


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

    @router.get("/ui/login")
    def login_form() -> HTMLResponse:
        return page("login.html")

    @router.post("/ui/login")
    async def login(request: Request) -> Response:
        """Check the key, then keep it in the cookie the gate reads. The one form field is
        read with the standard library: FastAPI's `Form` would add python-multipart as a
        dependency for a single urlencoded field (the body limit still applies)."""
        fields = parse_qs((await request.body()).decode("utf-8", "replace"))
        key = (fields.get("key") or [""])[0].strip()[:MAX_KEY]
        found = request.app.state.services.keys.lookup(key) if key else None
        if found is None:
            return page("login.html", error="That API key is not valid.")  # the form again
        resp = RedirectResponse("/ui", 303)
        resp.set_cookie(UI_COOKIE, key, max_age=COOKIE_MAX_AGE, httponly=True,
                        samesite="strict", secure=request.url.scheme == "https", path="/")
        return resp

    @router.post("/ui/logout")
    def logout() -> Response:
        """Clear the cookie and show the sign-in form."""
        resp = page("login.html")
        resp.delete_cookie(UI_COOKIE, path="/")
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
