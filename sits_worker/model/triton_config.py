"""A Triton model configuration (`config.pbtxt`), parsed with Triton's own protobuf and checked as Triton checks it.

Pure: text in, a `ModelConfig` message or a refusal (`BadInput`) out. The checks of the whole
configuration are Triton's own, with Triton's messages (its `qa/L0_model_config` cases say them:
"'max_batch_size' must be non-negative value for m"); the fields SITS cannot honour are refused
with a message that names the field. The configuration is then completed from, and checked
against, the ONNX graph's signature in `sits_worker.model.triton_autofill`. docs/models.md,
"A Triton model repository", lists what is honoured and what is refused.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format, text_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from tritonclient.grpc import model_config_pb2 as pb

from broker.errors import BadInput

ModelConfig = pb.ModelConfig
ONNX_PLATFORM = "onnxruntime_onnx"
ONNX_BACKEND = "onnxruntime"
DEFAULT_MODEL_FILENAME = "model.onnx"
SITS_PRIORITY_LEVELS = 16
"""SITS's priority levels: a config with more than these cannot map each onto its own."""
MAX_QUEUE_DELAY_MICROSECONDS = 1_000_000
"""SITS's longest `online.batching.max_queue_delay` (1 s)."""
WILDCARD_DIM = -1

NUMPY_OF_TYPE = {"TYPE_BOOL": "bool", "TYPE_UINT8": "uint8", "TYPE_UINT16": "uint16", "TYPE_UINT32": "uint32",
                 "TYPE_UINT64": "uint64", "TYPE_INT8": "int8", "TYPE_INT16": "int16", "TYPE_INT32": "int32",
                 "TYPE_INT64": "int64", "TYPE_FP16": "float16", "TYPE_FP32": "float32", "TYPE_FP64": "float64"}
"""Triton's data types SITS carries, as numpy names (TYPE_STRING and TYPE_BF16 it does not)."""
TYPE_OF_NUMPY = {numpy: triton for triton, numpy in NUMPY_OF_TYPE.items()}

_UNSUPPORTED_FIELDS = {
    "sequence_batching": "SITS has no sequence batcher (stateful models); serve a stateless model",
    "batch_input": "SITS adds no batch inputs to a graph",
    "batch_output": "SITS scatters no batch outputs",
    "model_repository_agents": "SITS runs no repository agents",
}


def parse_config(text: str | None, model_name: str) -> Message:
    """The `config.pbtxt` text of the model folder `model_name` as a ModelConfig (an empty one, named,
    for a folder without one: Triton then completes it from the graph). A text Triton's parser refuses,
    an unknown field among them, is refused with the parser's message, which names the line and field."""
    config = pb.ModelConfig()
    if text is not None:
        try:
            text_format.Parse(text, config)
        except text_format.ParseError as err:
            raise BadInput(f"failed to parse config.pbtxt of model '{model_name}': {err}") from None
    if not config.name:
        config.name = model_name
    elif config.name != model_name:
        raise BadInput(f"unexpected directory name '{model_name}' for model '{config.name}', directory name "
                       "must equal model name")
    return config


def check_config(config: Any) -> None:
    """Refuse `config` (BadInput) as Triton's model configuration check would, then anything in it SITS
    cannot honour, each with a message that names the field."""
    name = config.name
    if config.max_batch_size < 0:
        raise BadInput(f"'max_batch_size' must be non-negative value for {name}")
    for kind, entries in (("input", config.input), ("output", config.output)):
        for entry in entries:
            _check_io(entry, kind, config.max_batch_size, name)
    if config.HasField("dynamic_batching"):
        _check_dynamic_batching(config.dynamic_batching, config.max_batch_size, name)
    if config.HasField("ensemble_scheduling"):
        if config.platform != "ensemble":
            raise BadInput(f"ensemble scheduling cannot be set for model '{name}' whose platform is not ensemble")
        raise BadInput(f"ensemble_scheduling of model '{name}': SITS runs one ONNX graph per model, not ensembles; "
                       "merge the steps into one graph")
    for index, group in enumerate(config.instance_group):
        _check_instance_group(group, index, name)
    _check_sits_can_serve(config)


def _check_io(entry: Any, kind: str, max_batch_size: int, name: str) -> None:
    """Triton's checks of one input or output (`ValidateIOShape`)."""
    prefix = f"model {kind} '{entry.name}' "
    if not entry.name:
        raise BadInput(f"model {kind} must specify 'name' for {name}")
    if entry.data_type == pb.TYPE_INVALID:
        raise BadInput(f"{prefix}must specify 'data_type' for {name}")
    if any(dim < 1 and dim != WILDCARD_DIM for dim in entry.dims):
        raise BadInput(f"{prefix}dimension must be integer >= 1, or {WILDCARD_DIM} to indicate a variable-size "
                       f"dimension for {name}")
    if not entry.HasField("reshape"):
        return
    shape = list(entry.reshape.shape)
    if max_batch_size == 0 and not shape:
        raise BadInput(f"{prefix}cannot have empty reshape for non-batching model as scalar tensors are not "
                       f"supported for {name}")
    if any(dim < 1 and dim != WILDCARD_DIM for dim in shape):
        raise BadInput(f"{prefix}reshape dimensions must be integer >= 1, or {WILDCARD_DIM} to indicate a "
                       f"variable-size dimension for {name}")
    dims_size, reshape_size = element_count(entry.dims), element_count(shape)
    if dims_size != reshape_size and (reshape_size != 0 or dims_size != 1):
        raise BadInput(f"{prefix}has different size for dims and reshape for {name}")
    if dims_size == WILDCARD_DIM:
        if _trunks(entry.dims) != _trunks(shape):
            raise BadInput(f"{prefix}has different "
                           + ("number of variable-size dimensions" if len(_trunks(entry.dims)) != len(_trunks(shape))
                              else "size") + f" for dims and reshape for {name}")


def element_count(dims: Any) -> int:
    """Elements of a shape, -1 when a dimension is variable (Triton's `GetElementCount`); 0 for no dims."""
    dims = list(dims)
    if not dims:
        return 0
    if WILDCARD_DIM in dims:
        return WILDCARD_DIM
    count = 1
    for dim in dims:
        count *= dim
    return count


def _trunks(dims: Any) -> list[int]:
    """The element counts of the runs of fixed dimensions between variable ones."""
    counts, current = [], 1
    for dim in dims:
        if dim == WILDCARD_DIM:
            counts.append(current)
            current = 1
        else:
            current *= dim
    return [*counts, current]


def _check_dynamic_batching(batching: Any, max_batch_size: int, name: str) -> None:
    """Triton's checks of `dynamic_batching`, then SITS's limits on it."""
    for size in batching.preferred_batch_size:
        if size <= 0:
            raise BadInput(f"dynamic batching preferred size must be positive for {name}")
        if size > max_batch_size:
            raise BadInput(f"dynamic batching preferred size must be <= max batch size for {name}")
    levels = batching.priority_levels
    if levels != 0:
        if batching.default_priority_level == 0 or batching.default_priority_level > levels:
            raise BadInput(f"default priority level must be in range [1, {levels}] for {name}")
        for level in batching.priority_queue_policy:
            if level == 0 or level > levels:
                raise BadInput(f"priority queue policy must have priority level in range [1, {levels}] for {name}")
    if batching.preserve_ordering:
        if levels > 1:
            raise BadInput(f"Only one priority level is allowed when 'preserve_ordering' is true for {name}")
        for policy in [batching.default_queue_policy, *batching.priority_queue_policy.values()]:
            if policy.default_timeout_microseconds != 0 and policy.timeout_action == pb.ModelQueuePolicy.DELAY:
                raise BadInput(f"Queue policy can not have DELAY as timeout action when 'preserve_ordering' is true "
                               f"for {name}")
    if levels > SITS_PRIORITY_LEVELS:
        raise BadInput(f"dynamic_batching.priority_levels {levels} of model '{name}' is more than SITS's "
                       f"{SITS_PRIORITY_LEVELS} priority levels; use at most {SITS_PRIORITY_LEVELS}")
    if batching.max_queue_delay_microseconds > MAX_QUEUE_DELAY_MICROSECONDS:
        raise BadInput(f"dynamic_batching.max_queue_delay_microseconds {batching.max_queue_delay_microseconds} of "
                       f"model '{name}' is longer than SITS's longest queue delay, {MAX_QUEUE_DELAY_MICROSECONDS}")


def _check_instance_group(group: Any, index: int, name: str) -> None:
    """Triton's checks of one `instance_group` entry that need no device, and what SITS cannot place."""
    label = group.name or f"{name}_{index}"
    if group.kind == pb.ModelInstanceGroup.KIND_CPU and group.gpus:
        raise BadInput(f"instance group {label} of model {name} has kind KIND_CPU but specifies one or more GPU")
    for gpu in group.gpus:
        if gpu < 0:
            raise BadInput(f"instance group {label} of model {name} specifies invalid or unsupported gpu id {gpu}. "
                           "GPUs with at least the minimum required CUDA compute compatibility")
    if group.kind == pb.ModelInstanceGroup.KIND_MODEL:
        raise BadInput(f"instance_group {label} of model {name} has kind KIND_MODEL, which SITS cannot place: "
                       "use KIND_AUTO, KIND_CPU or KIND_GPU")
    if group.secondary_devices:
        raise BadInput(f"instance_group {label} of model {name} names secondary_devices, which SITS does not "
                       "place; leave them out")


def _check_sits_can_serve(config: Any) -> None:
    """Refuse the fields SITS cannot honour, each named."""
    name = config.name
    for field, why in _UNSUPPORTED_FIELDS.items():
        value = getattr(config, field)
        if value.ByteSize() if isinstance(value, Message) else len(value):
            raise BadInput(f"{field} of model '{name}': {why}")
    if config.model_transaction_policy.decoupled:
        raise BadInput(f"model_transaction_policy.decoupled of model '{name}': SITS answers each request once; "
                       "serve it not decoupled")
    for kind, entries in (("input", config.input), ("output", config.output)):
        for entry in entries:
            if entry.data_type not in (pb.TYPE_INVALID, *(pb.DataType.Value(t) for t in NUMPY_OF_TYPE)):
                raise BadInput(f"{kind} '{entry.name}' of model '{name}' has data_type "
                               f"{pb.DataType.Name(entry.data_type)}, which SITS does not carry")
            for flag in ("is_shape_tensor", "allow_ragged_batch", "is_non_linear_format_io"):
                if getattr(entry, flag, False):
                    raise BadInput(f"{kind} '{entry.name}' of model '{name}' sets {flag}, which SITS does not honour")
    if config.response_cache.enable:
        raise BadInput(f"response_cache of model '{name}': SITS keeps no response cache; leave it out")
    if config.platform not in ("", ONNX_PLATFORM):
        raise BadInput(f"platform '{config.platform}' of model '{name}' is not one SITS serves: it serves ONNX "
                       f"models (platform '{ONNX_PLATFORM}' or backend '{ONNX_BACKEND}')")
    if config.backend not in ("", ONNX_BACKEND):
        raise BadInput(f"backend '{config.backend}' of model '{name}' is not one SITS serves: it serves ONNX "
                       f"models (platform '{ONNX_PLATFORM}' or backend '{ONNX_BACKEND}')")


def config_json(config: Message) -> dict[str, Any]:
    """The configuration as Triton's `GET /v2/models/{m}/config` writes it: proto field names, 64-bit
    integers as numbers (protobuf's JSON writes them as strings)."""
    return _numbers(config, json_format.MessageToDict(config, preserving_proto_field_name=True))


_INT64 = (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
          FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64)


def _numbers(message: Message, data: dict[str, Any]) -> dict[str, Any]:
    """`data` (MessageToDict of `message`) with its 64-bit integer fields, and integer map keys, as numbers."""
    for field in message.DESCRIPTOR.fields:
        if field.name not in data:
            continue
        value, holder = data[field.name], getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            data[field.name] = {key: _numbers(holder[_map_key(field, key)], item)
                                if value_field.message_type is not None else item for key, item in value.items()}
        elif field.message_type is not None:
            data[field.name] = ([_numbers(sub, item) for sub, item in zip(holder, value, strict=True)]
                                if isinstance(value, list) else _numbers(holder, value))
        elif field.type in _INT64:
            data[field.name] = [int(item) for item in value] if isinstance(value, list) else int(value)
    return data


def _map_key(field: FieldDescriptor, key: str) -> Any:
    return int(key) if field.message_type.fields_by_name["key"].cpp_type != FieldDescriptor.CPPTYPE_STRING else key
