"""The Open Inference Protocol's bodies (KServe v2, with Triton's extensions) as `/v2` reads and answers
them; the routes are `sits_api.v2.routes`, an `infer` body's checks `sits_api.v2.parsing`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Datatype = Literal["FP32", "FP64", "FP16", "INT64", "INT32", "INT16", "INT8", "UINT8", "UINT16", "UINT32",
                   "UINT64", "BOOL"]
"""The tensor datatypes SITS reads (`sits_api.v2.parsing.DATATYPES`); an answer may name BYTES too."""


class ServerMetadata(BaseModel):
    """`GET /v2`: the server's name and version and the Triton extensions it implements."""

    name: str
    version: str
    extensions: list[str]


class ServerLive(BaseModel):
    """`GET /v2/health/live`."""

    live: bool


class ServerReady(BaseModel):
    """`GET /v2/health/ready`: whether work can be queued."""

    ready: bool


class ModelReady(BaseModel):
    """A model's readiness: 200 ready; 404 never registered; 400 while no worker is alive (with why)."""

    name: str
    ready: bool
    error: str | None = None


class TensorMetadata(BaseModel):
    """An input or output of a model: -1 for a dynamic axis (the batch axis always)."""

    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(BaseModel):
    """`GET /v2/models/{name}`: the model's versions, platform and tensors."""

    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class InferParameters(BaseModel):
    """The request's parameters: Triton's schedule policy (`priority`, `timeout`), SITS's `user_tier`, and
    Triton's `binary_data_output`. Other parameters are ignored."""

    priority: int = Field(0, ge=0, le=2**64 - 1, description="1 the most urgent, larger less so; 0 (or past 16) "
                                                             "the default")
    timeout: int = Field(0, ge=0, le=10**12, description="microseconds: the tolerable delay; 0 none")
    user_tier: Literal["vip", "premium", "free"] = "free"
    binary_data_output: bool = Field(False, description="answer every output as binary data after the JSON")


class TensorParameters(BaseModel):
    """An input tensor's parameters: `binary_data_size` when its bytes follow the JSON header."""

    binary_data_size: int | None = Field(None, ge=0, description="the byte length of its data after the JSON")


class InferInput(BaseModel):
    """One input tensor: its values in `data` (flat or nested, row-major), or its bytes after the JSON header."""

    name: str
    shape: list[int] = Field(description="non-negative dimensions")
    datatype: Datatype
    data: list[Any] | None = Field(None, description="values of the datatype; absent with binary_data_size")
    parameters: TensorParameters | None = None


class OutputParameters(BaseModel):
    """A requested output's parameters."""

    binary_data: bool | None = Field(None, description="answer it as binary data after the JSON")


class RequestedOutput(BaseModel):
    """An output the request asks for (none listed: every output)."""

    name: str
    parameters: OutputParameters | None = None


class InferRequest(BaseModel):
    """`POST /v2/models/{name}/infer`: the protocol's inference request."""

    model_config = ConfigDict(title="InferRequest")

    id: str | None = Field(None, description="echoed in the answer")
    parameters: InferParameters | None = None
    inputs: list[InferInput]
    outputs: list[RequestedOutput] | None = None


class OutputTensorParameters(BaseModel):
    """An output answered in binary: the byte length of its data after the JSON."""

    binary_data_size: int


class InferOutput(BaseModel):
    """One output tensor: `data` flat in row-major order, or its bytes after the JSON header."""

    name: str
    datatype: str
    shape: list[int]
    data: list[Any] | None = None
    parameters: OutputTensorParameters | None = None


class InferResponse(BaseModel):
    """The protocol's inference response."""

    model_name: str
    model_version: str
    id: str
    outputs: list[InferOutput]


class StatDuration(BaseModel):
    """A count and the nanoseconds it took."""

    count: int
    ns: int


class BatchStats(BaseModel):
    """Runs of one batch size."""

    batch_size: int
    compute_input: StatDuration
    compute_infer: StatDuration
    compute_output: StatDuration


class ModelStatistics(BaseModel):
    """One model version's statistics, as Triton's statistics extension writes them."""

    name: str
    version: str
    last_inference: int = Field(description="unix milliseconds")
    inference_count: int
    execution_count: int
    inference_stats: dict[str, StatDuration] = Field(description="success, fail, queue, compute_input, ...")
    batch_stats: list[BatchStats]
    memory_usage: list[dict[str, Any]]


class ModelStatisticsList(BaseModel):
    """`GET /v2/models/stats` and a model's or a version's."""

    model_stats: list[ModelStatistics]


class ConfigTensor(BaseModel):
    """A tensor of a Triton model configuration: dims without the batch axis, -1 dynamic."""

    name: str
    data_type: str = Field(description="TYPE_FP32, TYPE_INT64, ...")
    dims: list[int]


class DynamicBatching(BaseModel):
    """Triton's `dynamic_batching`, with the queue policies where a model sets them."""

    max_queue_delay_microseconds: int
    preferred_batch_size: list[int]
    priority_levels: int
    default_priority_level: int
    default_queue_policy: dict[str, Any] | None = None
    priority_queue_policy: dict[str, dict[str, Any]] | None = None


class ModelConfig(BaseModel):
    """`GET /v2/models/{name}/config`: Triton's model configuration (model_config.proto as JSON)."""

    name: str
    platform: str
    backend: str
    max_batch_size: int
    input: list[ConfigTensor]
    output: list[ConfigTensor]
    dynamic_batching: DynamicBatching
