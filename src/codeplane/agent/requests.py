"""What a request to start an agent run says, validated once for both doors that start one:
`POST /v1/agent/runs` (`agent/routes.py`) and `POST /v1/background-agents`
(`background/routes.py`), and the 429 both answer when the run limit is reached."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from codeplane.agent.runs import RunLimit
from codeplane.core.errors import APIError


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
    max_steps: int = Field(25, ge=1, le=200)
    max_tokens: int = Field(1024, ge=16, le=8192)


def too_many_runs(exc: RunLimit) -> APIError:
    return APIError(429, str(exc), type="rate_limit_error", code="too_many_runs",
                    headers={"retry-after": "10"})
