"""`/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`, `/v1/models`.

Every OpenAI-compatible endpoint goes through the model gateway (`codeplane.gateway.routes`):
local llama.cpp models are `provider = "local"` deployments there, next to remote ones, so
they share routing, admission control, priorities, limits and metrics. The local path itself
is unchanged (`codeplane.gateway.providers.local` runs `local_openai` on the model's worker
thread, with KV-cache reuse and cancellation when the client goes away). This module keeps
the import path `create_app` mounts.
"""

from __future__ import annotations

from codeplane.gateway.routes import router

__all__ = ["router"]
