"""Model versions and registrations, as `/v1/models` answers them (`broker.models.model_record`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class Tensor(BaseModel):
    """One input or output of a model's graph."""

    name: str
    dtype: str
    shape: list[int | str] | None = Field(description="a name for a dynamic axis; null for unknown rank")
    dynamic_axes: list[int]


class Signature(BaseModel):
    """A model's inputs and outputs, in graph order."""

    inputs: list[Tensor]
    outputs: list[Tensor]


class ModelVersion(BaseModel):
    """One registered model version. Fields without a value are left out; `owner`, `path` and `source_path`
    are null to keys of other tenants."""

    ref: str = Field(description="name@version")
    name: str
    version: str = Field(description="the content hash of the stored graph")
    path: str | None
    signature: Signature
    static_profile: dict[str, Any]
    source_path: str | None = None
    owner: str | None = Field(description="the tenant its name belongs to; null for none (or hidden)")
    profile: dict[str, Any] | None = None
    profile_status: str = Field(description="static, pending, ready or failed")
    profile_error: str | None = None
    profile_mode: str | None = None
    enable_fusion: bool
    fusion: dict[str, Any] | None = None
    registered_at: float | None = None
    stored_bytes: int | None = Field(None, description="bytes its stored copy holds, external data included "
                                                   "(counted against its owner's max_model_bytes)")
    tuned_batching: dict[str, Any] | None = Field(None, description="per kind of device, the batching a tuning "
                                                                    "sweep chose and applied")
    latest: bool | None = Field(None, description="whether it is its name's newest version (in a listing)")


class Batching(BaseModel):
    """The batching settings workers apply to a model, `auto` values resolved."""

    max_batch_size: int
    max_queue_delay_ms: float
    preferred_batch_sizes: list[int]
    max_batch_tokens: int
    queue_capacity: int
    streams: int | None = Field(None, description="most stream slots of a worker that run it at once; null: all")
    source: str = Field(description="config, profile, tuned, trial or controller")
    profile_device: str | None = None


class ModelDetail(ModelVersion):
    """`GET /v1/models/{ref}`: the version, its batching and, for a bare name, every version's hash."""

    versions: list[str] | None = Field(None, description="for a bare name: every version, oldest first")
    batching: Batching


class ModelList(BaseModel):
    """`GET /v1/models`: every registered version."""

    models: list[ModelVersion]


class RegistrationStarted(BaseModel):
    """`POST /v1/models` answered 202: the registration runs on; poll it."""

    registration: str
    name: str
    status: str
    poll: str = Field(description="the path to GET for its outcome")


class Registration(BaseModel):
    """A registration that answered 202: running, registered (with the version) or failed (with its error)."""

    id: str
    name: str
    status: str = Field(description="running, registered or failed")
    started_at: float
    finished_at: float | None
    ref: str | None
    error: str | None = None
    code: str | None = None
    http_status: int | None = Field(None, description="the status its call would have answered had it waited")
    model: ModelVersion | None = None
