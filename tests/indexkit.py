"""Helpers shared by the index tests: a server app whose requests carry a tenant.

Once the auth gate (`codeplane.server.auth`) is part of `create_app`, tenants are real: each
gets an API key created before the server starts, sent as `Authorization: Bearer`. Before it
lands, a tiny middleware puts the `Principal` where the gate will, named by `X-Test-Tenant`.
Requests without either act as the loopback tenant in both cases.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from fastapi import FastAPI, Request

from codeplane.config import Settings
from codeplane.core.principal import LOCAL_TENANT, Principal
from codeplane.server.app import create_app


def gate_present() -> bool:
    return importlib.util.find_spec("codeplane.server.auth") is not None


def tenant_app(settings: Settings) -> FastAPI:
    app = create_app(settings)
    if gate_present():
        return app

    @app.middleware("http")
    async def principal(request: Request, call_next):
        request.state.principal = Principal(request.headers.get("x-test-tenant", LOCAL_TENANT))
        return await call_next(request)

    return app


def tenant_headers(settings: Settings, tenants: list[str]) -> dict[str, dict[str, str]]:
    """Headers that make a request act as each tenant; call before the server starts (the gate
    re-reads its key file at most once a second)."""
    out: dict[str, dict[str, str]] = {LOCAL_TENANT: {}}
    for tenant in tenants:
        if not gate_present():
            out[tenant] = {"X-Test-Tenant": tenant}
            continue
        from codeplane.gateway.keys import KeyStore

        _, secret = KeyStore.from_settings(settings).create(tenant, tenant=tenant)
        out[tenant] = {"Authorization": f"Bearer {secret}"}
    return out


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
