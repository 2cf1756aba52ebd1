"""A model version's registry record, typed: read from its JSON in one place (`registry.get_model`).

Callers read named fields (`record.signature`, `record.profile`); the record becomes a dict only
at the API's edge (`to_json`). The parts a record carries as JSON objects are typed as far as
SITS reads them: the signature's tensors and the profile's points (`TypedDict`s, so a record
written by an older release still reads). The static profile is what `sits_worker.model.graph`
measures of the graph; its readers there take it as a mapping, and this record names the few
figures the scheduler reads of it. A JSON field this record does not name is carried in `extra`,
so that `GET /v1/models/<ref>` still shows it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NotRequired, TypedDict


class TensorSpec(TypedDict):
    """One input or output of a model's graph: its name, element type and shape (a name for a dynamic
    axis; None for a shape of unknown rank), and which axes are dynamic."""

    name: str
    dtype: str
    shape: list[int | str] | None
    dynamic_axes: list[int]


class Signature(TypedDict):
    """A model's inputs and outputs, in graph order."""

    inputs: list[TensorSpec]
    outputs: list[TensorSpec]


class ProfilePoint(TypedDict):
    """One batch size of a profile: how long a run of it took and the rows a second that makes."""

    batch_size: int
    latency_ms: float
    rows_per_second: float
    p99_ms: NotRequired[float]


class ModelProfile(TypedDict, total=False):
    """How a model version runs on a device: measured by a worker on registration (`source`
    'measured', the default) or observed from the batches workers ran (`source` 'observed')."""

    source: str
    device: str
    """Where it was measured: 'cpu', 'gpu:0'."""
    measured_at: float
    points: list[ProfilePoint]
    pareto: list[ProfilePoint]
    worker: str
    providers: list[str]
    sequence_length: int
    """A token model's: tokens of the rows it was measured on."""


@dataclass(frozen=True)
class ModelRecord:
    """One registered model version: its stored file, graph, what its name's owner is, and its profiles."""

    name: str
    version: str
    """The content hash of the stored graph."""
    path: str
    """The stored copy that workers load."""
    signature: Signature
    static_profile: dict[str, Any]
    """What the graph says without running it (`sits_worker.model.graph.static_profile`)."""
    source_path: str | None = None
    """The file it was registered from."""
    owner: str | None = None
    """The tenant its name belongs to; None for a name no tenant owns."""
    profile: ModelProfile | None = None
    profile_status: str = "static"
    """static (no worker profile asked), pending, ready or failed."""
    profile_error: str | None = None
    profile_mode: str | None = None
    enable_fusion: bool = False
    fusion: dict[str, Any] | None = None
    """The fused graph a worker saved beside the stored one, and its operator counts."""
    registered_at: float | None = None
    stored_bytes: int | None = None
    """What its stored copy holds on disk, external data included (what its owner's `max_model_bytes` counts)."""
    tuned_batching: dict[str, Any] | None = None
    """Per kind of device ('cpu', 'gpu'), the batching a tuning sweep chose and `--apply` stored
    (`max_batch_size`, `max_queue_delay` in seconds, `streams`, and the figures it was chosen by)."""
    latest: bool | None = None
    """Whether it is its name's newest version; known only in a listing of versions."""
    extra: dict[str, Any] = field(default_factory=dict)
    """JSON fields this record does not name, as they are stored."""

    @property
    def ref(self) -> str:
        """`name@version`: how the version is named everywhere else."""
        return f"{self.name}@{self.version}"

    @property
    def output_names(self) -> list[str]:
        """The graph's output names, in order."""
        return [output["name"] for output in self.signature["outputs"]]

    @property
    def token_model(self) -> bool:
        """Whether its inputs have a sequence axis (rows cost by their tokens)."""
        return bool(self.static_profile.get("sequence_axis"))

    @property
    def observed_profile(self) -> bool:
        """Whether its profile was observed from batches run rather than measured."""
        return self.profile is not None and self.profile.get("source") == "observed"

    @property
    def profile_points(self) -> list[ProfilePoint]:
        """The points of its profile, as stored ([] without one)."""
        return list((self.profile or {}).get("points") or [])

    @classmethod
    def of(cls, stored: Mapping[str, Any]) -> ModelRecord:
        """The record of a version's stored JSON object."""
        known = {name: stored[name] for name in _NAMES if name in stored and stored[name] is not None}
        # (a damaged part reads as none)
        for part in ("signature", "static_profile", "profile", "fusion", "tuned_batching"):
            if not isinstance(known.get(part, {}), dict):
                del known[part]
        known.setdefault("name", "")
        known.setdefault("version", "")
        known.setdefault("path", "")
        known.setdefault("signature", {"inputs": [], "outputs": []})
        known.setdefault("static_profile", {})
        return cls(**known, extra={name: value for name, value in stored.items() if name not in _STORED})

    def to_json(self) -> dict[str, Any]:
        """The version as stored, and as the API reports it: fields without a value left out, but for
        `owner` (None: no tenant's)."""
        named = {name: getattr(self, name) for name in _NAMES}
        shown = {name: value for name, value in named.items() if value is not None or name == "owner"}
        return {"ref": self.ref, **shown, **self.extra}

    def replace(self, **changes: Any) -> ModelRecord:
        """This record with `changes` (named fields)."""
        return dataclasses.replace(self, **changes)


_NAMES = tuple(item.name for item in dataclasses.fields(ModelRecord) if item.name != "extra")
_STORED = frozenset(_NAMES) | {"ref"}
