"""Describe and statically profile ONNX models without running them (loading them: `loading.py`).

The API process imports this module to check uploads and estimate cost
before any worker touches a model, so it imports only `onnx` and numpy
(no onnxruntime). Every onnx/protobuf/OS exception is translated into a
SITS error at this boundary. Whether SITS can serve a valid model is
`servable.py`'s concern.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

import onnx
from onnx import TensorProto, helper

from broker.errors import InvalidModel
from sits_worker.model.padding import MASK_INPUT_KEY

# Token models are profiled at this many tokens and the totals divided by it.
REFERENCE_SEQUENCE_LENGTH = 128
# Initializers larger than this are replaced by typed graph inputs in the profiling
# copy: shape inference needs only their shapes, and copying the data is costly.
_PROFILE_KEEP_INITIALIZER_ELEMENTS = 1024
# Pure data movement or shape bookkeeping: no arithmetic worth counting.
_ZERO_FLOP_OPS = frozenset({
    "Cast", "Concat", "Constant", "ConstantOfShape", "DepthToSpace", "Expand", "Flatten", "Gather",
    "GatherElements", "GatherND", "Identity", "Pad", "Reshape", "Shape", "Size", "Slice", "SpaceToDepth",
    "Split", "Squeeze", "Tile", "Transpose", "Unsqueeze",
})
# Ops whose first output holds their first input's values (other type or shape): token ids reach an
# embedding lookup through them unchanged.
_VALUE_KEEPING_OPS = frozenset({"Cast", "Flatten", "Identity", "Reshape", "Squeeze", "Unsqueeze"})
# Element widths numpy cannot express as a whole number of bytes.
_SUB_BYTE_BITS = {
    getattr(TensorProto, name): bits
    for name, bits in (("UINT4", 4), ("INT4", 4), ("FLOAT4E2M1", 4), ("UINT2", 2), ("INT2", 2))
    if hasattr(TensorProto, name)
}


def dtype_name(elem_type: int) -> str:
    """The numpy dtype name ("float32", "int64", ...) of an ONNX tensor element type.

    Strings map to numpy's "object"; an unset or unknown type gives "undefined"
    rather than an error, since signatures are also shown for odd models.
    """
    try:
        return str(helper.tensor_dtype_to_np_dtype(elem_type).name)
    except (KeyError, ValueError, TypeError):
        return "undefined"


def _element_bits(elem_type: int) -> int:
    if elem_type in _SUB_BYTE_BITS:
        return _SUB_BYTE_BITS[elem_type]
    if elem_type in (TensorProto.STRING, TensorProto.UNDEFINED):
        return 0  # size unknown until run time
    try:
        return helper.tensor_dtype_to_np_dtype(elem_type).itemsize * 8
    except (KeyError, ValueError, TypeError):
        return 0


def _tensor_bytes(elem_type: int, elements: int) -> int:
    return math.ceil(elements * _element_bits(elem_type) / 8)


# --- signature ----------------------------------------------------------------


def shape_of(value_type: onnx.TypeProto) -> list[int | str] | None:
    """Dims as ints, symbolic names, or "?" for unnamed unknown dims; None for unknown rank."""
    tensor_type = value_type.tensor_type
    if not tensor_type.HasField("shape"):
        return None
    return [dim.dim_value if dim.HasField("dim_value") else (dim.dim_param or "?")
            for dim in tensor_type.shape.dim]


def _describe(value: onnx.ValueInfoProto) -> dict[str, Any]:
    shape = shape_of(value.type)
    return {
        "name": value.name,
        "dtype": dtype_name(value.type.tensor_type.elem_type),
        "shape": shape,
        "dynamic_axes": [axis for axis, dim in enumerate(shape or []) if isinstance(dim, str)],
    }


def true_inputs(graph: onnx.GraphProto) -> list[onnx.ValueInfoProto]:
    initializers = {tensor.name for tensor in graph.initializer}
    return [value for value in graph.input if value.name not in initializers]


def model_signature(model: onnx.ModelProto) -> dict[str, list[dict[str, Any]]]:
    """The model's feedable inputs and its outputs: name, dtype, shape, dynamic axes.

    Graph inputs that are also initializers (old exporters list weights as
    inputs) are left out: a caller never feeds them. A shape of None means
    the rank itself is unknown.
    """
    return {
        "inputs": [_describe(value) for value in true_inputs(model.graph)],
        "outputs": [_describe(value) for value in model.graph.output],
    }


# --- profile ----------------------------------------------------------------------


def operator_histogram(model: onnx.ModelProto) -> dict[str, int]:
    """op_type -> node count over the graph and its subgraphs, most frequent first."""
    counts: Counter[str] = Counter()

    def visit(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            counts[node.op_type] += 1
            for attribute in node.attribute:
                if attribute.HasField("g"):
                    visit(attribute.g)
                for subgraph in attribute.graphs:
                    visit(subgraph)

    visit(model.graph)
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def default_opset(model: onnx.ModelProto) -> int | None:
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            return int(opset.version)
    return None


def sequence_axis(model: onnx.ModelProto) -> dict[str, Any] | None:
    """The input and axis that carry a token model's sequence: the first dynamic axis after the batch
    axis of an input; None when no input has one.

    Among several such inputs the token ids are wanted (their vocabulary is checked, they are padded
    with the pad id): never the attention mask that `sits.attention_mask` names while another input
    is left; then by name (`input_ids` first, position and token type ids last: `_id_name_rank`);
    then an input that indexes an embedding table (`vocabulary_size`, the largest table first)
    before one that does not; otherwise the first in graph order. Graph order alone picked the mask
    of models that list it first, and the largest table alone a position table larger than the
    vocabulary.

    An input with two or more dynamic axes after the batch (an image of any height and width, a
    volume) carries no sequence: counting its rows' heights as tokens put a 64-pixel-high image in
    the express lane for short requests and bounded image batches by `max_batch_tokens`. Such a
    model is scheduled by rows, its requests merged only with those of the same shape.
    """
    candidates = []
    for value in true_inputs(model.graph):
        dynamic = [axis for axis, dim in enumerate(shape_of(value.type) or []) if axis > 0 and isinstance(dim, str)]
        if len(dynamic) == 1:
            candidates.append((value.name, dynamic[0]))
    if not candidates:
        return None
    mask = next((prop.value for prop in model.metadata_props if prop.key == MASK_INPUT_KEY), None)

    def preference(candidate: tuple[str, int]) -> tuple[bool, int, int]:
        vocabulary = vocabulary_size(model, candidate[0])
        return candidate[0] == mask, _id_name_rank(candidate[0]), -(vocabulary or 0)

    name, axis = min(candidates, key=preference)  # min keeps graph order among equals
    return {"input": name, "axis": axis}


def _id_name_rank(name: str) -> int:
    """How surely an input's name says it holds the token ids, by the names exporters give them:
    `input_ids` 0; position and token type ids 2 (a position table may well outnumber a small
    vocabulary, as in byte-level models); any other name 1."""
    bare = name.lower().split(":")[0]  # ("input_ids:0": TF's tensor names)
    if bare == "input_ids":
        return 0
    return 2 if set(re.split(r"[^a-z]+", bare)) & {"position", "positions", "type", "segment"} else 1


def vocabulary_size(model: onnx.ModelProto, token_input: str) -> int | None:
    """How many token ids the model takes: the rows of the embedding table its token input indexes
    (a Gather on axis 0 of an initializer or a Constant, as exported transformers look ids up),
    directly or through ops that keep the values (a Cast, a Reshape). None when no such
    lookup is found: then the input is not known to hold token ids (`padding.TokenLimits`), and no
    id is refused for being too large."""
    tables = {tensor.name: list(tensor.dims) for tensor in model.graph.initializer}
    tables.update({node.output[0]: list(attribute.t.dims) for node in model.graph.node if node.op_type == "Constant"
                   for attribute in node.attribute if attribute.name == "value"})
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in set(node.input):
            consumers.setdefault(name, []).append(node)
    pending, seen = [token_input], {token_input}
    while pending:
        values = pending.pop()
        for node in consumers.get(values, []):
            if node.op_type in _VALUE_KEEPING_OPS and node.input[0] == values and node.output[0] not in seen:
                seen.add(node.output[0])
                pending.append(node.output[0])
            elif node.op_type == "Gather" and list(node.input[1:2]) == [values] and tables.get(node.input[0]):
                axis = next((attribute.i for attribute in node.attribute if attribute.name == "axis"), 0)
                if axis == 0:
                    return int(tables[node.input[0]][0])
    return None


def _profiling_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy with fixed input dims (batch 1, other dynamic dims the reference length) and light weights."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    graph = copy.graph
    input_names = {value.name for value in graph.input}
    for value in true_inputs(graph):
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            if not dim.HasField("dim_value"):
                dim.dim_value = 1 if axis == 0 else REFERENCE_SEQUENCE_LENGTH
    kept = []
    for tensor in graph.initializer:
        if math.prod(tensor.dims) <= _PROFILE_KEEP_INITIALIZER_ELEMENTS:
            kept.append(tensor)
        elif tensor.name not in input_names:
            typed_input = helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims))
            graph.input.append(typed_input)
    del graph.initializer[:]
    graph.initializer.extend(kept)
    # Drop stale symbolic shapes so inference writes the fixed ones.
    del graph.value_info[:]
    for value in graph.output:
        value.type.tensor_type.ClearField("shape")
    return copy


def _node_flops(node: onnx.NodeProto, shapes: dict[str, list[int]]) -> int | None:
    """Estimated floating point operations of one node; None when a needed shape is unknown."""
    if node.op_type in _ZERO_FLOP_OPS:
        return 0
    ins = [shapes.get(name) for name in node.input]
    outs = [shapes.get(name) for name in node.output]
    out = outs[0] if outs else None
    if node.op_type in ("MatMul", "Gemm", "Conv", "ConvTranspose"):
        if out is None or len(ins) < 2 or ins[0] is None or ins[1] is None:
            return None
        a, w = ins[0], ins[1]
        if node.op_type == "MatMul":
            return 2 * math.prod(out) * (a[-1] if a else 1)
        if node.op_type == "Gemm":
            trans_a = next((attr.i for attr in node.attribute if attr.name == "transA"), 0)
            return 2 * math.prod(out) * (a[0] if trans_a else a[-1])
        if node.op_type == "Conv":
            return 2 * math.prod(out) * math.prod(w[1:])
        return 2 * math.prod(a) * math.prod(w[1:])  # ConvTranspose: each input pixel scatters a kernel
    sizes = [math.prod(shape) for shape in ins + outs if shape is not None]
    if not outs or outs[0] is None:
        return None
    # Elementwise ops and reductions: one operation per element of the largest tensor touched.
    return max(sizes)


def _measure(model: onnx.ModelProto) -> dict[str, int]:
    """FLOPs and tensor bytes of the model at its fixed input shapes."""
    try:
        inferred = onnx.shape_inference.infer_shapes(_profiling_copy(model), data_prop=True)
    except Exception as err:  # InferenceError, ValueError for >2 GB protos, ...
        raise InvalidModel(f"shape inference failed for graph '{model.graph.name}' ({err}); "
                           f"re-export the model with static or named dimensions") from err
    graph = inferred.graph
    shapes: dict[str, list[int]] = {}
    types: dict[str, int] = {}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        shape = shape_of(value.type)
        types[value.name] = value.type.tensor_type.elem_type
        if shape is not None and all(isinstance(dim, int) for dim in shape):
            shapes[value.name] = [int(dim) for dim in shape]
    for tensor in graph.initializer:
        shapes[tensor.name] = list(tensor.dims)
        types[tensor.name] = tensor.data_type
    output_names = {value.name for value in graph.output}
    flops = activation_bytes = unresolved = 0
    for node in graph.node:
        node_flops = _node_flops(node, shapes)
        unresolved += node_flops is None
        flops += node_flops or 0
        for name in node.output:
            if name and name not in output_names and name in shapes:
                activation_bytes += _tensor_bytes(types.get(name, 0), math.prod(shapes[name]))

    def io_bytes(values: Sequence[onnx.ValueInfoProto]) -> int:
        return sum(_tensor_bytes(types[value.name], math.prod(shapes[value.name]))
                   for value in values if value.name in shapes)

    return {
        "flops": flops,
        "activation_bytes": activation_bytes,
        # The copy lists big weights as inputs; only the original model's inputs are fed.
        "input_bytes": io_bytes(true_inputs(model.graph)),
        "output_bytes": io_bytes(list(graph.output)),
        "unresolved_nodes": unresolved,
    }


METADATA_KEEP_BYTES = 65_536
"""Most bytes of a model's `metadata_props` (keys and values) kept in its profile, `sits.*` entries first:
the profile is stored in Redis and answered by every `GET /v1/models`, so a model carrying megabytes of
metadata (each version a registration away) must not carry them into the shared store."""


def _kept_metadata(props: Any) -> dict[str, Any]:
    """{"metadata": the entries kept} and, when some were left out, {"metadata_dropped": how many}."""
    kept: dict[str, str] = {}
    dropped, size = 0, 0
    for prop in sorted(props, key=lambda prop: not prop.key.startswith("sits.")):  # (stable: file order within)
        each = len(prop.key) + len(prop.value)
        if size + each > METADATA_KEEP_BYTES:
            dropped += 1
            continue
        kept[prop.key], size = prop.value, size + each
    return {"metadata": kept, **({"metadata_dropped": dropped} if dropped else {})}


def static_profile(model: onnx.ModelProto) -> dict[str, Any]:
    """A JSON-serialisable cost estimate of one sample, computed from the graph alone.

    Dynamic dims are fixed (batch 1; other dynamic axes REFERENCE_SEQUENCE_LENGTH)
    on a copy and shapes inferred. FLOPs count 2*M*K*N for MatMul/Gemm/Conv and
    one per element otherwise; activation bytes sum every intermediate tensor
    (graph outputs excluded). For token models (a dynamic axis besides axis 0)
    "per sample" means one sequence of the reference length, and the per-token
    figures are those divided by it. `unresolved_nodes` counts nodes whose
    shapes could not be inferred, making the totals lower bounds. A model
    with a fixed batch axis is profiled at that batch size.
    """
    # Weights stored as Constant nodes (some exporters do) are parameters too.
    params = [*model.graph.initializer, *(
        attribute.t for node in model.graph.node if node.op_type == "Constant"
        for attribute in node.attribute if attribute.name == "value")]
    param_count = sum(math.prod(tensor.dims) for tensor in params)
    param_bytes = sum(_tensor_bytes(tensor.data_type, math.prod(tensor.dims)) for tensor in params)
    axis = sequence_axis(model)
    measured = _measure(model)
    profile: dict[str, Any] = {
        "signature": model_signature(model),
        "opset": default_opset(model),
        **_kept_metadata(model.metadata_props),
        "op_histogram": operator_histogram(model),
        "param_count": param_count,
        "param_bytes": param_bytes,
        "flops_per_sample": measured["flops"],
        "activation_bytes_per_sample": measured["activation_bytes"],
        "input_bytes_per_sample": measured["input_bytes"],
        "output_bytes_per_sample": measured["output_bytes"],
        "unresolved_nodes": measured["unresolved_nodes"],
        "sequence_axis": axis,
    }
    if axis is not None:
        profile["vocabulary_size"] = vocabulary_size(model, axis["input"])
        profile["reference_sequence_length"] = REFERENCE_SEQUENCE_LENGTH
        profile["flops_per_token"] = profile["flops_per_sample"] // REFERENCE_SEQUENCE_LENGTH
        profile["activation_bytes_per_token"] = (
            profile["activation_bytes_per_sample"] // REFERENCE_SEQUENCE_LENGTH)
    return profile
