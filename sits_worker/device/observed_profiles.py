"""Latency profiles learnt from the batches a worker really runs, for models without a measured one.

A model registered with `profile_mode: static` has no measured latency curve:
its estimates (CP-Score's latency term, the riders' fill, batch costs) come
from static FLOPs, and `jobs.batch_size` / `jobs.chunk_size: auto` fall back
to fixed sizes. Every batch a worker runs is a measurement at its size, so
the worker keeps the latest ones per size class (powers of two) and, every
`FLUSH_SECONDS`, writes a profile built from them into the model's record
(`"source": "observed"`), which every consumer reads like a measured one.

A measured profile (`profile_mode: full`) is never overwritten, and replaces
an observed one. Token models are left out: their batches vary in length,
and their profile is per row at one sequence length. Latencies observed
while other streams share the device include that sharing: they are what
the model costs here, not in isolation.
"""

from __future__ import annotations

import functools
import logging
import statistics
import threading
import time
from collections import defaultdict, deque
from typing import Any

from broker.errors import SitsError
from broker.models import registry
from broker.models.model_record import ModelRecord, ProfilePoint
from broker.state.store import Store

log = logging.getLogger(__name__)

FLUSH_SECONDS = 10.0
"""How often a worker writes what it observed (per model, only when it has new samples)."""
SAMPLES_KEPT = 32
"""Latest batches kept per model and size class."""
MIN_SAMPLES = 3
"""Batches a size class needs before it becomes a profile point."""


class ObservedLatencies:
    """One worker process's record of its batches' run times; thread-safe."""

    def __init__(self) -> None:
        self._samples: dict[str, dict[int, deque[tuple[int, float]]]] = defaultdict(dict)
        self._fresh: set[str] = set()
        self._flushed_at = 0.0
        self._lock = threading.Lock()

    def record(self, model_ref: str, rows: int, seconds: float) -> None:
        """One batch of `rows` rows of `model_ref` ran in `seconds`."""
        if rows < 1 or seconds <= 0:
            return
        size_class = _size_class(rows)
        with self._lock:
            classes = self._samples[model_ref]
            classes.setdefault(size_class, deque(maxlen=SAMPLES_KEPT)).append((rows, seconds))
            self._fresh.add(model_ref)

    def points(self, model_ref: str) -> list[ProfilePoint]:
        """Profile points (batch size, median latency, rows/s) of the size classes with enough samples."""
        with self._lock:
            classes = {size: list(samples) for size, samples in self._samples.get(model_ref, {}).items()}
        points: list[ProfilePoint] = []
        for _, samples in sorted(classes.items()):
            if len(samples) < MIN_SAMPLES:
                continue
            rows = round(statistics.median(row for row, _ in samples))
            latency = statistics.median(seconds for _, seconds in samples)
            points.append(ProfilePoint(batch_size=rows, latency_ms=round(latency * 1000, 3),
                                       rows_per_second=round(rows / latency, 1)))
        return points

    def flush(self, store: Store, *, worker: str, device: str, now: float | None = None,
              force: bool = False) -> list[str]:
        """Write the observed profile of every model with new samples whose record has no measured
        profile (at most every `FLUSH_SECONDS` unless `force`); returns the refs written."""
        now = time.time() if now is None else now
        with self._lock:
            if not force and now - self._flushed_at < FLUSH_SECONDS:
                return []
            self._flushed_at = now
            fresh, self._fresh = self._fresh, set()
        written = []
        for model_ref in sorted(fresh):
            points = self.points(model_ref)
            if not points:
                with self._lock:
                    self._fresh.add(model_ref)  # not enough samples yet: try again next time
                continue
            try:
                record = registry.update_model_version(
                    store, model_ref, functools.partial(_merged, points=points, device=device, worker=worker, now=now))
            except SitsError as err:  # this model (deleted, or Redis away): the others still go
                log.warning("could not write the observed profile of %s: %s", model_ref, err)
                continue
            if (record.profile or {}).get("measured_at") == now:
                written.append(model_ref)
        return written


def _size_class(batch_size: int) -> int:
    return 1 << (max(1, batch_size).bit_length() - 1)


def _merged(record: ModelRecord, points: list[ProfilePoint], device: str, worker: str,
            now: float) -> dict[str, Any] | None:
    """The record's new observed profile: its points of the same device, each size class replaced by
    this worker's where it has one (workers running different sizes, such as one serving jobs and
    one serving requests, add up instead of overwriting each other); None when the record takes no
    observed profile: over a measured one, or a token model's. Points of another kind of device are
    dropped (a CPU's latencies say nothing of a GPU's); GPUs of one kind are taken as alike."""
    if record.token_model:
        return None
    current = record.profile or {}
    if record.profile_points and not record.observed_profile:
        return None
    kept = {}
    if str(current.get("device", "")).partition(":")[0] == device.partition(":")[0]:  # same kind (gpu:0, gpu:1)
        kept = {_size_class(int(point["batch_size"])): point for point in current.get("points") or []}
    kept |= {_size_class(int(point["batch_size"])): point for point in points}
    return {"profile": {"source": "observed", "device": device, "measured_at": now, "worker": worker,
                        "points": [kept[size] for size in sorted(kept)]}}
