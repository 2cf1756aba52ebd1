"""Measured model profiles and graph fusion, run as a Celery task on the worker's own device.

`profile_mode=full` measures latency and throughput per batch size and keeps
the latency/throughput Pareto points; results are cached in the registry
for `scheduler.model_profile_cache_ttl`. `enable_fusion` saves the graph as
ONNX Runtime optimises it (full optimisation) and records its operator
histogram next to the original's.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from broker.errors import DeviceOutOfMemory, SitsError
from broker.memory import reservation
from broker.models import registry
from broker.models.model_record import ModelRecord
from broker.tenants import usage as tenant_usage
from broker.tenants.usage import BillEntry
from sits_worker.device.run_limits import RunLimits
from sits_worker.device.runtime import build_session, run_session
from sits_worker.model.graph import operator_histogram
from sits_worker.model.samples import PROFILE_SEQUENCE, sample_feed
from sits_worker.serving.context import WorkerContext

log = logging.getLogger(__name__)

_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_PROFILE_SEQUENCE = PROFILE_SEQUENCE


PROFILE_PASSES = 4
"""Rounds over the batch sizes in one sweep: the machine's speed drifts by tens of per cent between
seconds, so each size is timed a little in every round (in alternating order) rather than all at
once, and the sizes are compared under the same drift."""


def measure(session: Any, signature: Mapping[str, Any], *, budget_seconds: float = 1.0,
            batch_sizes: tuple[int, ...] = _BATCH_SIZES, passes: int = PROFILE_PASSES,
            limits: RunLimits | None = None) -> list[dict[str, float]]:
    """Latency (median of timed runs), its 99th percentile and throughput for each batch size, within a
    time budget per size; sizes past the first one the device runs out of memory for are skipped, as
    are those past the first whose one warm-up run takes over a third of the budget.

    Each size is timed in `passes` rounds (`PROFILE_PASSES`), each of a share of its budget: 3 to 50
    runs in all. A job's `auto` batch size is chosen from these points (`broker/jobs/chunking.py`), so a
    size measured in a slow second must not lose to one measured in a fast one.

    `p99_ms` is what schedulability analysis takes as a batch's worst case (`broker/sla/analysis.py`):
    of the 3 to 50 runs timed, it lies close to the slowest one. Each run is held to `limits` (the
    worker's `scheduler.run_time_limit`), as a batch's is.
    """
    feeds: dict[int, dict[str, np.ndarray]] = {}
    for batch in batch_sizes:
        feed = sample_feed(signature, batch)
        try:
            started = time.perf_counter()
            run_session(session, feed, limits=limits)  # warm-up: allocations, kernel choice
            once = time.perf_counter() - started
        except DeviceOutOfMemory:
            if not feeds:
                raise
            break  # the device holds no larger batch: keep what was measured
        feeds[batch] = feed
        if once * 3 > budget_seconds:  # larger batches would take too long to profile
            break
    timings: dict[int, list[float]] = {batch: [] for batch in feeds}
    order = list(feeds)
    for number in range(max(1, passes)):
        last = number == max(1, passes) - 1
        for batch in order if number % 2 == 0 else reversed(order):
            taken, started = timings[batch], time.perf_counter()
            share = budget_seconds / max(1, passes)
            least = 3 if last else 1
            while len(taken) < least or (time.perf_counter() - started < share and len(taken) < 50 * (number + 1)
                                         // max(1, passes)):
                t0 = time.perf_counter()
                run_session(session, feeds[batch], limits=limits)
                taken.append(time.perf_counter() - t0)
    points: list[dict[str, float]] = []
    for batch, taken in timings.items():
        latency = float(np.median(taken))
        points.append({"batch_size": batch, "latency_ms": round(latency * 1000, 3),
                       "rows_per_second": round(batch / latency, 1),
                       "p99_ms": round(float(np.percentile(taken, 99)) * 1000, 3)})
    return points


def pareto_points(points: list[dict[str, float]]) -> list[dict[str, float]]:
    """The points no other point beats on both lower latency and higher throughput."""
    front: list[dict[str, float]] = []
    for point in sorted(points, key=lambda p: (p["latency_ms"], -p["rows_per_second"])):
        if not front or point["rows_per_second"] > front[-1]["rows_per_second"]:
            front.append(point)
    return front


@dataclass(frozen=True)
class BillPayer:
    """Whom a profile's device time is billed to: the tenant whose key registered the model, and the key's
    name ('' for both: a registration from before profiles were billed, billed to no one)."""

    tenant: str = ""
    owner: str = ""


def profile_and_record(ctx: WorkerContext, model_ref: str, *, profile_mode: str, enable_fusion: bool,
                       now: float | None = None, payer: BillPayer = BillPayer()) -> ModelRecord:
    """Fuse and/or measure `model_ref` and write the results into its registry record; the seconds it held
    the device are billed to `payer` as its work's runs are (`broker/tenants/usage.py`)."""
    now = time.time() if now is None else now
    record = registry.get_model(ctx.store, model_ref)
    fields: dict[str, Any] = {}
    began = time.monotonic()
    try:
        if enable_fusion:
            fields["fusion"] = fuse(ctx, record)
        if profile_mode == "full":
            cached = record.profile or {}
            fresh = not record.observed_profile and cached.get("device") == str(ctx.device) and (
                now - cached.get("measured_at", 0) < ctx.settings.scheduler.model_profile_cache_ttl)
            if not fresh:
                session = ctx.session(model_ref)
                with _reserved(ctx, record):
                    points = measure(session, record.signature, limits=ctx.run_limits)
                fields["profile"] = {"source": "measured", "device": str(ctx.device), "measured_at": now,
                                     "points": points, "pareto": pareto_points(points), "worker": ctx.name,
                                     "providers": session.get_providers(),
                                     "sequence_length": _PROFILE_SEQUENCE}  # of token models' sample rows
        fields["profile_status"] = "ready"
    except SitsError as err:
        fields.update(profile_status="failed", profile_error=err.message)
    finally:
        _bill(ctx, model_ref, payer, seconds=time.monotonic() - began, now=now)
    updated = registry.update_model_version(ctx.store, model_ref, fields)
    ctx.remember_model(model_ref, updated)
    return updated


@contextlib.contextmanager
def _reserved(ctx: WorkerContext, record: ModelRecord) -> Iterator[None]:
    """The device memory of the profile's largest batch, reserved in the worker's ledger while it is
    measured, so the batches the worker's other slots admit meanwhile leave it room (and it them)."""
    rows = max(_BATCH_SIZES)
    need = reservation.BatchCost.of(record, max_rows=rows, max_tokens=0).need_bytes(rows=rows)
    handle = ctx.ledger.reserve(need, now=time.time(), expected_seconds=len(_BATCH_SIZES))
    try:
        yield
    finally:
        ctx.ledger.release(handle, now=time.time())


def _bill(ctx: WorkerContext, model_ref: str, payer: BillPayer, *, seconds: float, now: float) -> None:
    """Bill a profile's device time to its payer, at once (a profile is rare, and long beside a run)."""
    if not payer.tenant:
        return
    try:
        tenant_usage.note_usage(ctx.store, [BillEntry(payer.tenant, payer.owner, model_ref, ctx.device.kind, seconds,
                                                      rows=0)],
                                now=now, half_life=ctx.settings.fair_share.usage_half_life)
    except SitsError as err:  # (Redis away: the profile itself still counts)
        log.warning("could not bill %.3f s of profiling %s to tenant %s: %s", seconds, model_ref, payer.tenant,
                    err.message)


def fuse(ctx: WorkerContext, record: ModelRecord) -> dict[str, Any]:
    """Save the fully optimised graph beside the stored model and count its operators."""
    source = Path(record.path)
    fused_path = source.with_name(source.stem + ".fused.onnx")
    build_session(source, ctx.device, ctx.sessions.intra_op_threads, optimized_model_path=fused_path)
    fused = onnx.load(str(fused_path), load_external_data=False)
    histogram = operator_histogram(fused)
    return {"path": str(fused_path), "device": str(ctx.device), "op_histogram": histogram,
            "node_count": sum(histogram.values()),
            "original_node_count": sum(record.static_profile["op_histogram"].values())}
