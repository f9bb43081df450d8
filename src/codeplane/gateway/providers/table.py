"""Model providers by kind: the table `[[models]]` entries name with `provider = "..."`.

A row is a provider class (or a function that picks one) and the settings model a deployment
of that kind is validated with: its row of `config/gateway.py`'s `DEPLOYMENTS`, a subclass of
`DeploymentConfig` whose `provider` is the kind (settings load checks the entries, so the
settings models live below the gateway). The gateway builds a row's class as
`cls(settings, services)`, with the services the composition root injected
(`ProviderServices`: the engine, its metrics, the embedders). Adding a provider is one module
here (its class), its settings model in `config/gateway.py`, and a row in each table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from codeplane.config.gateway import (
    AnthropicDeployment,
    DeploymentConfig,
    LocalDeployment,
    OpenAIDeployment,
)
from codeplane.gateway.providers.anthropic import AnthropicProvider
from codeplane.gateway.providers.base import Provider, ProviderServices
from codeplane.gateway.providers.local import local_provider
from codeplane.gateway.providers.openai import OpenAIProvider


@dataclass(frozen=True)
class Row:
    cls: Callable[[Any, ProviderServices], Provider]  # built as cls(settings, services)
    settings: type[DeploymentConfig]  # validates a `[[models]]` entry of this kind


PROVIDERS: dict[str, Row] = {
    "openai": Row(OpenAIProvider, OpenAIDeployment),
    "anthropic": Row(AnthropicProvider, AnthropicDeployment),
    "local": Row(local_provider, LocalDeployment),
}


def build(dep: DeploymentConfig, services: ProviderServices) -> Provider:
    """The provider of a validated deployment, built by its row."""
    return PROVIDERS[dep.provider].cls(dep, services)
