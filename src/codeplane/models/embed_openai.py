"""`[indexing] embedder = {kind = "openai", ...}`: any OpenAI-compatible `/v1/embeddings`
endpoint - a team's GPU server (vLLM, text-embeddings-inference, llama.cpp server), a
provider, or another codeplane gateway.

The key is read from the environment variable `api_key_env` names, never from the file (as
for gateway deployments). Redirects are not followed (httpx's default): the texts, and the
key, go to `base_url` only. A reply of the wrong shape is the endpoint's failure
(`EmbedderUnavailable`: search answers 503), never vectors of another size.
"""

from __future__ import annotations

import os

import httpx
import numpy as np
from pydantic import BaseModel, Field

from codeplane.config.gateway import BaseUrl
from codeplane.core.http import api_client
from codeplane.models.embed import DEFAULT_LOCAL, EmbedderUnavailable


class OpenAIEmbedderSettings(BaseModel):
    model_config = {"extra": "forbid"}
    base_url: BaseUrl = Field(description="the endpoint's /v1, e.g. http://gpu:8000/v1")
    model: str = Field(DEFAULT_LOCAL, min_length=1, description="the model it serves; also "
                       "the name workspaces record, so vectors of two models never mix")
    dim: int = Field(384, ge=1, description="the model's vector size")
    api_key_env: str | None = Field(None, description="environment variable holding its key")
    timeout_s: float = Field(60.0, gt=0)


class OpenAIEmbedder:
    def __init__(self, settings: OpenAIEmbedderSettings) -> None:
        self.name, self.dim = settings.model, settings.dim
        key = os.environ.get(settings.api_key_env, "") if settings.api_key_env else ""
        self.client = api_client(key, settings.timeout_s, base_url=settings.base_url)

    def embed(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        try:
            resp = self.client.post("/embeddings", json={"model": self.name, "input": texts})
            resp.raise_for_status()
            rows = sorted(resp.json()["data"], key=lambda d: d["index"])
            vecs = np.asarray([r["embedding"] for r in rows], dtype=np.float32)
        except httpx.HTTPError as exc:
            raise EmbedderUnavailable(f"embedding endpoint {self.client.base_url}: {exc}") from exc
        except (ValueError, KeyError, TypeError) as exc:
            raise EmbedderUnavailable(f"embedding endpoint {self.client.base_url} sent a "
                                      f"malformed reply: {exc!r}"[:300]) from None
        if vecs.shape != (len(texts), self.dim):
            raise EmbedderUnavailable(f"endpoint returned shape {vecs.shape}, "
                                      f"expected ({len(texts)}, {self.dim})")
        if not np.isfinite(vecs).all():
            raise EmbedderUnavailable("endpoint returned vectors that are not finite")
        return vecs / np.maximum(np.linalg.norm(vecs, axis=1, keepdims=True), 1e-12)
