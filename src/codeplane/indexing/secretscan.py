"""Keep chunks that contain secrets on the client.

Uses detect-secrets' own detectors (every regex-based plugin: AWS, private keys, GitHub, Slack,
Stripe, JWT, ...) and its Shannon-entropy plugins on quoted strings. We call the plugins
directly instead of `detect_secrets.core.scan.scan_line`: that ad-hoc mode also runs the keyword
and IP heuristics and flagged ~4 "secrets" per ordinary line of Python at ~1.3 ms per line, which
would withhold most code and take minutes on a large repo. Values are never logged or returned;
callers only learn the detector type.
"""

from __future__ import annotations

import re
from functools import lru_cache

from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class
from detect_secrets.plugins.base import RegexBasedDetector
from detect_secrets.plugins.high_entropy_strings import (
    Base64HighEntropyString,
    HexHighEntropyString,
)
from detect_secrets.plugins.ip_public import IPPublicDetector

# Long quoted tokens are the only candidates for the entropy plugins (same charset as theirs).
QUOTED = re.compile(r"""(['"])([A-Za-z0-9+/\\\-_=]{20,})\1""")


@lru_cache(maxsize=1)
def _regex_detectors() -> tuple[tuple[str, re.Pattern], ...]:
    out = []
    for cls in get_mapping_from_secret_type_to_class().values():
        if issubclass(cls, RegexBasedDetector) and cls is not IPPublicDetector:
            out += [(cls.secret_type, rx) for rx in cls().denylist]
    return tuple(out)


@lru_cache(maxsize=1)
def _entropy_plugins() -> tuple:
    return (Base64HighEntropyString(), HexHighEntropyString())


def find_secret(text: str) -> str | None:
    """The secret type found in text (e.g. "AWS Access Key"), or None. Never the value."""
    for secret_type, rx in _regex_detectors():
        if rx.search(text):
            return secret_type
    for match in QUOTED.finditer(text):
        candidate = match.group(2)
        for plugin in _entropy_plugins():
            if plugin.regex.fullmatch(match.group(0)) is None:
                continue
            if plugin.calculate_shannon_entropy(candidate) > plugin.entropy_limit:
                return plugin.secret_type
    return None
