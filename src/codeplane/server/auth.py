"""The trust boundary in front of every route: the auth gate and the request-body limit.

Both are pure ASGI middleware, so they run before FastAPI reads or validates a body: an
unauthenticated request gets 401 whatever its body (never a 400/422 that reveals the schema,
never a 413 that makes the server read it), and no route can opt out by forgetting a
dependency. The gate stores the caller's `Principal` in `scope["state"]`, which is what
`request.state.principal` reads.

Who needs a key (`[gateway] auth`):
- `"on"`: every request.
- `"auto"` (a laptop): requests from this machine to a loopback-bound server need none; any
  other request does. A request carrying `X-Forwarded-For`, `Forwarded` or `X-Real-IP` was
  relayed by a proxy and counts as remote, unless the peer is in `serve.trusted_proxies`;
  then the address the proxy reports decides, read from the one header it sets
  (`serve.proxy_header`), right-most entry: a proxy appends its hop after whatever the client
  sent, and passes the headers it does not set on untouched, so nothing else in them can be
  believed. Behind a trusted proxy that address is also the client's for per-IP limits and
  logs, and the scheme it reports (`X-Forwarded-Proto`, or `proto=` of `Forwarded`) is the
  request's (the UI's cookie is `Secure` behind a TLS proxy).
- `"off"`: none (loopback binds only: `check_exposure` refuses it on any other address).
A key that is sent is always checked: unknown and revoked keys get 401 in every mode. The one
exception is a server that has no active key at all, on a request it would serve without one:
OpenAI SDKs insist on sending some placeholder key, and refusing it on a keyless laptop would
protect nothing.

The web UI (`/ui`) signs in to a server-side session (`background/web.py`): its token is in an
HttpOnly, SameSite=Strict cookie (`UI_COOKIE`), read only when no header carries a key, and
stands for the session's key while the session lives (`KeyStore.session_key`). A cookie is
sent by the browser on its own, so for any method other than GET/HEAD it counts only with the
`X-Codeplane-UI` header, which a cross-site form or image cannot set (cross-site request
forgery). A browser asking for a `/ui` page without a key is sent to the sign-in page instead
of a JSON 401.
"""

from __future__ import annotations

import ipaddress
import json

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from codeplane.background.web import UI_COOKIE, UI_HEADER
from codeplane.config import ConfigError, ServeSettings
from codeplane.core.errors import APIError
from codeplane.core.principal import LOCAL_TENANT, Principal
from codeplane.gateway.keys import KeyStore
from codeplane.net import is_loopback

FORWARDED = ("x-forwarded-for", "forwarded", "x-real-ip")
SAFE_METHODS = ("GET", "HEAD")
UNAUTHORIZED = APIError(401, "a valid API key is required: send it as `Authorization: Bearer "
                             "<key>` (an operator creates one with `codeplane keys create NAME "
                             "--tenant T`)", code="invalid_api_key")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def check_exposure(serve: ServeSettings, host: str, mode: str, keys: KeyStore) -> None:
    """Refuse to listen beyond this machine unless requests there can be authenticated."""
    if is_loopback(host):
        return
    if mode == "off":
        raise ConfigError(f"refusing to listen on {host} with [gateway] auth = \"off\": anyone "
                          "who can reach the port could run code on this machine. Use "
                          "auth = \"auto\" or \"on\" and create a key with `codeplane keys "
                          "create NAME --tenant T`")
    if not keys.active():
        raise ConfigError(f"refusing to listen on {host} without an API key: create one with "
                          "`codeplane keys create NAME --tenant T` (or bind to 127.0.0.1)")


def trusted_networks(serve: ServeSettings) -> list[Network]:
    return [ipaddress.ip_network(p, strict=False) for p in serve.trusted_proxies]


class AuthGate:
    """Resolve the caller before anything else runs; answer 401 if there is none."""

    def __init__(self, app: ASGIApp, *, keys: KeyStore, mode: str, serve: ServeSettings,
                 open_paths: frozenset[str]) -> None:
        self.app, self.keys, self.mode, self.open_paths = app, keys, mode, open_paths
        self.bind_loopback = is_loopback(serve.host)
        self.trusted = trusted_networks(serve)
        self.proxy_header = serve.proxy_header

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        opened = scope["path"] in self.open_paths
        principal = None if opened else self.principal(scope)  # by the real peer, then
        self._believe_proxy(scope)
        if opened:
            await self.app(scope, receive, send)
            return
        if principal is None:
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
            elif scope["path"].startswith("/ui") and scope["method"] in SAFE_METHODS:
                await _redirect(send, "/ui/login")
            else:
                await _reply(send, UNAUTHORIZED, {"www-authenticate": "Bearer"})
            return
        scope.setdefault("state", {})["principal"] = principal
        await self.app(scope, receive, send)

    def principal(self, scope: Scope) -> Principal | None:
        headers = Headers(scope=scope)
        secret = _secret(headers)
        session = "" if secret else _session_token(scope, headers)
        key = self.keys.lookup(secret) if secret else \
            self.keys.session_key(session) if session else None
        if key is not None:
            return Principal(key.tenant, key.id, key.name)
        anonymous = self.mode == "off" or (self.mode == "auto" and self._local(scope, headers))
        if (secret or session) and not (anonymous and not self.keys.has_active()):
            return None  # a wrong or revoked key is refused, not downgraded to anonymous
        return Principal(LOCAL_TENANT) if anonymous else None

    def _local(self, scope: Scope, headers: Headers) -> bool:
        """A loopback-bound server, a loopback peer, and no proxy speaking for someone else.
        The Host header plays no part: the client chooses it."""
        if not self.bind_loopback:
            return False
        peer = (scope.get("client") or ("",))[0]
        if not is_loopback(peer):
            return False
        if not any(name in headers for name in FORWARDED):
            return True
        if not self._trusted(peer):
            return False  # relayed by a proxy we were not told to believe: remote
        return is_loopback(_forwarded_client(headers, self.proxy_header))

    def _believe_proxy(self, scope: Scope) -> None:
        """Behind a trusted proxy, the client and the scheme are what the proxy says."""
        peer = (scope.get("client") or ("",))[0]
        if not self._trusted(peer):
            return
        headers = Headers(scope=scope)
        client = _forwarded_client(headers, self.proxy_header)
        if client:
            scope["client"] = (client, 0)
        if scope["type"] == "http" and _forwarded_proto(headers, self.proxy_header) == "https":
            scope["scheme"] = "https"

    def _trusted(self, peer: str) -> bool:
        if not self.trusted:
            return False
        try:
            address = ipaddress.ip_address(peer)
        except ValueError:
            return False
        return any(address in net for net in self.trusted)


def _secret(headers: Headers) -> str:
    bearer = headers.get("authorization", "")
    if bearer[:7].lower() == "bearer ":
        bearer = bearer[7:]
    return (headers.get("x-api-key") or bearer).strip()


def _session_token(scope: Scope, headers: Headers) -> str:
    """The web UI's session token from its cookie; on unsafe methods only with the UI
    header."""
    if scope["type"] == "http" and scope["method"] not in SAFE_METHODS \
            and headers.get(UI_HEADER) != "1":
        return ""
    return Request(scope).cookies.get(UI_COOKIE, "").strip()


async def _redirect(send: Send, location: str) -> None:
    await send({"type": "http.response.start", "status": 303,
                "headers": [(b"location", location.encode()), (b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b""})


def _last_hop(headers: Headers, name: str) -> str:
    """The right-most entry of a list-valued header, over all its lines: what the nearest
    proxy added (entries to its left, and earlier lines, came from further away)."""
    return ",".join(headers.getlist(name)).rsplit(",", 1)[-1].strip()


def _forwarded_param(element: str, param: str) -> str:
    """One parameter of a `Forwarded` element (RFC 7239), unquoted."""
    for pair in element.split(";"):
        name, _, value = pair.strip().partition("=")
        if name.lower() == param:
            return value.strip().strip('"')
    return ""


def _forwarded_client(headers: Headers, proxy_header: str | None) -> str:
    """The client address the trusted proxy wrote into `proxy_header`; "" when it wrote
    none, or something that is not an address ("unknown", an obfuscated name)."""
    if proxy_header is None:
        return ""
    value = _last_hop(headers, proxy_header)
    if proxy_header == "forwarded":
        value = _forwarded_param(value, "for")
        value = value[1:value.find("]")] if value.startswith("[") else value.split(":")[0]
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        return ""


def _forwarded_proto(headers: Headers, proxy_header: str | None) -> str:
    if proxy_header == "forwarded":
        return _forwarded_param(_last_hop(headers, "forwarded"), "proto").lower()
    return _last_hop(headers, "x-forwarded-proto").lower()


class BodyTooLarge(HTTPException):
    """Raised from `receive`: FastAPI passes HTTPExceptions from body reading through to the
    error handlers (anything else would become a 400)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than {limit} bytes (serve.max_body_bytes)")


class BodyLimit:
    """413 for bodies over `limit` bytes: at once when Content-Length says so, and while
    reading when it does not (chunked uploads), so no request can make the server buffer
    more than the limit."""

    def __init__(self, app: ASGIApp, *, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            await _reply(send, APIError(413, BodyTooLarge(self.limit).detail))
            return
        seen = 0
        started = False

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise BodyTooLarge(self.limit)
            return message

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited, watch)
        except BodyTooLarge as exc:
            if started:
                raise
            await _reply(send, APIError(413, exc.detail))


async def _reply(send: Send, error: APIError, headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error.body()).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
