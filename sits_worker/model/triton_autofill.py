"""A Triton model configuration completed from the ONNX graph and checked against it, as Triton's ONNX
Runtime backend does; and the versions a `version_policy` selects.

Pure: a checked `ModelConfig` (`sits_worker.model.triton_config`) and the graph's signature
(`sits_worker.model.graph.model_signature`) in, the configuration as loaded out, or a refusal with
Triton's message ("unexpected inference input 'X', allowed inputs are: A, B"). A folder with no
`config.pbtxt`, or one that leaves inputs, outputs or `max_batch_size` out, is completed the way
Triton auto-completes it: every tensor from the graph, and a graph whose every tensor has a variable
first axis batches with `max_batch_size` 4.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from broker.errors import BadInput
from broker.models.model_record import Signature, TensorSpec
from sits_worker.model.triton_config import (
    DEFAULT_MODEL_FILENAME,
    NUMPY_OF_TYPE,
    ONNX_BACKEND,
    ONNX_PLATFORM,
    TYPE_OF_NUMPY,
    WILDCARD_DIM,
    check_config,
    pb,
)

DEFAULT_MAX_BATCH_SIZE = 4
"""Triton's `--backend-config=default-max-batch-size`: what auto-complete gives a graph that batches."""


def complete_config(config: Any, signature: Signature) -> Any:
    """A copy of `config` completed from the graph's `signature` and checked against it (BadInput with
    Triton's message where they disagree), then checked whole (`check_config`), defaults filled in as
    Triton fills them (platform, backend, version policy, file name, instance group)."""
    loaded = pb.ModelConfig()
    loaded.CopyFrom(config)
    name = loaded.name
    batches = _graph_batches(signature)
    explicit = [*loaded.input, *loaded.output]
    if loaded.max_batch_size == 0 and batches and not any(
            len(entry.dims) == len(_spec(signature, entry.name)["shape"] or [])
            for entry in explicit if _has_spec(signature, entry.name)):
        loaded.max_batch_size = DEFAULT_MAX_BATCH_SIZE  # (no tensor written with the batch axis: Triton's hint)
        if not loaded.HasField("dynamic_batching") and not loaded.HasField("sequence_batching"):
            loaded.dynamic_batching.preferred_batch_size.append(DEFAULT_MAX_BATCH_SIZE)
    if loaded.max_batch_size > 0 and not batches:
        raise BadInput(f"autofill failed for model '{name}': model does not support batching while non-zero "
                       "max_batch_size is specified")
    _complete_tensors(loaded, loaded.input, signature["inputs"], "input")
    _complete_tensors(loaded, loaded.output, signature["outputs"], "output")
    loaded.platform = loaded.platform or ONNX_PLATFORM
    loaded.backend = loaded.backend or ONNX_BACKEND
    loaded.default_model_filename = loaded.default_model_filename or DEFAULT_MODEL_FILENAME
    if not loaded.HasField("version_policy"):
        loaded.version_policy.latest.num_versions = 1
    if not loaded.instance_group:
        loaded.instance_group.add()
    for index, group in enumerate(loaded.instance_group):
        group.name = group.name or f"{name}_{index}"
        group.count = max(group.count, 1)
    check_config(loaded)
    return loaded


def _graph_batches(signature: Signature) -> bool:
    """Whether every tensor of the graph has a variable first axis (Triton's test for a graph that batches)."""
    tensors = [*signature["inputs"], *signature["outputs"]]
    return bool(tensors) and all(spec["shape"] and isinstance(spec["shape"][0], str) for spec in tensors)


def _has_spec(signature: Signature, name: str) -> bool:
    return any(spec["name"] == name for spec in [*signature["inputs"], *signature["outputs"]])


def _spec(signature: Signature, name: str) -> TensorSpec:
    return next(spec for spec in [*signature["inputs"], *signature["outputs"]] if spec["name"] == name)


def graph_dims(spec: TensorSpec) -> list[int]:
    """A tensor's shape as Triton writes it: -1 for a variable axis."""
    return [dim if isinstance(dim, int) else WILDCARD_DIM for dim in spec["shape"] or []]


def _complete_tensors(config: Any, entries: Any, specs: list[TensorSpec], kind: str) -> None:
    """Fill `entries` (the config's inputs or outputs) from the graph's `specs` when it lists none; else
    check each against the graph, and fill a left-out `data_type` or `dims` from it."""
    name, batch = config.name, config.max_batch_size > 0
    allowed = ", ".join(sorted(spec["name"] for spec in specs))
    if not entries:
        for spec in specs:
            entry = entries.add()
            entry.name = spec["name"]
        return _complete_tensors(config, entries, specs, kind)
    if kind == "input" and len(entries) != len(specs):
        raise BadInput(f"unable to load model '{name}', configuration expects {len(entries)} inputs, model "
                       f"provides {len(specs)}")
    by_name = {spec["name"]: spec for spec in specs}
    for entry in entries:
        found = by_name.get(entry.name)
        if found is None:
            raise BadInput(f"unexpected inference {kind} '{entry.name}', allowed {kind}s are: {allowed}")
        spec = found
        graph_type = TYPE_OF_NUMPY.get(spec["dtype"])
        if graph_type is None:
            raise BadInput(f"{kind} '{entry.name}' of model '{name}' has element type {spec['dtype']} in the graph, "
                           "which SITS does not carry")
        if entry.data_type == pb.TYPE_INVALID:
            entry.data_type = pb.DataType.Value(graph_type)
        elif pb.DataType.Name(entry.data_type) != graph_type:
            raise BadInput(f"unable to load model '{name}', configuration expects datatype "
                           f"{pb.DataType.Name(entry.data_type)} for {kind} '{entry.name}', "
                           f"model provides {graph_type}")
        model_dims = graph_dims(spec)
        if not entry.dims and not entry.HasField("reshape"):
            entry.dims.extend(model_dims[1:] if batch else model_dims)
        _check_dims(entry, model_dims, batch, name)


def _check_dims(entry: Any, model_dims: list[int], batch: bool, name: str) -> None:
    """Triton's check of a tensor's configured shape against the graph's (`CompareDimsSupported`): the
    configured shape (a leading batch axis when it batches; `reshape` when given) must have the graph's
    rank, and equal it wherever the graph fixes a dimension."""
    shown = list(entry.reshape.shape) if entry.HasField("reshape") else list(entry.dims)
    full = [WILDCARD_DIM, *shown] if batch else shown
    if len(full) == len(model_dims) and all(m == WILDCARD_DIM or m == c for m, c in zip(model_dims, full, strict=True)):
        return
    described = (f"an initial batch dimension because max_batch_size > 0 followed by the explicit tensor shape, "
                 f"making complete shape {_shape(full)}") if batch else f"shape {_shape(full)}"
    raise BadInput(f"model '{name}', tensor '{entry.name}': the model expects {len(model_dims)} dimensions (shape "
                   f"{_shape(model_dims)}) but the model configuration specifies {len(full)} dimensions ({described})")


def _shape(dims: Iterable[int]) -> str:
    return "[" + ",".join(str(dim) for dim in dims) + "]"


def select_versions(config: Any, available: Sequence[int]) -> list[int]:
    """The versions of `available` (the numbered folders that hold the model file) that the config's
    `version_policy` loads, oldest first: `latest` (the newest `num_versions`, 1 by default), `all`, or
    `specific`, each of whose versions must be there. None at all is refused, as Triton refuses it."""
    policy = config.version_policy
    present = sorted(set(available))
    which = policy.WhichOneof("policy_choice") if config.HasField("version_policy") else None
    if which == "all":
        chosen = present
    elif which == "specific":
        missing = [version for version in policy.specific.versions if version not in present]
        if missing:
            raise BadInput(f"version {missing[0]} is specified for model '{config.name}', but the version directory "
                           "is not present")
        chosen = sorted(set(policy.specific.versions))
    else:
        count = policy.latest.num_versions if which == "latest" and policy.latest.num_versions > 0 else 1
        chosen = present[-count:]
    if not chosen:
        raise BadInput(f"at least one version must be available under the version policy of model '{config.name}'")
    return chosen


def numpy_dtype(data_type: int) -> str:
    """A config `data_type` as a numpy name."""
    return NUMPY_OF_TYPE[pb.DataType.Name(data_type)]


def refuse_unhonoured(config: Any) -> None:
    """Refuse what SITS does not do yet with a loaded config: a `reshape` that differs from `dims`, an
    `optional` input, `model_warmup` (docs/models.md says why each)."""
    for kind, entries in (("input", config.input), ("output", config.output)):
        for entry in entries:
            if entry.HasField("reshape") and list(entry.reshape.shape) != list(entry.dims):
                raise BadInput(f"{kind} '{entry.name}' of model '{config.name}' sets reshape, which SITS does not "
                               "honour: export the graph with the shape the clients send (dims)")
            if getattr(entry, "optional", False):
                raise BadInput(f"{kind} '{entry.name}' of model '{config.name}' is optional, which SITS does not "
                               "honour: it feeds every input of a graph; leave 'optional' out")
    if config.model_warmup:
        raise BadInput(f"model_warmup of model '{config.name}' is not honoured: SITS workers load a model on its "
                       "first batch; leave model_warmup out")


def online_settings(config: Any) -> dict[str, Any]:
    """The `online.models.<name>` keys (`broker.online.settings.ModelBatching`) a loaded config sets: its
    batching, and its queue policy with Triton's defaults (no queue limit, no timeout, REJECT, no
    override), each Triton priority level p as SITS level 16 - p with its own queue limit."""
    batching = config.dynamic_batching
    dynamic = config.HasField("dynamic_batching")

    def policy(entry: Any) -> dict[str, Any]:
        return {"max_queue_size": entry.max_queue_size,
                "default_timeout": entry.default_timeout_microseconds / 1_000_000,
                "timeout_action": "delay" if entry.timeout_action == pb.ModelQueuePolicy.DELAY else "reject",
                "allow_timeout_override": entry.allow_timeout_override}

    default = policy(batching.default_queue_policy)
    levels = {SITS_LEVELS - level: policy(batching.priority_queue_policy[level])
              if level in batching.priority_queue_policy else dict(default)
              for level in range(1, batching.priority_levels + 1)}
    return {"max_batch_size": max(config.max_batch_size, 1),
            "max_queue_delay": batching.max_queue_delay_microseconds / 1_000_000 if dynamic else 0.0,
            "preferred_batch_sizes": sorted(set(batching.preferred_batch_size)),
            **default,
            # with levels, each level has its own limit, as Triton's queues are per level
            **({"max_queue_size": 0, "priority_levels": levels} if levels else {})}


SITS_LEVELS = 16
"""A Triton priority p is SITS level 16 - p, as the v2 `priority` parameter maps it (`sits_api.v2.parsing`)."""
