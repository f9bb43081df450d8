"""The GGUF header walk `model info` and `model add` use: the same key-value pairs the `gguf`
package reads, arrays skipped, and a clear ValueError for a file that is not one."""

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter

from codeplane.models.registry import gguf_metadata, gguf_summary


def _write(path: Path) -> None:
    w = GGUFWriter(str(path), "qwen2")
    w.add_context_length(4096)
    w.add_uint32("general.quantization_version", 2)
    w.add_string("tokenizer.chat_template", "{{ messages }}")
    w.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"] * 100)
    w.add_array("tokenizer.ggml.scores", [0.5] * 7)
    w.add_float32("some.float", 1.5)
    w.add_bool("some.flag", True)
    w.add_int64("some.big", -(2**40))
    w.add_string("after.arrays", "still read")
    w.add_tensor("t", np.zeros((2, 3), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_the_header_walk_reads_what_the_gguf_package_reads(tmp_path):
    path = tmp_path / "m.gguf"
    _write(path)
    reader = GGUFReader(str(path))
    expected = {key: None if field.types[0].name == "ARRAY" else field.contents()
                for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    meta = gguf_metadata(path)
    assert meta == pytest.approx(expected)
    assert meta["after.arrays"] == "still read" and meta["tokenizer.ggml.tokens"] is None
    assert gguf_summary(path) == {"architecture": "qwen2", "context_length": 4096,
                                  "quantization_version": 2, "has_chat_template": True}


def test_a_file_that_is_not_a_whole_gguf_header_is_a_value_error(tmp_path):
    path = tmp_path / "m.gguf"
    _write(path)
    data = path.read_bytes()
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf_metadata(junk)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:200])  # inside the key-value pairs
    with pytest.raises(ValueError, match="truncated"):
        gguf_metadata(cut)


def test_arrays_nested_past_any_real_file_are_a_value_error(tmp_path):
    """A crafted header: one key whose array holds an array holding an array ... 10,000 deep."""
    import struct

    key = b"k"
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    nested = struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 10_000 + struct.pack("<IQ", 0, 0)
    path = tmp_path / "deep.gguf"
    path.write_bytes(head + nested)
    with pytest.raises(ValueError, match="nested too deep"):
        gguf_metadata(path)
