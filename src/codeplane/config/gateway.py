"""The gateway's sections of codeplane.toml: `[[models]]` deployments, `[router]`, `[gateway]`.

They live here, below the gateway, so that `Settings` checks them when settings load (a bad
key is named with its line, like every other section's); the gateway reads the typed values.
A `[[models]]` entry is validated by the settings model of the provider it names (its row of
`DEPLOYMENTS`): an unknown provider is refused with the known ones, and so is a key that
provider does not take. The classes those settings build are the gateway's
(`gateway/providers/table.py`).
"""

from __future__ import annotations

import os
from typing import Annotated, Any, ClassVar, Literal, Union

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
    settings model (its row of `DEPLOYMENTS`) subclasses this with `provider` fixed to its
    kind and the fields only it knows; any other key is refused."""

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


class RemoteDeployment(DeploymentConfig):
    """A deployment on another machine: its address, and the environment variable that holds
    its API key (never the key: the file may be read by more people than the key)."""

    base_url: BaseUrl
    api_key_env: str | None = None

    @property
    def address(self) -> str:
        return self.base_url

    def api_key(self) -> str:
        return os.environ.get(self.api_key_env, "") if self.api_key_env else ""

    def share(self, workers: int) -> RemoteDeployment:
        """The upstream sees every server process at once, so its max_parallel, rpm and tpm
        are split between them (rounded up: a limit never drops to zero)."""
        if workers == 1:
            return self
        split = {f: -(-value // workers) for f in ("max_parallel", "rpm", "tpm")
                 if (value := getattr(self, f))}
        return self.model_copy(update=split)


class OpenAIDeployment(RemoteDeployment):
    """`provider = "openai"`: any OpenAI-compatible server at `base_url`."""

    provider: Literal["openai"]
    capabilities: ClassVar[tuple[str, ...]] = ("chat", "tools", "completion", "embeddings")


class AnthropicDeployment(RemoteDeployment):
    """`provider = "anthropic"`: the Messages API, at Anthropic unless `base_url` says."""

    provider: Literal["anthropic"]
    base_url: str = "https://api.anthropic.com"
    capabilities: ClassVar[tuple[str, ...]] = ("chat", "tools")


class LocalDeployment(DeploymentConfig):
    """`provider = "local"`: a model of this machine, one request at a time unless
    `max_parallel` says (one llama.cpp context, or one ONNX run that uses every core)."""

    provider: Literal["local"] = "local"
    max_parallel: int | None = Field(1, ge=1)

    def timeouts(self) -> bool:
        """A local generation's length is the client's choice (max_tokens) and the engine is
        on this machine: no deadlines unless the file sets them."""
        return bool({"timeout_s", "first_token_timeout_s"} & self.model_fields_set)


# The settings model of each provider kind; `gateway/providers/table.py` holds the class each
# kind builds. Adding a provider: its settings model and a row here, its class and a row there.
DEPLOYMENTS: dict[str, type[DeploymentConfig]] = {
    "openai": OpenAIDeployment,
    "anthropic": AnthropicDeployment,
    "local": LocalDeployment,
}


def _provider(entry: Any) -> Any:
    return entry.get("provider") if isinstance(entry, dict) else getattr(entry, "provider", None)


AnyDeploymentConfig = Annotated[
    Union[tuple(Annotated[settings, Tag(kind)]  # noqa: UP007 (a union built from the table)
                for kind, settings in DEPLOYMENTS.items())],
    Discriminator(_provider, custom_error_type="unknown_provider",
                  custom_error_message=f"provider must be one of {', '.join(DEPLOYMENTS)}")]


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
