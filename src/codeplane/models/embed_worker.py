"""A native embedder run in a worker process of the engine, so that a crash in its native code
(onnxruntime) fails the request in flight, never the server (issue #30): the request gets a
503 `engine_crashed`, the next one a fresh worker, and `/metrics` counts the restart, exactly
as for a GGUF model (`engine.py`, `worker.py`).

The embedder table (`embedders.py`) marks which rows run native code; a program with an engine
(the server) builds those through `ProcessEmbedder`, a program without one (the client-side
`codeplane index`, whose crash is its own) in-process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import BaseModel

from codeplane.models.embed import Embedder, EmbedderUnavailable
from codeplane.models.engine import Engine, EngineCrashed

if TYPE_CHECKING:
    from codeplane.config import Settings
    from codeplane.models.jobs import JobContext


class EmbedderCrashed(EmbedderUnavailable):
    """The embedder's worker process died (or is backing off) instead of answering."""

    code = "engine_crashed"

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class EmbedderInfo:
    """What the server learns of an embedder its worker loaded."""

    name: str  # the vectors' model name (search keys caches by it)
    dim: int
    load_seconds: float


@dataclass(frozen=True)
class EmbedderTarget:
    """A `worker.WorkerTarget`: the embedder of one row of the table, with its settings."""

    kind: str
    settings: BaseModel

    @property
    def name(self) -> str:
        model = getattr(self.settings, "model", None)
        return f"embedder:{self.kind}" + (f":{model}" if model else "")

    def load(self, settings: Settings) -> tuple[Embedder, EmbedderInfo]:
        from codeplane.models.embedders import EMBEDDERS

        start = time.perf_counter()
        embedder = EMBEDDERS[self.kind].cls(self.settings)
        return embedder, EmbedderInfo(embedder.name, embedder.dim, time.perf_counter() - start)

    def use_adapter(self, loaded: Embedder, adapter: Any) -> None:
        """An embedder takes no adapter (the engine sends none to a hosted target)."""
        if adapter is not None:
            raise ValueError(f"{self.name} takes no LoRA adapter")

    def before_job(self, loaded: Embedder) -> None:
        """Nothing: onnxruntime sizes its own thread pool."""


class ProcessEmbedder:
    """An `Embedder` whose model lives in the engine's worker for `target`; `name` and `dim`
    come from the worker (the first use starts it) and are kept: they do not change when a
    worker is restarted, and asking again would queue behind a long embedding job."""

    def __init__(self, engine: Engine, target: EmbedderTarget) -> None:
        self.engine, self.job_name = engine, engine.host(target)
        self._facts: EmbedderInfo | None = None

    @property
    def name(self) -> str:
        return self._info().name

    @property
    def dim(self) -> int:
        return self._info().dim

    def embed(self, texts: list[str]) -> np.ndarray:
        return self._call(lambda: self.engine.run_sync(self.job_name, "embed", texts))

    def _info(self) -> EmbedderInfo:
        if self._facts is None:
            self._facts = self._call(lambda: self.engine.info(self.job_name))
        return self._facts

    @staticmethod
    def _call(fn: Any) -> Any:
        try:
            return fn()
        except EngineCrashed as exc:
            raise EmbedderCrashed(str(exc), exc.retry_after) from None


def embed(ctx: JobContext, texts: list[str]) -> np.ndarray:
    """The `embed` job: the worker's embedder on `texts`."""
    return ctx.model.embed(texts)
