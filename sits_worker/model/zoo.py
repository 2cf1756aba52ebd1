"""The built-in model zoo: small real ONNX graphs with seeded random weights.

Every model is built with `onnx.helper` from numpy weights drawn from a
generator seeded by (model name, seed), so building twice gives
byte-identical files and tests, benchmarks and workers on different machines
agree on the exact graph. This module is imported by the API process: it uses
only `onnx` and numpy, never onnxruntime.
"""

from __future__ import annotations

import os
import tempfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from broker.errors import BadInput

ZOO_MODELS: tuple[str, ...] = ("mlp", "convnet", "transformer")
LARGE_MODELS: tuple[str, ...] = ("resnet50",)

OPSET = 17
# onnxruntime 1.17 reads IR versions up to 9; 8 is enough for opset 17.
IR_VERSION = 8

MLP_FEATURES = 64
MLP_HIDDEN = (256, 256)
MLP_CLASSES = 10
# Block widths are 2.5x the textbook 16/32 so a batch of 64 runs at roughly
# 1,000-2,000 rows/s on 2 CPU cores: slow enough to exercise batching and time-outs.
CONVNET_STEM = 16
CONVNET_WIDTHS = (40, 80)
TRANSFORMER_VOCAB = 1000
TRANSFORMER_MAX_SEQUENCE = 512
# Padding id the worker writes; any id works, the attention mask hides padded tokens.
TRANSFORMER_PAD_TOKEN_ID = 0
TRANSFORMER_D_MODEL = 64
TRANSFORMER_HEADS = 4
TRANSFORMER_FFN = 128
TRANSFORMER_LAYERS = 2


def _model_rng(name: str, seed: int) -> np.random.Generator:
    """A generator owned by one (model, seed) pair, so models never share a random stream."""
    return np.random.default_rng([zlib.crc32(name.encode()), seed])


class _GraphBuilder:
    """Collects nodes and initializers; every node gets a unique, readable name."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self._counts: dict[str, int] = {}

    def _fresh(self, stem: str) -> str:
        index = self._counts.get(stem, 0)
        self._counts[stem] = index + 1
        return f"{stem}_{index}"

    def const(self, stem: str, value: np.ndarray) -> str:
        name = self._fresh(stem)
        self.initializers.append(numpy_helper.from_array(value, name))
        return name

    def weight(self, stem: str, shape: Sequence[int], scale: float) -> str:
        value = self.rng.standard_normal(tuple(shape), dtype=np.float32) * np.float32(scale)
        return self.const(stem, value)

    def op(self, op_type: str, inputs: Sequence[str], output: str | None = None, **attrs: Any) -> str:
        name = self._fresh(op_type.lower())
        out = output or f"{name}_out"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=name, **attrs))
        return out

    def conv(self, x: str, c_in: int, c_out: int, kernel: int, stride: int = 1, scale: float = 1.0) -> str:
        """Conv with bias; `scale` multiplies the He-style 1/sqrt(fan_in) init."""
        fan_in = c_in * kernel * kernel
        w = self.weight("conv_w", (c_out, c_in, kernel, kernel), scale * (2.0 / fan_in) ** 0.5)
        b = self.const("conv_b", np.zeros(c_out, dtype=np.float32))
        pad = kernel // 2
        return self.op("Conv", [x, w, b], kernel_shape=[kernel, kernel], strides=[stride, stride],
                       pads=[pad] * 4)

    def gemm(self, x: str, k: int, n: int, output: str | None = None) -> str:
        w = self.weight("fc_w", (k, n), (1.0 / k) ** 0.5)
        b = self.const("fc_b", np.zeros(n, dtype=np.float32))
        return self.op("Gemm", [x, w, b], output)

    def linear(self, x: str, k: int, n: int) -> str:
        """MatMul + Add over the last axis; works for any leading shape, unlike Gemm."""
        w = self.weight("linear_w", (k, n), (1.0 / k) ** 0.5)
        b = self.const("linear_b", np.zeros(n, dtype=np.float32))
        return self.op("Add", [self.op("MatMul", [x, w]), b])

    def layer_norm(self, x: str, width: int) -> str:
        scale = self.const("ln_scale", np.ones(width, dtype=np.float32))
        bias = self.const("ln_bias", np.zeros(width, dtype=np.float32))
        return self.op("LayerNormalization", [x, scale, bias], axis=-1, epsilon=1e-5)

    def finish(self, name: str, inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto],
               metadata: dict[str, str]) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="sits.zoo", producer_version="1")
        model.ir_version = IR_VERSION
        helper.set_model_props(model, metadata)
        return model


def mlp_weights(seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """The MLP's (weight [in, out], bias [out]) pairs, layer by layer.

    The graph builder and `mlp_reference` both call this, so the reference
    checks the exported graph against weights from the same code path.
    """
    rng = _model_rng("mlp", seed)
    widths = (MLP_FEATURES, *MLP_HIDDEN, MLP_CLASSES)
    layers = []
    for k, n in zip(widths[:-1], widths[1:], strict=True):
        weight = rng.standard_normal((k, n), dtype=np.float32) * np.float32((2.0 / k) ** 0.5)
        bias = rng.standard_normal(n, dtype=np.float32) * np.float32(0.01)
        layers.append((weight, bias))
    return layers


def mlp_reference(features: np.ndarray, seed: int = 0) -> np.ndarray:
    """The MLP forward pass in plain numpy, an independent check of the ONNX graph."""
    x = np.asarray(features)
    if x.ndim != 2 or x.shape[1] != MLP_FEATURES or not np.issubdtype(x.dtype, np.floating):
        raise BadInput(f"mlp expects float32 features [N,{MLP_FEATURES}], got {x.dtype} {list(x.shape)}; "
                       f"reshape the input to [N,{MLP_FEATURES}]")
    x = x.astype(np.float32)
    layers = mlp_weights(seed)
    for index, (weight, bias) in enumerate(layers):
        x = x @ weight + bias
        if index < len(layers) - 1:
            x = np.maximum(x, 0.0)
    return x


def _build_mlp(seed: int) -> onnx.ModelProto:
    g = _GraphBuilder(_model_rng("mlp", seed))
    x = "features"
    layers = mlp_weights(seed)
    for index, (weight, bias) in enumerate(layers):
        last = index == len(layers) - 1
        w = g.const("fc_w", weight)
        b = g.const("fc_b", bias)
        x = g.op("Gemm", [x, w, b], "logits" if last else None)
        if not last:
            x = g.op("Relu", [x])
    return g.finish(
        "sits_mlp",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", MLP_FEATURES])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", MLP_CLASSES])],
        {"sits.zoo": "mlp"},
    )


def _residual_block(g: _GraphBuilder, x: str, c_in: int, c_out: int, stride: int) -> str:
    """conv-relu-conv plus skip (1x1 projection when the shape changes), then relu."""
    y = g.op("Relu", [g.conv(x, c_in, c_out, 3, stride)])
    # The small scale on the last conv keeps the residual stream's variance bounded.
    y = g.conv(y, c_out, c_out, 3, scale=0.3)
    skip = x if (c_in == c_out and stride == 1) else g.conv(x, c_in, c_out, 1, stride)
    return g.op("Relu", [g.op("Add", [y, skip])])


def _build_convnet(seed: int) -> onnx.ModelProto:
    g = _GraphBuilder(_model_rng("convnet", seed))
    narrow, wide = CONVNET_WIDTHS
    x = g.op("Relu", [g.conv("pixels", 3, CONVNET_STEM, 3)])
    x = _residual_block(g, x, CONVNET_STEM, narrow, 1)
    x = _residual_block(g, x, narrow, wide, 2)
    x = _residual_block(g, x, wide, wide, 1)
    x = g.op("Flatten", [g.op("GlobalAveragePool", [x])], axis=1)
    g.gemm(x, wide, 10, "logits")
    return g.finish(
        "sits_convnet",
        [helper.make_tensor_value_info("pixels", TensorProto.FLOAT, ["batch", 3, 32, 32])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        {"sits.zoo": "convnet"},
    )


def _attention(g: _GraphBuilder, x: str, key_bias: str) -> str:
    """Multi-head self-attention over [batch, sequence, d_model] with plain MatMul/Softmax.

    `key_bias` ([batch, 1, 1, sequence]) is added to the scores: 0 for real keys and a large
    negative for padded ones, so padded keys get zero weight and real tokens attend as if alone.
    """
    d, heads = TRANSFORMER_D_MODEL, TRANSFORMER_HEADS
    head_dim = d // heads
    # Reshape's 0 copies the input dim, so batch and sequence stay dynamic.
    split_heads = g.const("split_heads", np.array([0, 0, heads, head_dim], dtype=np.int64))
    merge_heads = g.const("merge_heads", np.array([0, 0, d], dtype=np.int64))
    q = g.op("Transpose", [g.op("Reshape", [g.linear(x, d, d), split_heads])], perm=[0, 2, 1, 3])
    k_t = g.op("Transpose", [g.op("Reshape", [g.linear(x, d, d), split_heads])], perm=[0, 2, 3, 1])
    v = g.op("Transpose", [g.op("Reshape", [g.linear(x, d, d), split_heads])], perm=[0, 2, 1, 3])
    inv_sqrt = g.const("inv_sqrt_head_dim", np.array(1.0 / head_dim**0.5, dtype=np.float32))
    scores = g.op("Add", [g.op("Mul", [g.op("MatMul", [q, k_t]), inv_sqrt]), key_bias])
    context = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), v])
    context = g.op("Reshape", [g.op("Transpose", [context], perm=[0, 2, 1, 3]), merge_heads])
    return g.linear(context, d, d)


def _build_transformer(seed: int) -> onnx.ModelProto:
    """Encoder over `input_ids` whose `attention_mask` (nonzero = real token) makes padding invisible.

    Padded keys are masked out of every attention and the embedding is the mean over real tokens
    only, so a right-padded row gives the same embedding as the unpadded row alone (the worker pads
    merged batches, see `sits_worker.model.padding`). The mask adds constants only, no weights: the
    weights drawn from the seed are the same as before the mask existed.
    """
    g = _GraphBuilder(_model_rng("transformer", seed))
    d = TRANSFORMER_D_MODEL
    token_table = g.weight("token_embedding", (TRANSFORMER_VOCAB, d), 0.1)
    position_table = g.weight("position_embedding", (TRANSFORMER_MAX_SEQUENCE, d), 0.1)
    tokens = g.op("Gather", [token_table, "input_ids"], axis=0)
    # Positions: the first `sequence` rows of the learned table, sliced at run time.
    sequence_length = g.op("Gather", [g.op("Shape", ["input_ids"]),
                                      g.const("sequence_axis", np.array([1], dtype=np.int64))], axis=0)
    zero = g.const("zero", np.array([0], dtype=np.int64))
    positions = g.op("Slice", [position_table, zero, sequence_length, zero])
    x = g.op("Add", [tokens, positions])
    # Any nonzero mask value counts as a real token (a profiler's random feed must not blow up).
    is_token = g.op("Cast", ["attention_mask"], to=TensorProto.BOOL)
    # -1e9, not the float32 minimum: score + bias stays finite, so a fully masked row gives a
    # uniform softmax instead of NaN.
    key_bias = g.op("Where", [is_token, g.const("real_key_bias", np.array(0.0, dtype=np.float32)),
                              g.const("padded_key_bias", np.array(-1e9, dtype=np.float32))])
    key_bias = g.op("Unsqueeze", [key_bias, g.const("head_query_axes", np.array([1, 2], dtype=np.int64))])
    for _ in range(TRANSFORMER_LAYERS):
        x = g.layer_norm(g.op("Add", [x, _attention(g, x, key_bias)]), d)
        hidden = g.op("Relu", [g.linear(x, d, TRANSFORMER_FFN)])
        x = g.layer_norm(g.op("Add", [x, g.linear(hidden, TRANSFORMER_FFN, d)]), d)
    # Mean over real tokens: sum of masked rows / number of real tokens (at least 1, so an
    # all-padding row gives zeros rather than NaN).
    token_weight = g.op("Cast", [is_token], to=TensorProto.FLOAT)
    sequence_axes = g.const("sequence_axes", np.array([1], dtype=np.int64))
    feature_axis = g.const("feature_axis", np.array([2], dtype=np.int64))
    weighted = g.op("Mul", [x, g.op("Unsqueeze", [token_weight, feature_axis])])
    token_sum = g.op("ReduceSum", [weighted, sequence_axes], keepdims=0)
    token_count = g.op("Max", [g.op("ReduceSum", [token_weight, sequence_axes], keepdims=1),
                               g.const("one_token", np.array(1.0, dtype=np.float32))])
    g.op("Div", [token_sum, token_count], "embedding")
    return g.finish(
        "sits_transformer",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", d])],
        {"sits.zoo": "transformer", "sits.max_sequence": str(TRANSFORMER_MAX_SEQUENCE),
         "sits.attention_mask": "attention_mask", "sits.pad_token_id": str(TRANSFORMER_PAD_TOKEN_ID)},
    )


def _bottleneck(g: _GraphBuilder, x: str, c_in: int, width: int, stride: int) -> str:
    """ResNet-50 v1.5 bottleneck (stride on the 3x3), batch norm folded away."""
    c_out = width * 4
    y = g.op("Relu", [g.conv(x, c_in, width, 1)])
    y = g.op("Relu", [g.conv(y, width, width, 3, stride)])
    y = g.conv(y, width, c_out, 1, scale=0.2)
    skip = x if (c_in == c_out and stride == 1) else g.conv(x, c_in, c_out, 1, stride, scale=0.5)
    return g.op("Relu", [g.op("Add", [y, skip])])


def _build_resnet50(seed: int) -> onnx.ModelProto:
    g = _GraphBuilder(_model_rng("resnet50", seed))
    x = g.op("Relu", [g.conv("pixels", 3, 64, 7, 2)])
    x = g.op("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    c_in = 64
    for stage, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3), strict=True)):
        for block in range(blocks):
            stride = 2 if (block == 0 and stage > 0) else 1
            x = _bottleneck(g, x, c_in, width, stride)
            c_in = width * 4
    x = g.op("Flatten", [g.op("GlobalAveragePool", [x])], axis=1)
    g.gemm(x, c_in, 1000, "logits")
    return g.finish(
        "sits_resnet50",
        [helper.make_tensor_value_info("pixels", TensorProto.FLOAT, ["batch", 3, 224, 224])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 1000])],
        {"sits.zoo": "resnet50"},
    )


_BUILDERS = {
    "mlp": _build_mlp,
    "convnet": _build_convnet,
    "transformer": _build_transformer,
    "resnet50": _build_resnet50,
}


def build_model(name: str, seed: int = 0) -> onnx.ModelProto:
    """Build the zoo model `name` with weights drawn from `seed`.

    Deterministic: the same (name, seed) always gives an identical ModelProto.
    """
    builder = _BUILDERS.get(name)
    if builder is None:
        raise BadInput(f"unknown zoo model '{name}'; choose one of {', '.join(_BUILDERS)}")
    return builder(seed)


def build_zoo(directory: Path, *, include_large: bool = False) -> dict[str, Path]:
    """Write `<directory>/<name>.onnx` for every zoo model (seed 0) and return name -> path.

    Each file is written to a temporary name and renamed into place, so a
    concurrent reader never sees a half-written model.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    names = ZOO_MODELS + (LARGE_MODELS if include_large else ())
    paths: dict[str, Path] = {}
    for name in names:
        target = directory / f"{name}.onnx"
        fd, temp_name = tempfile.mkstemp(prefix=f".{name}.", suffix=".onnx.tmp", dir=directory)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(build_model(name).SerializeToString())
            os.replace(temp_name, target)
        except BaseException:
            Path(temp_name).unlink(missing_ok=True)
            raise
        paths[name] = target
    return paths
