"""A model version's batching settings, with its `auto` values taken from its measured profile.

The configuration (`online.batching`, `online.models`) names what a user
fixed; what is left `auto` follows the device as measured by the profiler
(`sits_worker/serving/profiler.py`: latency and rows/s per batch size):

- `max_batch_size`: the largest measured batch size whose run takes at most
  `max_batch_latency`. Past it a batch only adds latency to everything in it;
  the memory ledger still cuts a batch to what fits.
- `max_queue_delay`: one row's measured run time, when that is at least
  `MIN_USEFUL_DELAY` (a shorter wait costs a slot more in Redis round trips
  than it can gain), at most `MAX_AUTO_DELAY`. A lone request then waits at
  most about as long as its own run, and under load a free slot lets a batch
  fill instead of running a batch of one.

Without a measured profile (registered with `profile_mode=static`, or not
profiled yet) they are `FALLBACK_MAX_BATCH_SIZE` and no delay, and so they are
for token models (their profile runs one sequence length, while their batches
are bounded by `max_batch_tokens`) and on a worker whose kind of device is not
the one the profile was measured on (a CPU's latencies say nothing of a
GPU's). An observed profile (the batch sizes workers happened to run) is not
used: those sizes follow from `max_batch_size` itself.

Preferred batch sizes are taken as configured (none by default, as in
Triton): the profile measures powers of two on smooth curves, where no size
is cheaper than its neighbours, and a preferred size would only cut a larger
batch into more batches.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

from broker.models.model_record import ModelRecord, ProfilePoint
from broker.models.repository import RepositoryServing
from broker.online.settings import ModelBatching, OnlineSettings

FALLBACK_MAX_BATCH_SIZE = 64
"""An `auto` max_batch_size without a measured profile."""
MIN_USEFUL_DELAY = 0.0005
"""An `auto` max_queue_delay shorter than this is 0."""
MAX_AUTO_DELAY = 0.005
"""The longest `auto` max_queue_delay."""


@dataclass(frozen=True)
class Batching:
    """The batching settings a worker applies to one model version (no `auto` left)."""

    max_batch_size: int
    max_queue_delay: float
    preferred_batch_sizes: tuple[int, ...]
    max_batch_tokens: int
    queue_capacity: int
    source: str
    """'profile' when an `auto` value came from the measured profile, 'tuned' when `sitsctl model tune
    --apply` chose them, 'trial' or 'controller' while a live override holds (`broker/tuning/live.py`),
    else 'config'."""
    profile_device: str = ""
    """The device the profile was measured on, with source 'profile'."""
    streams: int | None = None
    """Most of a worker's stream slots that run the model at once (None: all; 0: none, while a tuning
    sweep measures another kind of device)."""
    closed_loop: bool = False
    """Whether the batching controller steers it: its workers note each answer's latency for it."""

    def to_dict(self) -> dict[str, Any]:
        """The settings as the API shows them (the delay in ms)."""
        shown = {"max_batch_size": self.max_batch_size, "max_queue_delay_ms": round(self.max_queue_delay * 1000, 3),
                 "preferred_batch_sizes": list(self.preferred_batch_sizes), "max_batch_tokens": self.max_batch_tokens,
                 "queue_capacity": self.queue_capacity, "streams": self.streams, "source": self.source}
        return shown | ({"profile_device": self.profile_device} if self.profile_device else {})

    def with_knobs(self, *, max_batch_size: int | None = None, max_queue_delay: float | None = None,
                   streams: int | None = None, source: str) -> Batching:
        """These settings with the knobs a tuning or a controller set (None: kept), preferred sizes above
        the new ceiling dropped."""
        size = self.max_batch_size if max_batch_size is None else int(max_batch_size)
        return dataclasses.replace(
            self, max_batch_size=size,
            max_queue_delay=self.max_queue_delay if max_queue_delay is None else float(max_queue_delay),
            streams=self.streams if streams is None else int(streams), source=source,
            preferred_batch_sizes=tuple(p for p in self.preferred_batch_sizes if p <= size))

    @property
    def enough_rows(self) -> int:
        """Rows that end a head request's wait for company: a full batch, or the smallest preferred one."""
        return min((self.max_batch_size, *self.preferred_batch_sizes))

    def wait_over(self, rows: int, waited: float) -> bool:
        """Whether a head request that has waited `waited` seconds stops waiting for company, with
        `rows` waiting that could join its batch (its own included): they fill a full batch or a
        preferred one, or the delay is up. (The lease then cuts the batch to the largest preferred
        size it reaches: `lease_batch.lua`.)"""
        return rows >= self.enough_rows or waited >= self.max_queue_delay


def measured_points(record: ModelRecord | None, device_kind: str | None = None) -> list[ProfilePoint]:
    """The points (batch size, latency, rows/s) of the record's measured profile by batch size, if
    `auto` settings may follow it (see the module) on a `device_kind` device ('cpu', 'gpu'; None: any);
    else []."""
    profile = record.profile if record is not None else None
    if record is None or profile is None or record.observed_profile or record.token_model:
        return []  # (a profile with no source is a measured one, as everywhere else)
    if device_kind is not None and str(profile.get("device", "")).partition(":")[0] != device_kind:
        return []
    points = [point for point in profile.get("points") or [] if isinstance(point, dict)
              and int(point.get("batch_size") or 0) >= 1 and 0 < float(point.get("latency_ms") or 0) < math.inf]
    return sorted(points, key=lambda point: int(point["batch_size"]))


def resolve(config: ModelBatching, record: ModelRecord | None, device_kind: str | None = None) -> Batching:
    """`config` with its `auto` values taken from the model version's registry `record` for a worker
    on a `device_kind` device (None: the device the profile was measured on); see the module."""
    points = measured_points(record, device_kind)
    from_profile = bool(points) and "auto" in (config.max_batch_size, config.max_queue_delay)
    max_batch_size = config.max_batch_size
    if max_batch_size == "auto":
        within = [int(point["batch_size"]) for point in points
                  if float(point["latency_ms"]) / 1000 <= config.max_batch_latency]
        max_batch_size = (max(within) if within else int(points[0]["batch_size"])) if points \
            else FALLBACK_MAX_BATCH_SIZE
    delay = config.max_queue_delay
    if delay == "auto":
        one_row = float(points[0]["latency_ms"]) / 1000 / int(points[0]["batch_size"]) if points else 0.0
        delay = min(one_row, MAX_AUTO_DELAY) if one_row >= MIN_USEFUL_DELAY else 0.0
    resolved = Batching(
        max_batch_size=int(max_batch_size),
        max_queue_delay=float(delay),
        preferred_batch_sizes=tuple(size for size in config.preferred_batch_sizes if size <= int(max_batch_size)),
        max_batch_tokens=config.max_batch_tokens,
        queue_capacity=config.queue_capacity,
        source="profile" if from_profile else "config",
        profile_device=str((record.profile or {}).get("device", "")) if record is not None and from_profile else "",
        streams=config.streams,
        closed_loop=config.closed_loop,
    )
    tuned = tuned_knobs(record, device_kind)
    if tuned is None:
        return resolved
    return resolved.with_knobs(max_batch_size=tuned.get("max_batch_size"), max_queue_delay=tuned.get("max_queue_delay"),
                               streams=tuned.get("streams"), source="tuned")


def tuned_knobs(record: ModelRecord | None, device_kind: str | None) -> dict[str, Any] | None:
    """The batching `sitsctl model tune --apply` stored on the record for a `device_kind` device (None:
    the kind its profile was measured on, else the only kind tuned), or None."""
    tuned = (record.tuned_batching if record is not None else None) or {}
    if device_kind is None:
        profiled = str(((record.profile if record is not None else None) or {}).get("device", "")).partition(":")[0]
        device_kind = profiled if profiled in tuned else (next(iter(tuned)) if len(tuned) == 1 else None)
    knobs = tuned.get(device_kind) if device_kind else None
    return knobs if isinstance(knobs, dict) else None


_CONFIGURED: dict[tuple[int, str], tuple[ModelBatching, ModelBatching]] = {}
"""(id of the base settings, the record's keys as JSON) -> (the base, the settings made): made once each."""


def configured(online: OnlineSettings, record: ModelRecord) -> ModelBatching:
    """The batching and queue policy settings of the model version of `record`: `online.models.<name>`
    (else `online.batching`), with the keys the config of a version loaded from a Triton model
    repository sets on top (`broker.models.repository`), so every process reads them from the record."""
    base = online.batching_for(record.name)
    serving = RepositoryServing.of(record)
    if serving is None or not serving.online:
        return base
    key = (id(base), json.dumps(serving.online, sort_keys=True))
    cached = _CONFIGURED.get(key)
    if cached is None or cached[0] is not base:
        if len(_CONFIGURED) > 4096:  # (settings objects made and dropped, as tests do)
            _CONFIGURED.clear()
        cached = (base, ModelBatching.model_validate({**base.model_dump(), **serving.online}))
        _CONFIGURED[key] = cached
    return cached[1]
