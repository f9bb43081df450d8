"""Forwarded headers behind a trusted proxy (audit 2026-11-28, M2: proxy_spoof.sh), over real
loopback HTTP with `[gateway] auth = "auto"`, where a request the gate takes for local needs no
key. Only the header the operator names (`serve.proxy_header`) is believed, and only its
right-most entry (the hop the proxy added); any other forwarded header a client sends is
passed through by a proxy that does not set it, so it must count for nothing."""

from __future__ import annotations

import httpx
import pytest
from conftest import LiveServer, free_port, make_settings

from codeplane.config import ConfigError
from codeplane.server.app import create_app

REMOTE, LOCAL = "203.0.113.9", "127.0.0.1"
XFF, REAL, FWD = "x-forwarded-for", "x-real-ip", "forwarded"
CASES = [
    # the audit's cases: the proxy sets X-Real-IP / Forwarded, the client adds X-Forwarded-For
    (REAL, [(REAL, REMOTE), (XFF, LOCAL)], 401),
    (FWD, [(FWD, f"for={REMOTE}"), (XFF, LOCAL)], 401),
    (REAL, [(XFF, LOCAL)], 401),  # the named header is missing: the client is unknown
    (XFF, [(REAL, LOCAL)], 401),
    (XFF, [(FWD, f"for={LOCAL}")], 401),
    # the proxy appended the client's address after what the client sent
    (XFF, [(XFF, f"{LOCAL}, {REMOTE}")], 401),
    (XFF, [(XFF, LOCAL), (XFF, REMOTE)], 401),  # ... as a second header line
    (FWD, [(FWD, f"for={LOCAL}, for={REMOTE}")], 401),
    (FWD, [(FWD, f"for={LOCAL}"), (FWD, f"for={REMOTE};proto=https")], 401),
    (REAL, [(REAL, LOCAL), (REAL, REMOTE)], 401),
    (FWD, [(FWD, 'for="[2001:db8::1]:443"')], 401),
    (FWD, [(FWD, "for=unknown")], 401),
    # what the proxy itself says about a client on this machine
    (XFF, [(XFF, f"{REMOTE}, {LOCAL}")], 200),
    (REAL, [(REAL, LOCAL)], 200),
    (FWD, [(FWD, f"for={REMOTE}, for={LOCAL}")], 200),
    (FWD, [(FWD, 'for="[::1]:5000"')], 200),
    (XFF, [], 200),  # no proxy in between: a loopback client
]


def behind_proxy(tmp_path, engine, header: str) -> LiveServer:
    settings = make_settings(tmp_path / "home", gateway={"auth": "auto"},
                             serve={"trusted_proxies": ["127.0.0.1"], "proxy_header": header})
    return LiveServer(create_app(settings, engine=engine), free_port()).start()


@pytest.mark.parametrize("header", [XFF, REAL, FWD])
def test_only_the_named_header_is_believed_and_only_its_last_hop(tmp_path, engine, header):
    server = behind_proxy(tmp_path, engine, header)
    try:
        for named, sent, expected in CASES:
            if named != header:
                continue
            reply = httpx.get(f"{server.url}/v1/models", headers=sent)
            assert reply.status_code == expected, (header, sent)
    finally:
        server.stop()


def test_trusting_a_proxy_needs_the_name_of_the_header_it_sets(tmp_path):
    with pytest.raises(ConfigError, match="proxy_header"):
        make_settings(tmp_path / "home", serve={"trusted_proxies": ["127.0.0.1"]})
    with pytest.raises(ConfigError, match="proxy_header"):
        make_settings(tmp_path / "other", serve={"trusted_proxies": ["127.0.0.1"],
                                                 "proxy_header": "x-client-ip"})
