"""Periodic task sets for schedulability analysis: the request, and each task's cost from a model profile.

A task is (C, T, D): a worst-case execution time, a period and a relative
deadline (D = T unless given). C is given as `wcet_ms`, or derived from a
registered model and a row count: a task's job then runs as SITS runs an
offline job, its rows cut into chunks (queue items) and each chunk into
mini-batches, every mini-batch costing the model's measured P99 at its size.
A worker switches to other work only between queue items, so one item (a
chunk, or the job's final merge) is the task's longest non-preemptible
section. docs/sla.md describes the model; `broker/sla/analysis.py` analyses it.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from broker.errors import Conflict
from broker.jobs import chunking
from broker.jobs.records import chunk_ranges
from broker.models.model_record import ModelRecord
from broker.queueing.scoring import _interpolated_ms

MAX_TASKS = 256
"""Most tasks in one set: enough for any real periodic workload, and it bounds the analysis's work."""

MAX_PERIOD_MS = 86_400_000.0
"""The longest period or deadline a task may have: one day."""

DEFAULT_ITEM_OVERHEAD_MS = 20.0
"""What a worker spends on each queue item besides its mini-batches, for a task derived from a model.

Leasing the item, checking the input file, writing and fsyncing the chunk's part file, the ack, and
for the job's last item the merge of its parts into its outputs. Measured on the 2-core reference
machine (docs/sla.md, "The cost of a queue item"): 10-20 ms an item, up to 40 ms with its cores busy.
A request's `item_overhead_ms` replaces it; measure it on the stack being analysed.
"""

MIN_TIME_MS = 0.001
"""The shortest period, deadline, wcet or section: one microsecond, below anything SITS can run.

Without it a period of 5e-324 passed `gt=0`, R/T overflowed to inf and the analysis failed (a 500).
From 0.001 up to MAX_PERIOD_MS every quotient the analysis takes stays a finite number.
"""


def _at_least_a_microsecond(value: float) -> float:
    """Refuse a time above 0 but below MIN_TIME_MS, saying the least it may be (0 and less: `gt=0`)."""
    if value < MIN_TIME_MS:
        raise ValueError(f"{value:g} ms is shorter than the least the analysis takes, {MIN_TIME_MS:g} ms "
                         "(one microsecond); give a time of 0.001 or more")
    return value


Milliseconds = Annotated[float, Field(gt=0, le=MAX_PERIOD_MS, allow_inf_nan=False,
                                      json_schema_extra={"minimum": MIN_TIME_MS}),
                         AfterValidator(_at_least_a_microsecond)]
TASK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")
DEVICE_KIND = re.compile(r"^(cpu|gpu|cuda)(:\d+)?$")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # as the API's bodies: no "500" for 500


class TaskSpec(_Body):
    """One periodic task as a client writes it: `wcet_ms`, or `model` and `rows`."""

    name: str = Field(..., description="unique in the set; letters, digits, '_', '.', ':', '-'")
    period_ms: Milliseconds
    deadline_ms: Milliseconds | None = Field(None, description="relative deadline; default: the period")
    wcet_ms: Milliseconds | None = Field(None, description="worst-case execution time of one job")
    section_ms: Milliseconds | None = Field(
        None, description="with wcet_ms: its longest non-preemptible part (default: the whole wcet_ms)")
    blocking_ms: Annotated[float, Field(ge=0, le=MAX_PERIOD_MS, allow_inf_nan=False)] | None = Field(
        None, description="overrides the derived blocking term B")
    model: str | None = Field(None, min_length=1, description="`name` or `name@version`, with rows")
    rows: Annotated[int, Field(ge=1, le=2**31)] | None = Field(None, description="rows of one job, with model")
    device: str | None = Field(None, description="device kind the profile must be from: cpu or gpu (cuda)")
    batch_size: Annotated[int, Field(ge=1, le=65_536)] | None = Field(
        None, description="rows per mini-batch (default: as a job gets it, jobs.batch_size)")
    chunk_size: Annotated[int, Field(ge=1, le=10_000_000)] | None = Field(
        None, description="rows per queue item (default: as a job gets it, jobs.chunk_size)")

    @model_validator(mode="after")
    def _one_cost_and_consistent_times(self) -> TaskSpec:
        if not TASK_NAME.fullmatch(self.name):
            raise ValueError(f"task name {self.name!r} must be 1-64 letters, digits, '_', '.', ':' or '-', "
                             "starting with a letter or digit")
        label = f"task '{self.name}'"
        from_model = self.model is not None or self.rows is not None
        if self.wcet_ms is not None and from_model:
            raise ValueError(f"{label} gives both wcet_ms and model/rows; give one of them")
        if self.wcet_ms is None and (self.model is None or self.rows is None):
            missing = "rows" if self.model is not None else "model" if self.rows is not None else "wcet_ms"
            raise ValueError(f"{label} has no {missing}: give wcet_ms, or model and rows to derive it "
                             "from the model's measured profile")
        model_only = {"device": self.device, "batch_size": self.batch_size, "chunk_size": self.chunk_size}
        if self.wcet_ms is not None and (given := [name for name, value in model_only.items() if value is not None]):
            raise ValueError(f"{label}: {', '.join(given)} only apply to a task given as model and rows")
        if self.section_ms is not None and self.wcet_ms is None:
            raise ValueError(f"{label}: section_ms only applies with wcet_ms; a model task's section is "
                             "one queue item (set chunk_size)")
        if self.section_ms is not None and self.wcet_ms is not None and self.section_ms > self.wcet_ms:
            raise ValueError(f"{label}: section_ms {self.section_ms:g} is longer than its wcet_ms {self.wcet_ms:g}")
        if self.device is not None and not DEVICE_KIND.fullmatch(self.device):
            raise ValueError(f"{label}: device {self.device!r} is not a device kind; give cpu or gpu (or cuda)")
        if self.deadline_ms is not None and self.deadline_ms > self.period_ms:
            raise ValueError(f"{label}: deadline_ms {self.deadline_ms:g} is past its period_ms "
                             f"{self.period_ms:g}; the analysis needs D <= T (a job still running when the next "
                             "is released needs a busy-period analysis it does not do)")
        return self


class TaskSet(_Body):
    """`POST /v1/sla/analysis` and `sitsctl sla check FILE`: the task set and how it is scheduled."""

    policy: Literal["rate-monotonic", "deadline-monotonic"] = Field(
        "rate-monotonic", description="priorities: shorter period first, or shorter deadline first")
    workers: Annotated[int, Field(ge=1, le=1024)] = Field(
        1, description="identical workers of one stream each, sharing the queues")
    item_overhead_ms: Annotated[float, Field(ge=0, le=60_000, allow_inf_nan=False)] = Field(
        DEFAULT_ITEM_OVERHEAD_MS, description="a worker's cost per queue item besides its mini-batches "
                                              "(model tasks only)")
    tasks: list[TaskSpec] = Field(..., min_length=1, max_length=MAX_TASKS)

    @model_validator(mode="after")
    def _unique_names(self) -> TaskSet:
        counts = Counter(task.name for task in self.tasks)
        if twice := sorted(name for name, count in counts.items() if count > 1):
            raise ValueError(f"task names must be unique; {', '.join(repr(name) for name in twice)} "
                             "appear more than once")
        return self


@dataclass(frozen=True)
class PeriodicTask:
    """A task ready for analysis: every time in milliseconds, and where each came from."""

    name: str
    wcet_ms: float
    period_ms: float
    deadline_ms: float
    section_ms: float
    """Its longest non-preemptible part: what it blocks a higher-priority task for."""
    blocking_ms: float | None = None
    """Given by the client; None: derived from the lower-priority tasks."""
    wcet_source: str = "given"
    section_source: str = "given"
    detail: dict[str, Any] = field(default_factory=dict)
    """What a model task's cost was derived from (model, rows, batches, P99 ...), passed to the answer."""


@dataclass(frozen=True)
class ModelCost:
    """A model task's C and its longest non-preemptible section, with what they were derived from."""

    wcet_ms: float
    section_ms: float
    wcet_source: str
    section_source: str
    detail: dict[str, Any]


def given_task(spec: TaskSpec) -> PeriodicTask:
    """The task of a `wcet_ms` spec; its section is the whole wcet unless `section_ms` says otherwise."""
    assert spec.wcet_ms is not None
    return PeriodicTask(
        name=spec.name, wcet_ms=spec.wcet_ms, period_ms=spec.period_ms,
        deadline_ms=spec.deadline_ms or spec.period_ms, blocking_ms=spec.blocking_ms,
        section_ms=spec.section_ms or spec.wcet_ms,
        section_source="given" if spec.section_ms else "the whole wcet (no section_ms given)")


def model_task(spec: TaskSpec, cost: ModelCost) -> PeriodicTask:
    """The task of a `model`/`rows` spec, its C and section derived (`model_cost`)."""
    return PeriodicTask(
        name=spec.name, wcet_ms=cost.wcet_ms, period_ms=spec.period_ms,
        deadline_ms=spec.deadline_ms or spec.period_ms, blocking_ms=spec.blocking_ms,
        section_ms=cost.section_ms, wcet_source=cost.wcet_source, section_source=cost.section_source,
        detail=cost.detail)


def device_kind(device: str) -> str:
    """'cpu' or 'gpu' of a device name: 'gpu:1' -> 'gpu', 'cuda' -> 'gpu'."""
    kind = device.partition(":")[0].lower()
    return "gpu" if kind == "cuda" else kind


def measured_points(record: ModelRecord, *, task: str, device: str | None) -> tuple[list[dict[str, Any]], str]:
    """The P99 points (`batch_size`, `latency_ms` = P99) of a model's measured profile, and where they
    came from; Conflict when the model has no measured profile, or one of another device kind."""
    ref = record.ref
    profile = record.profile or {}
    full = f"register it again with profile_mode: full (on a {device or 'cpu or gpu'} worker) for a measured one"
    if record.profile_status == "pending":
        raise Conflict(f"task '{task}': model {ref} is still being profiled; ask again once its "
                       "profile_status is ready (GET /v1/models/{ref})")
    if record.token_model:
        raise Conflict(f"task '{task}': model {ref} is a token model, whose run time depends on each row's tokens; "
                       "give the task's wcet_ms instead")
    if not record.profile_points or record.observed_profile:
        what = "only an observed profile (medians of the batches workers ran)" if profile.get("points") \
            else "no measured profile"
        failed = f" (profiling failed: {record.profile_error})" if record.profile_error else ""
        raise Conflict(f"task '{task}': model {ref} has {what}{failed}; {full}")
    measured_on = str(profile.get("device") or "unknown")
    if device is not None and device_kind(device) != device_kind(measured_on):
        raise Conflict(f"task '{task}' runs on {device}, but model {ref} was profiled on {measured_on}; "
                       f"give device {device_kind(measured_on)}, or profile it on a {device_kind(device)} worker "
                       "(profile_mode: full)")
    points = record.profile_points
    if all(point.get("p99_ms") is not None for point in points):
        return [{"batch_size": point["batch_size"], "latency_ms": point["p99_ms"]} for point in points], \
            f"p99 of the profile measured on {measured_on}"
    return [{"batch_size": point["batch_size"], "latency_ms": point["latency_ms"]} for point in points], \
        f"median (profile has no p99) measured on {measured_on}"


def model_cost(record: ModelRecord, *, task: str, rows: int, batch_size: int, chunk_size: int,
               item_overhead_ms: float, device: str | None) -> ModelCost:
    """C and the longest section of one job of `rows` rows of the model whose registry record is `record`.

    The rows are cut as a job's are (`jobs.chunk_ranges`): chunks of `chunk_size` rows, each run as
    mini-batches of `batch_size` rows and a shorter last one, each costing the profile's P99 at its
    size (interpolated between measured sizes, as latency estimates are). Every queue item (each
    chunk, and the final merge) adds `item_overhead_ms`. The longest section is the longest item.
    """
    points, source = measured_points(record, task=task, device=device)
    if chunk_size < (least := chunking.least_chunk_size(rows)):
        raise Conflict(f"task '{task}': chunk_size {chunk_size:,} cuts {rows:,} rows into more than "
                       f"{chunking.MAX_CHUNKS_PER_JOB:,} chunks, more than a job may have; give {least:,} or more")
    batch_ms = _interpolated_ms(points, batch_size)

    def chunk_ms(chunk_rows: int) -> float:
        full, rest = divmod(chunk_rows, batch_size)
        return full * batch_ms + (_interpolated_ms(points, rest) if rest else 0.0)

    ranges = chunk_ranges(rows, chunk_size)
    first, last = ranges[0], ranges[-1]
    full_chunks = len(ranges) - (1 if last[1] - last[0] != first[1] - first[0] else 0)
    compute_ms = full_chunks * chunk_ms(first[1] - first[0]) + (len(ranges) - full_chunks) * chunk_ms(last[1] - last[0])
    items = len(ranges) + 1  # its chunks and the final merge
    longest_chunk_ms = chunk_ms(first[1] - first[0])
    batches = full_chunks * math.ceil((first[1] - first[0]) / batch_size) + (
        (len(ranges) - full_chunks) * math.ceil((last[1] - last[0]) / batch_size))
    detail = {"model": record.ref, "rows": rows,
              "device": (record.profile or {}).get("device"), "batch_size": batch_size,
              "chunk_size": chunk_size, "batches": batches, "chunks": len(ranges),
              "batch_p99_ms": round(batch_ms, 3), "item_overhead_ms": item_overhead_ms}
    return ModelCost(
        wcet_ms=compute_ms + items * item_overhead_ms,
        section_ms=longest_chunk_ms + item_overhead_ms,
        wcet_source=f"{batches} mini-batches x {source}, + {items} queue items x {item_overhead_ms:g} ms overhead",
        section_source=f"one chunk of {first[1] - first[0]:,} rows ({math.ceil((first[1] - first[0]) / batch_size)} "
                       "mini-batches) + one item's overhead",
        detail=detail)
