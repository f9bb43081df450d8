"""`OnnxEmbedder(model=PATH)`: another int8 ONNX of bge-small (an adapted build from
bench/search/finetune.py) runs behind the same interface and is named by its digest, so its
vectors are never filed under the product model's name (the benchmark's vector cache keys by
name, the server records the model per workspace)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from codeplane.models.embed import EmbedderUnavailable, OnnxEmbedder, bge_files

TEXTS = ["Convert strings such as '1h30m' into a number of seconds.",
         "def add(a, b):\n    return a + b\n"]


def test_another_model_file_is_named_by_its_digest(tmp_path) -> None:
    copy = tmp_path / "model.onnx"
    shutil.copyfile(bge_files() / "model.onnx", copy)
    product, other = OnnxEmbedder(), OnnxEmbedder(model=copy)
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
    with pytest.raises(EmbedderUnavailable, match="sha256 mismatch"):
        OnnxEmbedder()
