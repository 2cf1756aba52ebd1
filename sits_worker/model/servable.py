"""Whether SITS can serve a model that passed the ONNX checker, told at registration.

A valid graph may still never serve a request: SITS feeds every input rows
along axis 0, carries only numeric tensors, reads its own `sits.*` metadata,
and needs ONNX Runtime to load it. The API refuses such a model before
anything is stored, naming the problem and the fix, instead of every later
request failing in a worker.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from broker.errors import InvalidModel
from sits_worker.model.graph import default_opset, model_signature, sequence_axis, shape_of, true_inputs
from sits_worker.model.loading import first_line
from sits_worker.model.padding import MASK_INPUT_KEY, MAX_SEQUENCE_KEY, PAD_TOKEN_KEY, mask_spec

# numpy dtype kinds SITS reads from requests and input files and writes as outputs (bool, int, uint,
# float, complex): the kinds tensors.InputSpec accepts. tests/api/v1/test_model_validation.py keeps them agreed.
CARRIED_DTYPE_KINDS = frozenset("biufc")
_INT64_MAX = int(np.iinfo(np.int64).max)




def _carried(elem_type: int) -> bool:
    try:
        return helper.tensor_dtype_to_np_dtype(elem_type).kind in CARRIED_DTYPE_KINDS
    except (KeyError, ValueError, TypeError):
        return False


def _type_name(elem_type: int) -> str:
    try:
        return str(TensorProto.DataType.Name(elem_type))
    except ValueError:
        return f"#{elem_type}"


def _value_problem(value: onnx.ValueInfoProto) -> str | None:
    """Why SITS cannot carry this graph input or output, with the fix; None when it can."""
    kind = value.type.WhichOneof("value")
    if kind != "tensor_type":
        what = kind.removesuffix("_type").replace("_", " ") if kind else "value of no declared type"
        return (f"is a {what}, not a dense tensor; re-export the model with tensor inputs and outputs "
                f"(e.g. without a ZipMap or sequence output)")
    elem_type = value.type.tensor_type.elem_type
    if not _carried(elem_type):
        example = "text tokenised to int64 ids" if elem_type == TensorProto.STRING else "float32"
        return (f"has element type {_type_name(elem_type)}; SITS carries numeric tensors only (bool, int8-int64, "
                f"uint8-uint64, float16/32/64, complex64/128): re-export the model with such a type (e.g. {example})")
    if shape_of(value.type) == []:  # the checker already refuses graph inputs and outputs of unknown rank
        return ("is a scalar (shape []); SITS batches rows along axis 0, so every input and output needs a "
                "leading batch axis: re-export it with a shape like ['batch', ...]")
    return None


def _int_metadata(metadata: dict[str, str], key: str, low: int, high: int | None, meaning: str) -> None:
    """InvalidModel unless metadata `key`, when present, parses as an integer in [low, high]."""
    text = metadata.get(key)
    if text is None:
        return
    try:
        value: int | None = int(text)  # as padding.py reads it
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        allowed = f"an integer from {low} to {high}" if high is not None else f"an integer >= {low}"
        raise InvalidModel(f"metadata {key}={text!r} is not allowed: {key} must be {allowed} ({meaning}); "
                           f"fix or remove it in the model's metadata_props")


def _check_sits_metadata(model: onnx.ModelProto, signature: dict[str, list[dict[str, Any]]]) -> None:
    """Every `sits.*` key SITS reads (padding.py) must parse and be in range, or registration is refused."""
    metadata = {prop.key: prop.value for prop in model.metadata_props}
    _int_metadata(metadata, MAX_SEQUENCE_KEY, 1, None, "the longest sequence the model takes")
    _int_metadata(metadata, PAD_TOKEN_KEY, 0, _INT64_MAX, "the token id the worker pads sequences with")
    if MASK_INPUT_KEY not in metadata:
        return
    inputs = [entry["name"] for entry in signature["inputs"]]
    if not metadata[MASK_INPUT_KEY]:
        raise InvalidModel(f"metadata {MASK_INPUT_KEY}='' names no input; set it to the model's attention mask "
                           f"input (one of {inputs}) or remove it")
    # The same function the API and the workers pad with: what it refuses here would fail every request.
    spec = mask_spec({"metadata": metadata, "signature": signature, "sequence_axis": sequence_axis(model)})
    if spec is None:
        return
    token_dtype = np.dtype(next(e["dtype"] for e in signature["inputs"] if e["name"] == spec.sequence_input))
    if token_dtype.kind in "iu":
        _int_metadata(metadata, PAD_TOKEN_KEY, 0, int(np.iinfo(token_dtype).max),
                      f"a token id that fits {token_dtype.name} input '{spec.sequence_input}'")


def check_servable(model: onnx.ModelProto) -> None:
    """InvalidModel, naming the problem and the fix, unless SITS can serve requests with `model`.

    Checked from the graph alone: an opset the installed onnx knows, at least one input to feed and
    one output, every input and output a numeric tensor with a leading (batch) axis, and valid
    `sits.*` metadata. A fixed batch dim is allowed (the model is profiled at that batch size, and
    `runtime.run_session` runs any batch in pieces of that size), the same for every input.
    """
    newest = onnx.defs.onnx_opset_version()
    opset = default_opset(model)
    if opset is not None and opset > newest:
        raise InvalidModel(f"the model imports opset {opset} of the default ONNX domain, but the newest opset "
                           f"the installed onnx knows is {newest}; re-export the model with opset {newest} or lower")
    signature = model_signature(model)
    if not signature["inputs"]:
        raise InvalidModel(f"graph '{model.graph.name}' has no inputs to feed (none, or only initializers); SITS "
                           f"runs a model on rows of request data: re-export it with at least one input")
    if not model.graph.output:
        raise InvalidModel(f"graph '{model.graph.name}' has no outputs; re-export it with at least one output")
    for role, values in (("input", true_inputs(model.graph)), ("output", model.graph.output)):
        for value in values:
            problem = _value_problem(value)
            if problem:
                raise InvalidModel(f"{role} '{value.name}' {problem}")
    _check_batch_axis(signature)
    _check_sits_metadata(model, signature)


def _check_batch_axis(signature: dict[str, Any]) -> None:
    """InvalidModel unless axis 0 of every input and output can be the batch axis SITS merges requests
    and job rows along, and cuts each one's outputs back on: dynamic everywhere, or one fixed size
    (`runtime.run_session` then runs pieces of it) on the inputs and the outputs alike, and never 0.
    An output whose first axis is a number of its own (a `Shape`, a `ReduceSum` over the batch,
    `NonZero`'s [2, n]) has no rows to give each request back. A 1 there, with a dynamic batch, is
    let through: exporters leave it on outputs that do follow the batch; one that does not (an LSTM's
    [1, batch, hidden] state) is caught when it runs."""
    for role in ("inputs", "outputs"):
        for entry in signature[role]:
            zero = [axis for axis, dim in enumerate(entry["shape"] or []) if dim == 0]
            if zero:
                raise InvalidModel(f"{role[:-1]} '{entry['name']}' declares a zero-size axis {zero[0]} (shape "
                                   f"{entry['shape']}), so no data fits it; re-export the model with that axis "
                                   f"dynamic or of its real size")
    fixed = {entry["name"]: entry["shape"][0] for entry in signature["inputs"]
             if entry["shape"] and isinstance(entry["shape"][0], int)}
    if len(set(fixed.values())) > 1:
        raise InvalidModel(f"inputs fix the batch axis at different sizes ({fixed}); every input of a run has the "
                           f"same rows: re-export the model with one batch size, or a dynamic one")
    rows = next(iter(fixed.values()), None)
    for entry in signature["outputs"]:
        first = (entry["shape"] or [None])[0]
        # A declared 1 beside a dynamic batch is often only a partial export's leftover (dynamic_axes
        # named for the inputs alone) and runs at any batch; the run checks it (`runtime.run_session`).
        if isinstance(first, int) and first != rows and not (rows is None and first == 1):
            batch = f"fixed at {rows}" if rows is not None else "dynamic"
            raise InvalidModel(
                f"output '{entry['name']}' has shape {entry['shape']}: its first axis is {first} while the inputs' "
                f"batch axis is {batch}. SITS merges requests and job rows along axis 0 and cuts every output back "
                f"along it, so each output needs the batch axis first (an output computed over the whole batch, "
                f"such as a Shape or a sum over the rows, has no rows to give back); re-export the model with "
                f"outputs of shape [batch, ...], or leave such outputs out")


RUNTIME_CHECK_MAX_BYTES = 512 * 2**20
"""Models larger than this are not loaded in the API process at registration (`check_runtime_loads`)."""


def check_runtime_loads(serialized_model: bytes, model_name: str) -> Any:
    """InvalidModel unless ONNX Runtime builds a CPU session from the model's bytes; returns that
    session (None when none was built) for the registration probes to run, so a model is loaded once.

    Catches what the ONNX checker passes but no worker can load (an opset or IR version the runtime
    does not support, an operator of an unknown domain). Skipped when the API process has no
    onnxruntime. The session is built cheaply (no graph optimisation, one thread) and dropped. A
    missing CPU kernel (NOT_IMPLEMENTED) does not refuse the model: a GPU worker may have one.
    Skipped too above `RUNTIME_CHECK_MAX_BYTES`: a session holds another copy of the weights, and
    the registration request would wait seconds for it (the checker has run on it all the same).
    The API's ONNX Runtime is the one asked: workers of an older version may still refuse the model.
    """
    if len(serialized_model) > RUNTIME_CHECK_MAX_BYTES:
        return None
    try:
        import onnxruntime as ort
        from onnxruntime.capi.onnxruntime_pybind11_state import NotImplemented as KernelMissing
    except ImportError:
        return None
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.log_severity_level = 4  # fatal only: shape-merge warnings and probe runs are not the caller's business
    try:
        return ort.InferenceSession(serialized_model, sess_options=options, providers=["CPUExecutionProvider"])
    except KernelMissing:
        return None
    except Exception as err:  # onnxruntime raises its own exception types
        reason = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", first_line(err))[:500]
        raise InvalidModel(f"ONNX Runtime cannot load {model_name}: {reason}; fix or re-export the model") from err
