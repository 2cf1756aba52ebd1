"""A job's finalize step keeps its lease while it merges (real Redis, a real `WorkerContext`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from broker.config.settings import Settings
from broker.jobs import records as jobs
from broker.queueing import reaping
from broker.state.store import Store
from sits_worker.device.pinning import Device
from sits_worker.device.runtime import SessionCache
from sits_worker.serving import outputs
from sits_worker.serving.between_minibatches import BetweenBatches
from sits_worker.serving.context import WorkerContext
from sits_worker.serving.execution import process_item
from tests.job_items import leased_finalize_item

LEASE_SECONDS = 0.4
CHUNKS = 6


@pytest.fixture
def ctx(store: Store) -> WorkerContext:
    settings = Settings().with_overrides(scheduler={"lease_timeout": LEASE_SECONDS})
    return WorkerContext(settings=settings, store=store, device=Device("cpu"), streams=1,
                         sessions=SessionCache(Device("cpu"), 1))


def test_a_merge_that_outlasts_the_lease_keeps_its_finalize_item_from_the_reaper(
        ctx: WorkerContext, store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Otherwise the reaper hands the finalize item to a second worker, which runs the same merge
    again, and each such take counts an attempt (a long merge on a slow disk could fail the job)."""
    final = leased_finalize_item(store, tmp_path, chunks=CHUNKS, lease_seconds=LEASE_SECONDS)
    returned_by_reaper: list[int] = []
    load_part = outputs._load_part

    def slow_load_part(*args: Any, **kwargs: Any) -> Any:  # a slow disk: the merge of all parts outlasts the lease
        time.sleep(LEASE_SECONDS / 4)
        returned_by_reaper.append(reaping.reap_expired_leases(store, now=time.time(), max_attempts=3).returned)
        return load_part(*args, **kwargs)

    monkeypatch.setattr(outputs, "_load_part", slow_load_part)
    started = time.monotonic()

    assert process_item(ctx, final, BetweenBatches(ctx, final, ticket="")) == "finalized"

    assert time.monotonic() - started > LEASE_SECONDS
    assert len(returned_by_reaper) > CHUNKS and set(returned_by_reaper) == {0}
    assert jobs.get_job(store, final.payload["job"], now=time.time()).status == "succeeded"
    np.testing.assert_array_equal(np.load(tmp_path / "logits.npy")[:, 0], np.arange(CHUNKS))


def test_a_finished_job_removes_only_its_own_parts_not_a_cancelled_job_s_in_the_same_folder(
        ctx: WorkerContext, store: Store, tmp_path: Path) -> None:
    """The cancelled job's parts are its resumable work (a resume re-runs only its missing chunks)."""
    outputs.write_part(tmp_path, 0, {"logits": np.full((1, 2), 7, np.float32)}, job_id="jcancelled")
    cancelled_part = tmp_path / ".parts" / "jcancelled" / "logits.000000.npy"
    kept = cancelled_part.read_bytes()
    final = leased_finalize_item(store, tmp_path, chunks=CHUNKS, lease_seconds=LEASE_SECONDS)

    assert process_item(ctx, final, BetweenBatches(ctx, final, ticket="")) == "finalized"

    assert [path.name for path in (tmp_path / ".parts").iterdir()] == ["jcancelled"]
    assert cancelled_part.read_bytes() == kept
    assert (tmp_path / "manifest.json").is_file()
