"""What a request to start an agent run says, validated once for both doors that start one:
`POST /v1/agent/runs` (`agent/routes.py`) and `POST /v1/background-agents`
(`background/routes.py`); the server policy an agent run's request must pass (`check_policy`);
and the 429 and 404 both doors answer (run limit reached, a run the caller cannot see)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from codeplane.agent.runs import RunLimit
from codeplane.agent.setup import AgentSetup, Choice, recorded_setup, resolve
from codeplane.config import ServeSettings
from codeplane.core.errors import APIError, not_found
from codeplane.models.registry import ModelRegistry
from codeplane.sandbox.roots import Roots


def _no_nul(value: str) -> str:
    """Refuse a NUL character, which no path or prompt holds and which the OS calls reject
    deep inside a run (a 400 here, not a 500 there). Lone surrogates are refused by the
    JSON parser already."""
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    return value


Text = Annotated[str, AfterValidator(_no_nul)]  # a string a run hands to the OS or a model


class RunSpec(BaseModel):
    """The fields every way of starting a run shares."""

    model_config = ConfigDict(extra="forbid")
    task: Text = Field(min_length=1, max_length=100_000)
    model: Text = Field("code-medium", min_length=1, max_length=200)
    max_steps: int = Field(25, ge=1, le=200, description="default: the model's setup, else 25")
    max_tokens: int = Field(1024, ge=16, le=8192,
                            description="default: the model's setup, else 1024")
    setup: Choice = Field("model", description="model: the agent setup a trained model was "
                                               "registered with (agent/setup.py); product: "
                                               "the product's defaults")

    def agent_setup(self, registry: ModelRegistry) -> AgentSetup:
        """The run's agent setup: the model's recorded one unless `setup` is "product", with
        the limits this request sets explicitly."""
        explicit = {k: getattr(self, k) for k in ("max_steps", "max_tokens")
                    if k in self.model_fields_set}
        return resolve(recorded_setup(registry, self.model), self.setup, **explicit)


class RunRequest(RunSpec):
    path: Text = Field(min_length=1, max_length=4096,
                       description="absolute workspace directory under one of the caller's "
                                   "workspace roots on the server machine")
    sandbox: bool = Field(True, description="false is refused unless serve.allow_unsandboxed")
    network: bool = Field(False, description="true is refused unless serve.allow_network")
    backend: str | None = Field(None, max_length=64,
                                description="workspace backend (bwrap, pool, ...); one of "
                                            "serve.backends. pool: a copy-on-write sandbox of "
                                            "the repo at HEAD, removed when the run ends")
    stream: bool = True


def check_policy(body: RunRequest, serve: ServeSettings, tenant: str) -> Path:
    """The run's workspace, if server policy allows this request; APIError otherwise."""
    if body.backend == "host":  # the host backend is sandbox=false under another name
        body = body.model_copy(update={"sandbox": False})
    elif body.backend is not None and body.backend not in serve.backends:
        raise APIError(403, f"backend {body.backend!r} is not allowed on this server (allowed: "
                            f"{', '.join(serve.backends) or 'none'}; an operator sets "
                            "serve.backends)", code="backend_not_allowed", param="backend")
    if not body.sandbox and not serve.allow_unsandboxed:
        raise APIError(403, "sandbox=false is not allowed on this server: agent commands "
                            "always run in the sandbox (an operator can allow it with "
                            "serve.allow_unsandboxed = true)", code="unsandboxed_not_allowed",
                       param="sandbox")
    if body.network and not serve.allow_network:
        raise APIError(403, "network=true is not allowed on this server: sandboxed commands "
                            "have no network (an operator can allow it with "
                            "serve.allow_network = true)", code="network_not_allowed",
                       param="network")
    roots = Roots.of(serve, tenant)
    if body.backend == "pool":  # a sandbox of the repository: it must be one, wholly ours
        return roots.repository(body.path, param="path")
    return roots.directory(body.path)


def too_many_runs(exc: RunLimit) -> APIError:
    return APIError(429, str(exc), type="rate_limit_error", code="too_many_runs",
                    headers={"retry-after": "10"})


def run_not_found(what: str, run_id: str) -> APIError:
    """The 404 for a run the caller cannot see: another tenant's run does not exist."""
    return not_found(f"{what} {run_id!r} does not exist", code="run_not_found", param="run_id")
