"""The HTTP edge under the ASGI app: slow and greedy clients, before any request exists.

uvicorn (httptools) arms no timer on a connection until its first response is sent: a client
that connects and sends part of a request, or nothing, holds a socket and a file descriptor
for as long as it likes, and about a thousand of them (`ulimit -n 1024`) make `accept()` fail
for everyone (slowloris). Middleware cannot help: the app first hears of a request once its
headers are complete. So the protocol itself is extended (`EdgeProtocol`), with limits from
`[serve]`:
- `header_timeout_s`: the request line and headers must arrive within this many seconds of
  the connection opening, or of the first byte of a later request on a kept-alive connection
  (a total deadline, not an idle timeout: trickling a byte at a time does not extend it);
  past it, 408 and close. Between requests uvicorn's keep-alive timeout applies.
- `max_header_bytes`: more before the headers end gets 431 and close (httptools has no cap).
- `max_connections` per server process and `max_connections_per_ip` per client address
  (trusted proxies' addresses excepted: every client behind them shares theirs); a
  connection past either gets 503 at once and is closed, before anything is read. The
  process cap is lowered to what the file-descriptor limit leaves room for.

A proxy-grade front (nginx, HAProxy) does the same; this keeps a bare `codeplane serve` safe.
"""

from __future__ import annotations

import asyncio
import http
import ipaddress
import json
import logging
import resource
from collections import Counter
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from codeplane.config import ServeSettings

log = logging.getLogger("codeplane.server")
FD_RESERVE = 64  # descriptors kept for the server's own files, pipes and upstream sockets

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class EdgeLimits:
    header_timeout_s: float
    max_header_bytes: int
    max_connections: int
    max_connections_per_ip: int
    uncapped: tuple[Network, ...]  # trusted proxies: no per-address cap

    @classmethod
    def from_settings(cls, serve: ServeSettings) -> EdgeLimits:
        return cls(serve.header_timeout_s, serve.max_header_bytes,
                   min(serve.max_connections, fd_room()), serve.max_connections_per_ip,
                   tuple(ipaddress.ip_network(p, strict=False) for p in serve.trusted_proxies))

    def capped(self, ip: str) -> bool:
        try:
            address = ipaddress.ip_address(ip)
        except ValueError:
            return True
        return not any(address in net for net in self.uncapped)


def fd_room() -> int:
    """Connections the file-descriptor limit leaves room for, besides the server's own:
    three quarters of it, at least `FD_RESERVE` short of it."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 30
    return max(1, min(soft * 3 // 4, soft - FD_RESERVE))


def raise_fd_limit() -> int:
    """Lift this process's soft descriptor limit to the hard one (the soft default, 1024,
    is what the audit's slowloris exhausted); returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


class EdgeConfig(uvicorn.Config):
    """uvicorn's Config with the edge's limits, which `EdgeProtocol` reads from it (uvicorn
    hands every protocol its config; a spawned worker gets both pickled). Also switches off
    uvicorn's own proxy-header rewriting: the auth gate alone decides whom to believe."""

    def __init__(self, app: Any, serve: ServeSettings, **options: Any) -> None:
        super().__init__(app, http=EdgeProtocol, proxy_headers=False, **options)
        self.edge = EdgeLimits.from_settings(serve)
        self.per_ip: Counter[str] = Counter()  # open connections by client address


class EdgeProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol plus the header deadline, header size cap and
    connection caps (module docstring)."""

    config: EdgeConfig

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._header_bytes = 0  # read while the current request was in its headers
        self._ip = self.client[0] if self.client else ""
        limits = self.config.edge
        self._counted = limits.capped(self._ip)
        if self._counted:
            self.config.per_ip[self._ip] += 1
        if len(self.connections) > limits.max_connections:
            self._refuse(503, "the server has too many open connections; retry later")
        elif self._counted and self.config.per_ip[self._ip] > limits.max_connections_per_ip:
            self._refuse(503, f"too many open connections from {self._ip}; retry later")
        else:
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._counted:
            self._counted = False
            per_ip = self.config.per_ip
            per_ip[self._ip] -= 1
            if per_ip[self._ip] <= 0:
                del per_ip[self._ip]
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Count a read toward the headers when the request was still in its headers before
        and after it (a read that begins or ends them is one read, bounded by itself; a body
        never counts), and check after the parser has taken it (a parser callback cannot
        stop it cleanly): unfinished headers held stay within the limit plus one read."""
        before = self._deadline
        super().data_received(data)
        if self._deadline is None or self._deadline is not before:
            return
        self._header_bytes += len(data)
        if self._header_bytes > self.config.edge.max_header_bytes:
            self._refuse(431, "request headers are larger than "
                              f"{self.config.edge.max_header_bytes} bytes "
                              "(serve.max_header_bytes)")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()  # a later request on a kept-alive connection: its own deadline

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def _arm(self) -> None:
        if self._deadline is None:
            self._header_bytes = 0
            self._deadline = self.loop.call_later(self.config.edge.header_timeout_s,
                                                  self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        self._refuse(408, "request headers did not arrive within "
                          f"{self.config.edge.header_timeout_s:g}s (serve.header_timeout_s)")

    def _refuse(self, status: int, message: str) -> None:
        """Answer `status` in the OpenAI error shape and close; a response already under
        way on this connection (pipelining) is cut instead of being interleaved with it."""
        self._disarm()
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:
            self.transport.write(_response(status, message))
        log.info("edge: %s from %s: %s", status, self._ip, message)
        self.transport.close()


def _response(status: int, message: str) -> bytes:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": None}}).encode()
    head = (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n"
            "content-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n")
    if status == 503:
        head += "retry-after: 1\r\n"
    return head.encode() + b"\r\n" + body
