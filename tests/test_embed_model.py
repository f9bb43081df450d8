"""The local embedding models: the wheel's bge-small, and the default `bge-small-code` (the
same model with the shipped LoRA delta merged in memory, sha256-checked), each under its own
name; and `OnnxEmbedder(model=PATH)`, another int8 ONNX of bge-small (a build from
bench/search/finetune.py) named by its digest, so its vectors are never filed under a product
model's name (the benchmark's vector cache keys by name, the server records the model per
workspace)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from codeplane.models import embed
from codeplane.models.embed import (
    DEFAULT_LOCAL,
    LOCAL_MODELS,
    EmbedderUnavailable,
    OnnxEmbedder,
    bge_files,
)
from codeplane.models.embedders import Embedders
from codeplane.models.onnx_delta import adapted_bytes, build_adapted

TEXTS = ["Convert strings such as '1h30m' into a number of seconds.",
         "def add(a, b):\n    return a + b\n"]


def test_another_model_file_is_named_by_its_digest(tmp_path) -> None:
    copy = tmp_path / "model.onnx"
    shutil.copyfile(bge_files() / "model.onnx", copy)
    product, other = OnnxEmbedder(name="bge-small"), OnnxEmbedder(model=copy)
    assert product.name == "bge-small"
    assert other.name.startswith("bge-small@") and len(other.name) == len("bge-small@") + 12
    assert np.allclose(other.embed(TEXTS), product.embed(TEXTS), atol=1e-6)
    data = bytearray(copy.read_bytes())
    data[-1] ^= 0x01  # one bit of the last initializer: same graph, other weights
    copy.write_bytes(bytes(data))
    assert OnnxEmbedder(model=copy).name != other.name


def test_the_product_model_is_still_checked(monkeypatch, tmp_path) -> None:
    """Only an explicitly named file skips the pinned sha256; the default never does."""
    fake = tmp_path / "models" / "data" / "bge_small_en"
    shutil.copytree(bge_files(), fake)
    (fake / "model.onnx").write_bytes(b"not the model")
    monkeypatch.setattr("codeplane.models.embed.bge_files", lambda: fake)
    for name in LOCAL_MODELS:
        with pytest.raises(EmbedderUnavailable, match="sha256 mismatch"):
            OnnxEmbedder(name=name)


def test_the_default_is_bge_small_with_the_code_delta_merged(tmp_path) -> None:
    """The default model is the wheel's with the shipped delta: the same vectors as the build
    bench/search/finetune.py writes to disk, and not the wheel's vectors."""
    assert DEFAULT_LOCAL == "bge-small-code" == Embedders().local_name
    code = Embedders().index()
    assert code.name == "bge-small-code"
    delta = LOCAL_MODELS["bge-small-code"][0]
    build_adapted(bge_files() / "model.onnx", delta, tmp_path / "code.onnx")
    assert adapted_bytes(bge_files() / "model.onnx", delta) == (tmp_path / "code.onnx").read_bytes()
    vectors = code.embed(TEXTS)
    assert np.allclose(vectors, OnnxEmbedder(model=tmp_path / "code.onnx").embed(TEXTS),
                       atol=1e-6)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    plain = Embedders({"model": "bge-small"}).index()
    assert plain.name == "bge-small"
    cosines = (vectors * plain.embed(TEXTS)).sum(axis=1)
    assert (cosines < 0.999).all() and (cosines > 0.5).all()  # adapted, not replaced


def test_a_tampered_or_missing_delta_is_refused(monkeypatch, tmp_path) -> None:
    delta, digest = LOCAL_MODELS["bge-small-code"]
    copy = tmp_path / "delta.npz"
    data = bytearray(delta.read_bytes())
    data[len(data) // 2] ^= 0x01
    copy.write_bytes(bytes(data))
    monkeypatch.setitem(embed.LOCAL_MODELS, "bge-small-code", (copy, digest))
    with pytest.raises(EmbedderUnavailable, match="sha256 mismatch.*pip install codeplane"):
        OnnxEmbedder(name="bge-small-code")
    monkeypatch.setitem(embed.LOCAL_MODELS, "bge-small-code", (tmp_path / "gone.npz", digest))
    with pytest.raises(EmbedderUnavailable, match="gone.npz.*pip install codeplane"):
        OnnxEmbedder(name="bge-small-code")


def test_an_unknown_local_model_names_the_known_ones() -> None:
    with pytest.raises(EmbedderUnavailable, match="bge-small, bge-small-code"):
        Embedders({"model": "bge-large"})
    with pytest.raises(EmbedderUnavailable, match="bge-small, bge-small-code"):
        OnnxEmbedder(name="bge-large")
    assert Embedders({"kind": "openai", "base_url": "http://gpu:8000/v1",
                      "model": "anything"}).local_name is None
