"""Embedders by kind: the table `[indexing] embedder = {kind = "...", ...}` names, and the
embedders one program uses.

A row is an embedder class (or its constructor from settings) and the settings model the rest
of the `embedder` table is validated with; the composition root (the server's
`server/services.py`, the client's `codeplane index`/`search`) makes one `Embedders` and hands
it to whoever embeds, which builds each embedder on first use and once (a local model takes
time and memory to load, and most servers never index). A row that runs native code
is built, in a program with an engine (the server), in a worker process of that engine
(`embed_worker.py`): a crash there fails one request, never the server.
Adding an embedder is one module (its class and settings model) and one row here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from codeplane.models.embed import (
    Embedder,
    EmbedderUnavailable,
    LocalEmbedderSettings,
    OnnxEmbedder,
)
from codeplane.models.embed_openai import OpenAIEmbedder, OpenAIEmbedderSettings
from codeplane.models.embed_worker import EmbedderTarget, ProcessEmbedder
from codeplane.models.engine import Engine


@dataclass(frozen=True)
class Row:
    cls: Callable[[Any], Embedder]  # built as cls(settings)
    settings: type[BaseModel]  # validates the `embedder` table, less its `kind`
    native: bool = False  # runs native code: in an engine worker where there is an engine


DEFAULT_KIND = "local"
EMBEDDERS: dict[str, Row] = {
    "local": Row(OnnxEmbedder.from_settings, LocalEmbedderSettings, native=True),
    "openai": Row(OpenAIEmbedder, OpenAIEmbedderSettings),
}


def embedder_settings(spec: Mapping[str, Any] | None) -> tuple[str, BaseModel]:
    """(kind, settings) of an `[indexing] embedder` table; EmbedderUnavailable names the key
    that is wrong (an unknown kind with the known ones, a key the kind does not take)."""
    spec = dict(spec or {})
    kind = spec.pop("kind", DEFAULT_KIND)
    row = EMBEDDERS.get(kind)
    if row is None:
        raise EmbedderUnavailable(f"indexing.embedder.kind {kind!r} is not an embedder; "
                                  f"one of {', '.join(EMBEDDERS)}")
    try:
        return kind, row.settings.model_validate(spec)
    except ValidationError as exc:
        raise EmbedderUnavailable("; ".join(
            f"indexing.embedder.{'.'.join(map(str, e['loc']))}: "
            f"{e['msg'].removeprefix('Value error, ')}" for e in exc.errors())) from None


class Embedders:
    """The embedders of one program: the index's (`index()`) and each local model by name
    (`local()`, what the gateway serves on `/v1/embeddings`), each built once, on first use."""

    def __init__(self, spec: Mapping[str, Any] | None = None, engine: Engine | None = None
                 ) -> None:
        """`spec`: `settings.indexing["embedder"]`, validated now (a bad one fails at start).
        `engine`: the program's, whose workers run the native rows (without: in-process)."""
        self.kind, self.settings = embedder_settings(spec)
        self.engine = engine
        self._built: dict[tuple[str, str], Embedder] = {}
        self._lock = threading.Lock()  # held while building: concurrent first calls load once

    @property
    def local_name(self) -> str | None:
        """The local model the index uses, or None when it uses another kind."""
        return self.settings.model if isinstance(self.settings, LocalEmbedderSettings) else None

    def index(self) -> Embedder:
        """The embedder `[indexing] embedder` names."""
        return self._get(self.kind, self.settings)

    def local(self, name: str) -> Embedder:
        """The local model `name`: the index's own instance when it is that model."""
        threads = self.settings.threads if isinstance(self.settings,
                                                      LocalEmbedderSettings) else None
        return self._get("local", LocalEmbedderSettings(model=name, threads=threads))

    def _get(self, kind: str, settings: BaseModel) -> Embedder:
        key = (kind, settings.model_dump_json())
        with self._lock:
            if key not in self._built:
                self._built[key] = self._build(kind, settings)
            return self._built[key]

    def _build(self, kind: str, settings: BaseModel) -> Embedder:
        if EMBEDDERS[kind].native and self.engine is not None:
            return ProcessEmbedder(self.engine, EmbedderTarget(kind, settings))
        return EMBEDDERS[kind].cls(settings)
