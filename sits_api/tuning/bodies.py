"""The body of `POST /v1/models/<name>/tune` and the answers of the tuning routes."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from broker.online.settings import MAX_BATCH_SIZE, MAX_QUEUE_DELAY
from sits_api.schemas import WholeNumber

MAX_SWEEP_SECONDS = 3600.0
"""The longest a sweep may be planned to take (its settings x concurrencies x (settle + cell) on each kind
of device): a longer one is refused, saying how long it would take."""


class TuneAsk(BaseModel):
    """What to sweep and how to pick: the P99 bound, the search, the loads and the knobs' values."""

    model_config = ConfigDict(extra="forbid", strict=True)

    p99_ms: float = Field(120.0, gt=0, le=600_000, description="the P99 bound the pick must meet, in ms")
    headroom: float = Field(0.2, ge=0, lt=1, description="the pick's P99 stays this share under the bound, so "
                                                          "that it holds when measured again")
    method: Literal["quick", "brute"] = Field("quick", description="brute: every setting; quick: a coordinate "
                                                                   "climb from the smallest setting")
    apply: bool = Field(False, description="store the pick as the model version's batching (source: tuned)")
    refresh: bool = Field(False, description="measure again even when a sweep of the same method is cached")
    concurrencies: list[WholeNumber] = Field([1, 8, 32], min_length=1, max_length=8,
                                             description="closed-loop clients at which each setting is measured")
    cell_seconds: float = Field(2.0, ge=0.2, le=60, description="seconds each point is counted for")
    settle_seconds: float = Field(1.0, ge=0.6, le=30, description="seconds before each point is counted "
                                                                   "(the workers take the setting within 0.5 s)")
    batch_sizes: list[WholeNumber] | None = Field(None, min_length=1, max_length=12,
                                                  description="batch ceilings to try (default: from the profile)")
    delays_ms: list[float] | None = Field(None, min_length=1, max_length=8,
                                          description="max_queue_delay values to try, in ms")
    streams: list[WholeNumber] | None = Field(None, min_length=1, max_length=8,
                                              description="streams per worker to try (default: 1 and the most)")
    device_kind: str | None = Field(None, pattern="^(cpu|gpu)$", description="tune on this kind only "
                                                                            "(default: every live kind)")

    @model_validator(mode="after")
    def _values_in_range(self) -> TuneAsk:
        if any(not 1 <= c <= 256 for c in self.concurrencies):
            raise ValueError("concurrencies must each be 1 to 256 clients")
        if self.batch_sizes and any(not 1 <= b <= MAX_BATCH_SIZE for b in self.batch_sizes):
            raise ValueError(f"batch_sizes must each be 1 to {MAX_BATCH_SIZE}")
        if self.delays_ms and any(not 0 <= d <= MAX_QUEUE_DELAY * 1000 for d in self.delays_ms):
            raise ValueError(f"delays_ms must each be 0 to {MAX_QUEUE_DELAY * 1000:g}")
        if self.streams and any(not 1 <= s <= 64 for s in self.streams):
            raise ValueError("streams must each be 1 to 64")
        return self


class TuningPoint(BaseModel):
    """One setting under one load: what the clients saw."""

    setting: dict[str, Any]
    concurrency: int
    answered: int
    seconds: float
    throughput: float = Field(description="requests answered a second")
    p50_ms: float
    p99_ms: float
    refused: int


class TuningRecord(BaseModel):
    """A sweep of one model version on one kind of device: its progress, its points, front and pick."""

    model_ref: str
    device_kind: str
    method: str
    p99_bound_ms: float
    headroom: float = Field(description="the pick's P99 is at most p99_bound_ms x (1 - headroom)")
    status: str = Field(description="queued (asked, no releaser has begun it), running, done or failed")
    started_at: float
    updated_at: float
    finished_at: float | None
    space: dict[str, Any]
    settings_total: int
    points: list[TuningPoint]
    front: list[TuningPoint]
    chosen: TuningPoint | None = Field(description="the highest-throughput point within the bound; null: none")
    verified: TuningPoint | None = Field(description="the chosen setting measured again at its concurrency")
    applied: bool
    error: str
    tenant: str
    ask_id: str


class ControllerChange(BaseModel):
    """One move of the batching controller."""

    model_ref: str
    device_kind: str
    at: float
    before: dict[str, float]
    after: dict[str, float]
    reason: str


class Tunings(BaseModel):
    """A model version's last sweep on each kind of device, and the batching controller's last changes of it."""

    model_ref: str
    tunings: list[TuningRecord]
    controller_changes: list[ControllerChange] = Field(description="newest first, at most 50")


class TuneStarted(BaseModel):
    """A sweep sent to a releaser: poll `poll` until every kind's record with `ask_id` is done or failed."""

    model_ref: str
    ask_id: str
    device_kinds: list[str]
    status: str
    poll: str
    planned_seconds: float = Field(description="the longest the sweep may take by its plan")
