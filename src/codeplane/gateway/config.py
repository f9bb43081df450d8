"""Gateway settings: `[[models]]` deployments, `[router]` and `[gateway]` from codeplane.toml.

`config.Settings` keeps these sections raw so the settings module does not import every
compartment; they are validated here, at server start-up, and a bad value fails with the
offending key and its line in the file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from codeplane.config import ConfigError, Settings, _line_of
from codeplane.gateway.providers.table import PROVIDERS

PRIORITIES = ("interactive", "agent", "background", "batch")
Priority = Literal["interactive", "agent", "background", "batch"]


class _Strict(BaseModel):
    model_config = {"extra": "forbid"}


# One `[[models]]` entry, validated by the settings model of the provider it names (its row
# in `providers/table.py`): an unknown provider is refused with the known ones, and so is a key
# that provider does not take.
def _provider(entry: Any) -> Any:
    return entry.get("provider") if isinstance(entry, dict) else getattr(entry, "provider", None)


AnyDeploymentConfig = Annotated[
    Union[tuple(Annotated[row.settings, Tag(kind)]  # noqa: UP007 (a union built from the table)
                for kind, row in PROVIDERS.items())],
    Discriminator(_provider, custom_error_type="unknown_provider",
                  custom_error_message=f"provider must be one of {', '.join(PROVIDERS)}")]


class RouterConfig(_Strict):
    """Retry, fallback, cooldown and slow-start policy (LiteLLM-style names and defaults)."""

    fallbacks: dict[str, list[str]] = Field(default_factory=dict)
    allowed_fails: int = Field(3, ge=1, description="consecutive failures before cooldown")
    failure_rate: float = Field(0.5, gt=0, le=1, description="cooldown at this error share...")
    failure_window: int = Field(5, ge=1, description="...over at least this many requests/min")
    cooldown_s: float = Field(5.0, gt=0)
    slow_start_s: float = Field(30.0, ge=0, description="ramp time after a recovery")
    slow_start_parallel: int = Field(16, ge=1,
                                     description="parallel cap a recovered deployment ramps to "
                                                 "when it has no max_parallel")
    first_token_timeout_s: float = Field(30.0, gt=0)
    stream_idle_timeout_s: float = Field(60.0, gt=0)


class GatewayConfig(_Strict):
    """Admission control: auth, priority queues, per-key and per-IP limits."""

    auth: Literal["auto", "on", "off"] = "auto"
    default_priority: Priority = "agent"
    max_inflight: int = Field(256, ge=1, description="parallel requests per model without "
                                                     "max_parallel deployments")
    queue: dict[str, int] = Field(default_factory=lambda: {
        "interactive": 256, "agent": 128, "background": 64, "batch": 32})
    queue_timeout_s: dict[str, float] = Field(default_factory=lambda: {
        "interactive": 30.0, "agent": 300.0, "background": 300.0, "batch": 120.0})
    share: dict[str, float] = Field(default_factory=lambda: {
        "interactive": 1.0, "agent": 1.0, "background": 0.75, "batch": 0.5})
    ip_rpm: int | None = Field(None, ge=1)
    ip_tpm: int | None = Field(None, ge=1)

    @field_validator("queue", "queue_timeout_s", "share", mode="before")
    @classmethod
    def _classes(cls, value: Any, info) -> Any:
        if not isinstance(value, dict):
            return value
        bad = set(value) - set(PRIORITIES)
        if bad:
            raise ValueError(f"unknown priority class {min(bad)!r}; "
                             f"use {', '.join(PRIORITIES)}")
        defaults = cls.model_fields[info.field_name].default_factory()
        return {**defaults, **value}


class Config(_Strict):
    models: list[AnyDeploymentConfig] = Field(default_factory=list)
    router: RouterConfig = Field(default_factory=RouterConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)

    @model_validator(mode="after")
    def _fallbacks_known(self) -> Config:
        ids = [d.id for d in self.models if d.id]
        if len(ids) != len(set(ids)):
            raise ValueError("duplicate deployment id in [[models]]")
        return self


def load(settings: Settings) -> Config:
    """Validate the raw sections; ConfigError names key and line on bad input."""
    raw = {"models": settings.models, "router": settings.router, "gateway": settings.gateway}
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, settings.config_file)) from None


def _describe(exc: ValidationError, path: Path | None) -> str:
    text = path.read_text().splitlines() if path and path.is_file() else []
    lines = [f"invalid gateway settings in {path or 'CODEPLANE_* environment'}:"]
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        if loc[:1] == ["models"] and len(loc) > 2 and loc[2] in PROVIDERS:
            del loc[2]  # the union's tag: the entry's own `provider` already says it
        key = ".".join(loc)
        msg = err["msg"].removeprefix("Value error, ")
        where = _locate(text, loc)
        lines.append(f"  {key}{f' (line {where})' if where else ''}: {msg}")
    return "\n".join(lines)


def _locate(text: list[str], loc: list[str]) -> int | None:
    """Line of a key: inside the n-th `[[models]]` table, or inside `[router]`/`[gateway]`."""
    if not loc:
        return None
    if loc[0] == "models" and len(loc) > 1 and loc[1].isdigit():
        headers = [i for i, line in enumerate(text) if re.match(r"^\s*\[\[\s*models\s*\]\]", line)]
        index = int(loc[1])
        if index >= len(headers):
            return None
        start = headers[index]
        end = next((i for i, line in enumerate(text[start + 1:], start + 1)
                    if re.match(r"^\s*\[", line)), len(text))
        key = next((p for p in reversed(loc[2:]) if not p.isdigit()), None)
        found = _line_of(text[start:end], key) if key else None
        return start + found if found else start + 1
    found = None
    for part in loc:
        found = _line_of(text, part) or found
    return found


def where(settings: Settings, key: str) -> str:
    """` (line N)` for a key in the settings file, for checks made after validation."""
    path = settings.config_file
    text = path.read_text().splitlines() if path and path.is_file() else []
    line = _line_of(text, key)
    return f" (line {line})" if line else ""
