"""Client-side embedding mode (`[indexing] embed = "client"`): chunk and query text are embedded
on this machine with the same bge-small ONNX model the server runs, rotated by a matrix seeded
from the client-only `rotation_key`, and only the rotated vectors are sent. The server never sees
chunk or query text, nor the rotation (in server-side mode it derives the rotation from the
server key it receives). See docs/indexing.md, "Threat model", for what the vectors still reveal.
"""

from __future__ import annotations

import base64
from typing import get_args

import numpy as np

from codeplane.config import EmbedMode, IndexingSettings
from codeplane.models.embed import Embedder, rotation
from codeplane.models.embedders import Embedders

MODES: tuple[str, ...] = get_args(EmbedMode)


class EmbedModeError(Exception):
    """The embedding mode is misconfigured or does not match the server's model."""


class ClientVectors:
    def __init__(self, embedder: Embedder, rotation_key: str) -> None:
        self.embedder = embedder
        self._rotation = rotation(rotation_key, self.embedder.dim)

    def check(self, status: dict) -> None:
        """Vectors from another model would be meaningless next to the server's; refuse."""
        if (status.get("model"), status.get("dim")) != (self.embedder.name, self.embedder.dim):
            raise EmbedModeError(
                f"client-side embedding uses {self.embedder.name} ({self.embedder.dim} dims) but "
                f"the server's workspace uses {status.get('model')} ({status.get('dim')}); set "
                "the same [indexing.embedder] on both, or embed = \"server\"")

    def encode(self, texts: list[str]) -> list[str]:
        """Base64 of each text's rotated little-endian float32 vector (the upload format)."""
        rotated = (self.embedder.embed(texts) @ self._rotation.T).astype("<f4")
        return [base64.b64encode(np.ascontiguousarray(v).tobytes()).decode() for v in rotated]


def client_vectors(config: IndexingSettings, rotation_key: str,
                   embedders: Embedders | None = None) -> ClientVectors | None:
    """The client-side embedder when `indexing.embed` is "client", else None (server mode).
    `embedders`: the program's (`codeplane index --watch` syncs many times with one); without,
    the embedder `config` names is loaded for this call."""
    if config.embed != "client":
        return None
    embedders = embedders or Embedders(config.embedder)
    return ClientVectors(embedders.index(), rotation_key)
