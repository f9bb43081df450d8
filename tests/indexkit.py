"""Helpers shared by the index tests: a server app whose requests carry a tenant.

Until the auth gate lands on main, the tenant comes from an `X-Test-Tenant` header (default: the
loopback tenant) through a tiny middleware that puts the `Principal` where the gate will.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request

from codeplane.config import Settings
from codeplane.core.principal import LOCAL_TENANT, Principal
from codeplane.server.app import create_app


def tenant_app(settings: Settings) -> FastAPI:
    app = create_app(settings)

    @app.middleware("http")
    async def principal(request: Request, call_next):
        request.state.principal = Principal(request.headers.get("x-test-tenant", LOCAL_TENANT))
        return await call_next(request)

    return app


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
