"""Typed views of a job's hash for readers that need a few of its fields (`broker/state/hash_views.py`).

`broker/jobs/records.py` reads a whole job as its record; these serve the readers that ask for a
handful of fields, of one job or of many in one pipelined HMGET.
"""

from __future__ import annotations

from dataclasses import dataclass

from broker.state.hash_views import HashView


@dataclass(frozen=True)
class ActiveJobView(HashView):
    """What deadline admission reads of each active job: how much is left, of which model, by when."""

    status: str | None
    rows_total: str | None
    rows_done: str | None
    chunks_total: str | None
    chunks_done: str | None
    model_ref: str | None
    batch_size: str | None
    deadline: str | None
    chunk_started_at: str | None
    chunk_size: str | None
    max_slots: str | None
    """Its slot cap ('' or None: none)."""


@dataclass(frozen=True)
class EndedJobView(HashView):
    """What a job that left the active index teaches: its run's times against its model's profile, and its
    deadline's outcome for the violation predictor."""

    status: str | None
    started_at: str | None
    finished_at: str | None
    resumed_at: str | None
    rows_total: str | None
    chunks_total: str | None
    model_ref: str | None
    batch_size: str | None
    deadline: str | None
    sla_snapshots: str | None
    busy_seconds: str | None
    slot_mix: str | None
    slot_time_partial: str | None
    """Set when one of its chunks lost its lease: its slot time then counts a frozen worker's run."""


@dataclass(frozen=True)
class JobOwnerView(HashView):
    """A job's status, the key that submitted it and its tenant (None: stored before jobs had one)."""

    status: str | None
    owner: str | None
    tenant: str | None


@dataclass(frozen=True)
class JobTenantView(HashView):
    """A job's status, its model's queue, and whom its chunks bill (its tenant, else its owner)."""

    status: str | None
    model_ref: str | None
    tenant: str | None
    owner: str | None


@dataclass(frozen=True)
class JobStopView(HashView):
    """What a stop reads of its job: its items' model queue and count, and the stop under way."""

    model_ref: str | None
    chunks_total: str | None
    status: str | None
    stop_id: str | None
