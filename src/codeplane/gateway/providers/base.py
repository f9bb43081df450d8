"""What every provider implements: the services it may be given, the usage it reports, and the
one error type the router reasons about. The deployment fields it is configured with are
settings (`config/gateway.py`: `DeploymentConfig`), checked when settings load."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import orjson

if TYPE_CHECKING:
    from codeplane.core.metrics import Metrics
    from codeplane.models.embedders import Embedders
    from codeplane.models.engine import Engine

Kind = str  # "chat" | "completions" | "embeddings"


@dataclass(frozen=True)
class ProviderServices:
    """What the composition root injects into providers: the local engine and its metrics,
    and the program's embedders. A provider takes what it needs and ignores the rest."""

    engine: Engine | None = None
    metrics: Metrics | None = None
    embedders: Embedders | None = None


@dataclass(frozen=True)
class Usage:
    """Tokens one call used, as its provider reported them, and the LoRA adapter version a
    local adapter model ran with (`providers/local.py`; None: none)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    adapter: str | None = None

    @classmethod
    def of(cls, usage: Any) -> Usage | None:
        """An OpenAI `usage` object as a value (None: the upstream reported none)."""
        if not usage or not isinstance(usage, dict):
            return None
        prompt = int(usage.get("prompt_tokens") or 0)
        completion = int(usage.get("completion_tokens") or 0)
        adapter = usage.get("adapter")
        return cls(prompt, completion, int(usage.get("total_tokens") or 0),
                   adapter if isinstance(adapter, str) else None)

    def as_dict(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "total_tokens": self.total_tokens}


@dataclass(frozen=True)
class Reply:
    """A non-streaming call's answer: the OpenAI response body and the usage it reports."""

    body: dict[str, Any]
    usage: Usage | None


class UpstreamError(Exception):
    """A deployment failed. `retryable` failures (connect errors, timeouts, 5xx, 429,
    malformed responses) may go to another deployment; the rest are the client's fault and
    go back to it unchanged."""

    def __init__(self, status: int, message: str, *, retryable: bool,
                 retry_after: float | None = None, code: str | None = None,
                 type: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.retryable = status, message, retryable
        self.retry_after, self.code, self.param = retry_after, code, param
        self.type = type or ("invalid_request_error" if status < 500 and status != 429
                             else "server_error" if status != 429 else "rate_limit_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


@dataclass
class Call:
    """One client request as providers see it: the raw OpenAI body (passed through to
    OpenAI-compatible upstreams untouched) plus the validated request model (for the local
    engine and for translation)."""

    kind: Kind
    raw: dict[str, Any]
    parsed: Any
    stream: bool
    include_usage: bool = False
    request_id: str = ""
    reserved: int | None = None  # tokens the gateway holds for this call until it settles


class Provider(Protocol):
    """Built as `cls(settings, services)` from its row of `providers/table.py`."""

    async def request(self, call: Call) -> Reply:
        """Non-streaming: the whole OpenAI response body, and its usage."""

    def stream(self, call: Call) -> AsyncIterator[dict[str, Any] | Usage]:
        """Streaming: OpenAI chunk dicts, and a `Usage` when the upstream reports what the
        call used (never sent to the client: a chunk carries usage only when it asked).
        Raises UpstreamError on failure, at any point."""

    async def aclose(self) -> None:
        """Release connections."""


def json_bytes(value: Any) -> bytes:
    """Compact UTF-8 JSON. orjson because bodies and stream chunks are encoded on every
    request; json (ASCII, escaped) for what orjson refuses and a client or an upstream may
    send: integers past 64 bits, lone surrogates in strings."""
    try:
        return orjson.dumps(value)
    except TypeError:
        return json.dumps(value, separators=(",", ":")).encode()


def retry_after_seconds(value: str | None) -> float | None:
    """`Retry-After` in seconds (the HTTP-date form is rare from model APIs; ignored)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def status_error(status: int, text: str, retry_after: str | None) -> UpstreamError:
    """Map an upstream HTTP error response to an UpstreamError, keeping its message."""
    message, code, param, kind = text[:500] or f"upstream returned HTTP {status}", None, None, None
    try:
        err = json.loads(text).get("error")
        if isinstance(err, dict):
            message = str(err.get("message") or message)
            code, param, kind = err.get("code"), err.get("param"), err.get("type")
        elif isinstance(err, str):
            message = err
    except (ValueError, AttributeError):
        pass
    retryable = status >= 500 or status in (408, 409, 429)
    return UpstreamError(status, message, retryable=retryable,
                         retry_after=retry_after_seconds(retry_after), code=code,
                         param=param, type=kind if not retryable else None)
