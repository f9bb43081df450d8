"""Keep files that contain secrets on the client.

`find_secret` runs over a whole file before it is chunked; one hit withholds every chunk of the
file (a PEM key split over chunks leaked every chunk after the header when chunks were checked
one by one). Three kinds of evidence, each checked for placeholders (`changeme`, `<token>`,
`${VAR}`, `AKIA...EXAMPLE`, `ghp_xxxx...`) before it counts:

- detect-secrets' own regex detectors (AWS, private keys, Slack, Stripe, JWT, basic auth in URLs,
  ...), called directly: its ad-hoc `scan_line` mode also runs the keyword and entropy
  heuristics, which flag ordinary lines of Python as secrets and are slow per line.
- provider formats detect-secrets lacks or matches too narrowly (OpenAI `sk-proj-`, Anthropic
  `sk-ant-api03-`, Google `AIza`, fine-grained GitHub `github_pat_`, GitLab, Hugging Face, npm,
  passwords in connection URLs, bearer tokens, every PEM private-key header: detect-secrets lists
  eight and misses `BEGIN ENCRYPTED PRIVATE KEY`).
- `NAME = value` assignments whose name ends in a secret word (`API_TOKEN=...`, `password: ...`,
  `clientSecret: '...'`), quoted or not, when the value is a literal rather than code
  (`os.environ[...]`, `settings.SECRET_KEY`, a call) and not a placeholder.

Hand-written on purpose for the last two: detect-secrets' keyword plugin only reads quoted values
in code files and has no notion of placeholders; gitleaks/trufflehog are Go binaries. Quoted
high-entropy strings alone are *not* evidence: hashes, UUID-like ids and base64 assets look the
same and made half of the look-alike corpus fail (`bench/secrets/`). Values are never logged or
returned; callers only learn the detector type.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterator
from functools import lru_cache

from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class
from detect_secrets.plugins.base import RegexBasedDetector
from detect_secrets.plugins.ip_public import IPPublicDetector

PROVIDERS: tuple[tuple[str, re.Pattern], ...] = tuple((name, re.compile(rx)) for name, rx in (
    ("OpenAI API Key", r"\bsk-(?:proj|svcacct|admin)-[A-Za-z0-9_\-]{40,}|\bsk-[A-Za-z0-9]{48}\b"),
    ("Anthropic API Key", r"\bsk-ant-(?:api|admin)\d\d-[A-Za-z0-9_\-]{80,}"),
    ("Google API Key", r"\bAIza[0-9A-Za-z_\-]{35}(?![0-9A-Za-z_\-])"),
    ("GitHub Token", r"\b(?:gh[pousr]_[A-Za-z0-9]{36}\b|github_pat_[A-Za-z0-9_]{60,})"),
    ("GitLab Token", r"\bglpat-[A-Za-z0-9_\-]{20}(?![A-Za-z0-9_\-])"),
    ("Hugging Face Token", r"\bhf_[A-Za-z0-9]{34}\b"),
    ("npm Token", r"\bnpm_[A-Za-z0-9]{36}\b"),
    ("Stripe Key", r"\b[rs]k_live_[A-Za-z0-9]{20,}\b"),
    ("Private Key", r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----"),  # any PEM flavour
    ("AWS Access Key", r"\b(?:AKIA|ASIA)[A-Z2-7]{16}\b"),
    ("Password in URL", r"\b[a-z][a-z0-9+.\-]{0,30}://[^\s:/@'\"]{1,200}:(?P<value>[^\s/'\"]{3,200})@[^\s/@'\"]"),
    ("Bearer Token", r"(?i)\bbearer\s+(?P<value>[A-Za-z0-9_\-.~+/]{16,}=*)"),
))

SECRET_NAME = re.compile(
    r"(?:password|passwd|pwd|passphrase|secret|token|api[_.\-]?key|access[_.\-]?key"
    r"|secret[_.\-]?key|private[_.\-]?key|credentials?|authorization)$", re.IGNORECASE)
ASSIGNMENT = re.compile(  # the name starts at an identifier boundary and is bounded: linear time
    r"""(?<![A-Za-z0-9_.\-])(?P<name>[A-Za-z_][A-Za-z0-9_.\-]{0,79})["']?[ \t]*(?::=|=>|=|:)[ \t]*"""
    r"""(?:(?P<q>["'`])(?P<quoted>[^"'`\n]*)(?P=q)|(?P<bare>[^\s"'`,;)\]}]+))""")
PLACEHOLDER = re.compile(
    r"change_?me|your|example|x{4,}|\*{3,}|\.\.\.|placeholder|replace|dummy|fake|test|sample"
    r"|insert|redacted|todo|not[-_ ]?a[-_ ]?real|<|>|\$\{|\{\{|%\(|^\$[A-Za-z_]|^\[.*\]$",
    re.IGNORECASE)
DOTTED = re.compile(r"[A-Za-z_]+(?:\.[A-Za-z_]+)*")  # api_key, settings.SECRET_KEY
NAME_LIKE = re.compile(r"[A-Za-z_]+")  # 'AWS_SECRET_ACCESS_KEY', 'apiKey': names, not values
CAMEL_WORDS = re.compile(r"(?:[A-Z][a-z]+)+")  # 'ExclusiveStartBackupArn'
UUID = re.compile(r"[0-9a-fA-F]{8}-(?:[0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}")
NOT_A_VALUE = re.compile(r"[\s\\]")  # prose (`"a secret"`), regexes
# unquoted only: calls and subscripts (`b64(self.key`, `auth[1]`, `{value`)
CODE = re.compile(r"""^[({\[:]|^[A-Za-z_][A-Za-z0-9_.]*[(\[](?:[\w"')\]:*\-]|$)""")
NON_SECRET_WORDS = {"none", "null", "nil", "true", "false", "undefined", "password", "secret",
                    "token", "required", "optional", "string", "str", "bytes"}


@lru_cache(maxsize=1)
def _detect_secrets_regexes() -> tuple[tuple[str, re.Pattern], ...]:
    out = []
    for cls in get_mapping_from_secret_type_to_class().values():
        if issubclass(cls, RegexBasedDetector) and cls is not IPPublicDetector:
            out += [(cls.secret_type, rx) for rx in cls().denylist]
    return tuple(out)


def _entropy(value: str) -> float:
    counts = Counter(value)
    return -sum(n / len(value) * math.log2(n / len(value)) for n in counts.values())


def is_placeholder(value: str) -> bool:
    """Documentation and template values: `changeme`, `<token>`, `${VAR}`, `xxxx`, the AWS
    docs key `AKIAIOSFODNN7EXAMPLE`, `password1`, or too few distinct characters to be
    random."""
    return (bool(PLACEHOLDER.search(value)) or len(set(value)) < 6
            or value.lower().rstrip("0123456789") in NON_SECRET_WORDS)


def _literal_secret(name: str, value: str, quoted: bool) -> bool:
    """Is the right-hand side of a `secret_name = value` a secret literal (not code, not a
    placeholder, not a word)? A UUID under a `...token` name is a request or paging id
    (`ClientRequestToken`); under a key, secret or password name it counts (Heroku keys are
    UUIDs)."""
    if len(value) < 6 or is_placeholder(value) or NOT_A_VALUE.search(value):
        return False
    if not quoted and CODE.search(value):
        return False
    if value.isdigit() and len(value) < 12:
        return False
    if NAME_LIKE.fullmatch(value) and ("_" in value or len(value) < 20
                                       or CAMEL_WORDS.fullmatch(value)):
        return False
    if DOTTED.fullmatch(value) and (not quoted or "." in value):
        return False  # a variable or attribute: `api_key`, `settings.SECRET_KEY`
    if UUID.fullmatch(value) and name.lower().endswith("token"):
        return False
    return _entropy(value) >= 2.5


def _keyword_hit(text: str) -> bool:
    for match in ASSIGNMENT.finditer(text):
        if not SECRET_NAME.search(match["name"]):
            continue
        quoted = match["quoted"] is not None
        if _literal_secret(match["name"], match["quoted"] if quoted else match["bare"], quoted):
            return True
    return False


BLOCK = 4096  # chars per scanned block
OVERLAP = 512  # a long line is cut into overlapping windows: a secret up to this long stays whole


def _blocks(text: str) -> Iterator[str]:
    r"""Whole lines grouped into blocks of about BLOCK chars, over-long lines (minified code)
    cut into overlapping windows. Some detect-secrets patterns (basic auth: `://[^{}\s]+:`)
    backtrack quadratically on one long line; bounded blocks keep a large file near linear
    (a minified line of URLs as one string took minutes: docs/indexing.md,
    "Numbers behind the code's comments")."""
    block: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
        if len(line) > BLOCK:
            yield from (line[i:i + BLOCK] for i in range(0, len(line), BLOCK - OVERLAP))
            continue
        if size + len(line) > BLOCK and block:
            yield "".join(block)
            block, size = [], 0
        block.append(line)
        size += len(line)
    if block:
        yield "".join(block)


def _find_in_block(text: str) -> str | None:
    for secret_type, rx in (*PROVIDERS, *_detect_secrets_regexes()):
        for match in rx.finditer(text):
            value = match.groupdict().get("value") or match.group(0)
            if not is_placeholder(value):
                return secret_type
    return "Secret Assignment" if _keyword_hit(text) else None


def find_secret(text: str) -> str | None:
    """The secret type found in text (e.g. "AWS Access Key"), or None. Never the value."""
    return next(filter(None, map(_find_in_block, _blocks(text))), None)
