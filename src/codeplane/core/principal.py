"""Who is asking: the tenant and API key the auth gate resolved for a request.

The gate (`server/auth.py`) stores a `Principal` on every request before any handler runs;
compartments read it with `principal_of(request)` and scope what they store and return by
`principal.tenant`. A resource another tenant owns is reported as missing (404), never as
forbidden, so ids cannot be probed.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

LOCAL_TENANT = "local"  # the one tenant of a loopback server running without keys


@dataclass(frozen=True)
class Principal:
    tenant: str
    key_id: str | None = None  # None: unauthenticated loopback use (auth = "auto", no keys)
    key_name: str | None = None


def principal_of(request: Request) -> Principal:
    """The request's principal; a route mounted outside the gate is a bug, so fail loudly."""
    principal = getattr(request.state, "principal", None)
    if principal is None:
        raise RuntimeError(f"{request.url.path} is not behind the auth gate")
    return principal
