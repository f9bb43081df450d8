"""The gateway's sections of codeplane.toml: `[[models]]` deployments, `[router]`, `[gateway]`.

They live here, below the gateway, so that `Settings` checks them when settings load (a bad
key is named with its line, like every other section's); the gateway reads the typed values.
A `[[models]]` entry holds the fields every provider has (`DeploymentConfig`) and the keys of
the provider it names; those keys are the provider's business, declared by the settings model
in its module (`gateway/providers/`). The program's composition root hands settings load the
provider table (`ProviderTable`: the `codeplane` command's root does, for every command), so
each entry is validated by the settings model of its kind's row: an unknown provider is
refused with the known ones, and so is a key that provider does not take. A program that
loads settings without the table gets `UncheckedDeployment`s, which the gateway checks
against the same rows before it builds them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, Protocol, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)


def _http_base(value: str) -> str:
    if not value.startswith(("http://", "https://")):
        raise ValueError(f"must start with http:// or https://: {value}")
    return value.rstrip("/")


# An OpenAI-compatible endpoint's base address in settings (a gateway deployment's, an
# embeddings server's): http(s) only, no trailing slash.
BaseUrl = Annotated[str, AfterValidator(_http_base)]

PRIORITIES = ("interactive", "agent", "background", "batch")
Priority = Literal["interactive", "agent", "background", "batch"]


class DeploymentConfig(BaseModel):
    """The fields of a `[[models]]` entry every provider has: which logical model it serves
    (`name`), under which upstream name (`model`), and the router's limits for it. A provider's
    settings model (in its module, named by its row of the provider table) subclasses this
    with `provider` fixed to its kind and the fields only it knows; any other key is
    refused."""

    model_config = {"extra": "forbid"}
    name: str = Field(min_length=1)
    provider: str
    model: str | None = None
    id: str | None = None
    rpm: int | None = Field(None, ge=1)
    tpm: int | None = Field(None, ge=1)
    timeout_s: float = Field(60.0, gt=0)
    first_token_timeout_s: float | None = Field(None, gt=0)
    max_parallel: int | None = Field(None, ge=1)
    weight: float = Field(1.0, gt=0)
    # what `/v1/models` lists for this provider's models (local ones: the engine's registry)
    capabilities: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _no_inline_key(cls, data: Any) -> Any:
        if isinstance(data, dict) and "api_key" in data:
            raise ValueError("api_key: put the key in an environment variable and name it "
                             "with api_key_env; keys never belong in the file")
        return data

    @property
    def upstream_model(self) -> str:
        return self.model or self.name

    @property
    def address(self) -> str:
        """Where the deployment's model runs, for status pages."""
        return f"local:{self.upstream_model}"

    def timeouts(self) -> bool:
        """Whether the router puts its deadlines on this deployment's calls."""
        return True

    def share(self, workers: int) -> DeploymentConfig:
        """This deployment as one of `workers` server processes runs it (its own copy)."""
        return self


class UncheckedDeployment(DeploymentConfig):
    """A `[[models]]` entry as a program loads it that did not hand settings load the
    provider table (a script, a child process): the keys every provider has are checked,
    the provider's own are kept for the gateway, which checks the entry against its row
    before it builds anything (`checked_models`)."""

    model_config = {"extra": "allow"}


class ProviderRow(Protocol):
    """A row of the gateway's provider table (`gateway/providers/table.py`), as settings
    load reads it: the settings model an entry of its kind is validated with."""

    @property
    def settings(self) -> type[DeploymentConfig]: ...


ProviderTable = Mapping[str, ProviderRow]


def _provider(entry: Any) -> Any:
    return entry.get("provider") if isinstance(entry, dict) else getattr(entry, "provider", None)


def deployment_type(providers: ProviderTable | None) -> Any:
    """The type of one `[[models]]` entry: the settings model of the provider kind it names
    (an unknown kind is refused with the known ones), or `UncheckedDeployment` without a
    table."""
    if providers is None:
        return UncheckedDeployment
    kinds = Union[tuple(Annotated[row.settings, Tag(kind)]  # noqa: UP007 (built from the table)
                        for kind, row in providers.items())]
    return Annotated[kinds, Discriminator(
        _provider, custom_error_type="unknown_provider",
        custom_error_message=f"provider must be one of {', '.join(providers)}")]


class RouterConfig(BaseModel):
    """Retry, fallback, cooldown and slow-start policy (LiteLLM-style names and defaults)."""

    model_config = {"extra": "forbid"}
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


class GatewayConfig(BaseModel):
    """Admission control: auth, priority queues, per-key and per-IP limits."""

    model_config = {"extra": "forbid"}
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
