"""Model providers by kind: the table `[[models]]` entries name with `provider = "..."`.

A row is a provider class (or a function that picks one) and the settings model a deployment
of that kind is validated with, both in the provider's module: a subclass of
`DeploymentConfig` whose `provider` is the kind. This is the only place a kind is named:
settings load validates `[[models]]` with this table when the program's composition root
hands it over (`load_settings(providers=PROVIDERS)`; the `codeplane` command's root does),
and the gateway checks entries loaded without it against the same rows (`checked_models`)
before it builds `cls(settings, services)` with the services the composition root injected
(`ProviderServices`: the engine, its metrics, the embedders). Adding a provider is one module
here and one row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from codeplane.config.gateway import DeploymentConfig
from codeplane.gateway.providers.anthropic import AnthropicDeployment, AnthropicProvider
from codeplane.gateway.providers.base import Provider, ProviderServices
from codeplane.gateway.providers.local import LocalDeployment, local_provider
from codeplane.gateway.providers.openai import OpenAIDeployment, OpenAIProvider


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
