"""A local embedding model (`models/embed.py`, the one private search uses) as the deployment
behind `/v1/embeddings` for its name (`provider = "local"` with a `LOCAL_MODELS` name).

The model comes from the program's `Embedders` (injected): the index's own instance when it is
the same model, so a server loads each embedding model once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from codeplane.config.gateway import DeploymentConfig
from codeplane.gateway.providers.base import (
    Call,
    ProviderServices,
    Reply,
    UpstreamError,
    Usage,
)
from codeplane.models.embed import EmbedderUnavailable

MAX_INPUTS = 2048


class EmbedderProvider:
    def __init__(self, dep: DeploymentConfig, services: ProviderServices) -> None:
        if services.embedders is None:
            raise ValueError("an embedding deployment needs the program's embedders")
        self.model, self.embedders = dep.upstream_model, services.embedders

    async def request(self, call: Call) -> Reply:
        texts = call.raw.get("input")
        texts = [texts] if isinstance(texts, str) else texts
        if not texts or len(texts) > MAX_INPUTS or not all(isinstance(t, str) for t in texts):
            raise UpstreamError(400, f"input must hold 1-{MAX_INPUTS} strings", retryable=False,
                                param="input")
        try:
            vectors = await asyncio.to_thread(self._embed, texts)
        except EmbedderUnavailable as exc:
            raise UpstreamError(503, str(exc), retryable=True, code=exc.code,
                                retry_after=exc.retry_after) from None
        tokens = sum(len(t.split()) for t in texts)
        usage = Usage(tokens, 0, tokens)
        return Reply({"object": "list", "model": call.raw["model"],
                      "data": [{"object": "embedding", "index": i, "embedding": v.tolist()}
                               for i, v in enumerate(vectors)],
                      "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}, usage)

    def _embed(self, texts: list[str]) -> Any:
        return self.embedders.local(self.model).embed(texts)

    async def stream(self, call: Call) -> AsyncIterator[dict[str, Any] | Usage]:
        raise UpstreamError(400, "embeddings do not stream", retryable=False)
        yield {}  # pragma: no cover - makes this an async generator

    async def aclose(self) -> None:
        """The embedders belong to the program; nothing to release."""
