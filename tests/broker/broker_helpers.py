"""Shared helpers of the broker tests: job specs, a worker's ack, and where an item is right now.

Plain functions rather than fixtures, so that the hypothesis state machine
(which builds its own Store per example) can use them too.
"""

from __future__ import annotations

import uuid
from typing import Any

from broker.jobs import progress as job_progress
from broker.jobs import records as jobs
from broker.queueing.leases import LeasedItem
from broker.state.store import Store

NOW = 1_800_000_000.0
"""A fixed, realistic 'now' (2027); tests advance it instead of sleeping."""

MODEL_REF = "mlp@v1"


def job_spec(
    job_id: str | None = None,
    *,
    model_name: str = "mlp",
    model_version: str = "v1",
    rows_total: int = 10,
    chunk_size: int = 4,
    priority: int = 0,
) -> jobs.JobSpec:
    """A valid JobSpec; only what a test varies is a parameter."""
    return jobs.JobSpec(
        job_id=job_id or jobs.new_job_id(),
        model_name=model_name,
        model_version=model_version,
        input_batch="/data/in.npy",
        input_format="npy",
        input_checksum="sha256:0123abcd",
        output_dir="/data/out",
        output_names=["logits"],
        rows_total=rows_total,
        chunk_size=chunk_size,
        batch_size=2,
        priority=priority,
        owner="alice",
    )


def ack(store: Store, item: LeasedItem, *, now: float, worker: str = "w1") -> int:
    """Acknowledge a leased chunk exactly as `sits_worker.serving.execution.run_chunk` does; returns the
    script's reply."""
    return job_progress.ack_chunk(store, item, now=now, worker=worker)


def ready_ids(store: Store, model_ref: str = MODEL_REF) -> list[str]:
    """Item ids waiting in `model_ref`'s queue, best first."""
    return list(store.client.zrange(store.keys.ready(model_ref), 0, -1))


def inflight_deadlines(store: Store, model_ref: str = MODEL_REF) -> dict[str, float]:
    """Item id -> lease deadline of everything leased from `model_ref`."""
    return dict(store.client.zrange(store.keys.inflight(model_ref), 0, -1, withscores=True))


def job_field(store: Store, job_id: str, name: str) -> Any:
    """One raw field of a job hash."""
    return store.client.hget(store.keys.job(job_id), name)


def fresh_prefix() -> str:
    """A key prefix no other test uses."""
    return "t" + uuid.uuid4().hex[:10]
