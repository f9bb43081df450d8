"""Slow and greedy clients at the HTTP edge (audit 2026-11-28, M3: slowloris.py), over real
loopback sockets: partial requests are closed once `serve.header_timeout_s` has passed even
while they trickle bytes, oversized headers get 431, and connections past the per-address and
per-server caps are refused at once, while /healthz keeps answering other clients.

Time bounds here are generous (three times the configured timeout): they catch a server that
never closes, not a slow machine."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time

import httpx
import pytest
from conftest import LiveServer, free_port, make_settings
from upstreams.scripted import wait_for

from codeplane.server.app import create_app

TIMEOUT_S = 2.0
PARTIAL = b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
FULL = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


def start(tmp_path, **serve) -> LiveServer:
    settings = make_settings(tmp_path / "home", serve=serve)
    return LiveServer(create_app(settings), free_port()).start()


def connect(port: int, source: str = "127.0.0.1", send: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10,
                                    source_address=(source, 0))
    if send:
        sock.sendall(send)
    return sock


def healthz(url: str, source: str = "127.0.0.1") -> int:
    transport = httpx.HTTPTransport(local_address=source)
    with httpx.Client(transport=transport, timeout=10) as client:
        return client.get(f"{url}/healthz").status_code


def trickle_until_closed(socks: list[socket.socket], bound_s: float,
                         silent: list[socket.socket] = ()) -> dict[int, bytes]:
    """Send one header byte to every open socket but the `silent` ones every 0.2 s (a
    slowloris never stops sending) until the server has closed them all; what each
    received. Fails at `bound_s`."""
    socks = [*socks, *silent]
    got = {s.fileno(): b"" for s in socks}
    open_ = {s.fileno(): s for s in socks}
    deadline = time.monotonic() + bound_s
    while open_:
        assert time.monotonic() < deadline, f"{len(open_)} partial requests still open"
        for sock in open_.values():
            if sock in silent:
                continue
            try:
                sock.send(b"X")
            except OSError:
                pass  # closed by the server: the read below sees the end
        readable, _, _ = select.select(list(open_.values()), [], [], 0.2)
        for sock in readable:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                data = b""
            got[sock.fileno()] += data
            if not data:
                del open_[sock.fileno()]
    return got


def test_partial_requests_are_closed_while_healthz_answers(tmp_path):
    server = start(tmp_path, header_timeout_s=TIMEOUT_S)
    partial = [connect(server.port, send=PARTIAL) for _ in range(40)]
    silent = [connect(server.port) for _ in range(10)]  # connect, then never send a byte
    kept_alive = connect(server.port, send=FULL)  # a full request, then a trickled one
    kept_alive.recv(65536)
    kept_alive.sendall(PARTIAL)
    socks = [*partial, *silent, kept_alive]
    try:
        assert healthz(server.url) == 200  # while all of them are held
        got = trickle_until_closed([*partial, kept_alive], 3 * TIMEOUT_S, silent)
        assert all(got[s.fileno()].startswith(b"HTTP/1.1 408") for s in partial + silent)
        assert b"HTTP/1.1 408" in got[kept_alive.fileno()]
        assert healthz(server.url) == 200
    finally:
        for sock in socks:
            sock.close()
        server.stop()


def test_oversized_headers_get_431(tmp_path):
    server = start(tmp_path, max_header_bytes=8192)
    sock = connect(server.port, send=PARTIAL + b"X-Junk: " + b"a" * 9000 + b"\r\n")
    try:
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 431")
        headers = {"x-long": "a" * 4000}  # below the limit: served
        assert httpx.get(f"{server.url}/healthz", headers=headers).status_code == 200
        with httpx.Client() as client:  # a large body is no header, however it is read
            for _ in range(3):
                big = client.post(f"{server.url}/healthz", content=b"x" * 1_000_000)
                assert big.status_code == 405, big.text[:200]
    finally:
        sock.close()
        server.stop()


def refused(sock: socket.socket) -> bool:
    """The server answered 503 and closed before the client sent anything. (The server
    accepts connections in the order they were made, so the ones before count already.)"""
    reply = b""
    while chunk := sock.recv(65536):
        reply += chunk
    return reply.startswith(b"HTTP/1.1 503")


@pytest.mark.parametrize("caps, held_from, refused_from, still_served", [
    ({"max_connections_per_ip": 4}, ["127.0.0.1"] * 4, "127.0.0.1", "127.0.0.2"),
    ({"max_connections": 6, "max_connections_per_ip": 100},
     [f"127.0.0.{2 + i}" for i in range(6)], "127.0.0.9", None),
], ids=["per-address", "per-process"])
def test_connections_past_a_cap_are_refused_at_once(tmp_path, caps, held_from, refused_from,
                                                    still_served):
    server = start(tmp_path, **caps)
    held = [connect(server.port, source=source) for source in held_from]
    try:
        assert refused(connect(server.port, source=refused_from))
        if still_served:  # another client is served meanwhile
            assert healthz(server.url, source=still_served) == 200
        for sock in held:
            sock.close()
        wait_for(lambda: healthz(server.url, source=refused_from) == 200,
                 what="served again once the connections are gone")
    finally:
        for sock in held:
            sock.close()
        server.stop()


def test_codeplane_serve_closes_partial_requests(tmp_path):
    """The same edge in front of `codeplane serve` (not only the tests' server)."""
    home = tmp_path / "home"
    make_settings(home)  # the shared weights
    (home / "codeplane.toml").write_text(f"[serve]\nheader_timeout_s = {TIMEOUT_S}\n")
    port = free_port()
    env = {**os.environ, "CODEPLANE_HOME": str(home)}
    proc = subprocess.Popen([sys.executable, "-m", "codeplane", "serve", "--port", str(port),
                             "--log-level", "warning"], env=env)
    try:
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            assert proc.poll() is None, "codeplane serve exited"
            try:
                return healthz(url) == 200
            except httpx.TransportError:
                return False

        wait_for(up, timeout=120, what="for codeplane serve")
        sock = connect(port, send=PARTIAL)
        got = trickle_until_closed([sock], 3 * TIMEOUT_S)
        assert got[sock.fileno()].startswith(b"HTTP/1.1 408")
        sock.close()
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize("bad", [{"header_timeout_s": 0}, {"max_connections": 0},
                                 {"max_connections_per_ip": -1}, {"max_header_bytes": 100}])
def test_edge_settings_are_validated(tmp_path, bad):
    from codeplane.config import ConfigError

    with pytest.raises(ConfigError, match=next(iter(bad))):
        make_settings(tmp_path / "home", serve=bad)
