"""A cancel racing a job's final merge: the job's status and its output folder never disagree.

The rule: the merge looks at the job's status right before it publishes (outputs, then manifest.json);
a job cancelled by then keeps its parts and no results, and a resume merges again. A cancel that lands
after that look finds the results published, and the finished merge wins: the job is 'succeeded'.

Both orders are run deterministically in-process (real Redis, a real `WorkerContext`; the cancel is
made at a fixed point of the merge), then the sweep's scenario on a real stack.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

import numpy as np
import pytest

from broker.config.settings import Settings
from broker.jobs import fills as job_fills
from broker.jobs import output_layout
from broker.jobs import records as jobs
from broker.jobs import stops as job_stops
from broker.queueing.leases import LeasedItem
from broker.state.store import Store
from sits_api.cli.stack import Stack
from sits_worker.device.pinning import Device
from sits_worker.device.runtime import SessionCache
from sits_worker.serving import outputs
from sits_worker.serving.context import WorkerContext
from sits_worker.serving.execution import process_item
from tests.e2e.stack_helpers import direct_run, frozen, wait_job
from tests.job_items import leased_finalize_item
from tests.leasing import lease_items

CHUNKS = 6
ROWS, CHUNK = 4_000, 4


class MergeHooks:
    """What a finalize step calls as it merges (`execution.MiniBatchHook`): `at_first_block` runs after
    the merge's first block is copied; no lease is kept (the tests lease for 60 s)."""

    def __init__(self, at_first_block: Callable[[], object] = lambda: None) -> None:
        self.at_first_block, self.calls = at_first_block, 0

    def __call__(self, feed: Mapping[str, np.ndarray]) -> Sequence[LeasedItem]:
        return []

    def keep_alive(self) -> None:
        self.calls += 1
        if self.calls == 1:
            self.at_first_block()

    def running(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def run_early(self) -> None:
        pass


@pytest.fixture
def ctx(store: Store) -> WorkerContext:
    return WorkerContext(settings=Settings(), store=store, device=Device("cpu"), streams=1,
                         sessions=SessionCache(Device("cpu"), 1))


def cancel(store: Store, job_id: str) -> str:
    """What `DELETE /v1/jobs/{id}` does; returns the status it answers with."""
    return job_stops.stop_job(store, job_id, status="cancelled", error="cancelled by the user", now=time.time())


def test_a_job_cancelled_while_it_merges_keeps_its_parts_and_gets_no_results_until_resumed(
        ctx: WorkerContext, store: Store, tmp_path: Path) -> None:
    """Results and a manifest in a cancelled job's folder would refuse every new job there (409) and
    tell a reader the job finished; the parts stay as its resumable work."""
    final = leased_finalize_item(store, tmp_path, chunks=CHUNKS)
    job_id = final.payload["job"]
    answered: list[str] = []
    hooks = MergeHooks(lambda: answered.append(cancel(store, job_id)))

    assert process_item(ctx, final, hooks) == "dropped"

    assert answered == ["cancelled"]
    job = jobs.get_job(store, job_id, now=time.time())
    assert job.status == "cancelled" and job.manifest is None, job
    assert sorted(path.name for path in tmp_path.iterdir()) == [outputs.PARTS_DIR]  # no output, no manifest
    assert sorted(path.name for path in (tmp_path / outputs.PARTS_DIR / job_id).iterdir()) == [
        f"logits.{chunk:06d}.npy" for chunk in range(CHUNKS)]  # every part, no temp file of the merge
    assert store.client.zcard(store.keys.inflight(final.model_ref)) == 0
    assert store.client.zcard(store.keys.ready(final.model_ref)) == 0

    assert job_fills.resume_job(store, job_id, now=time.time()) == 1  # only the finalize step: every chunk is done
    [again] = lease_items(store, final.model_ref, now=time.time(), lease_seconds=60, max_items=1)
    assert process_item(ctx, again, MergeHooks()) == "finalized"
    assert jobs.get_job(store, job_id, now=time.time()).status == "succeeded"
    np.testing.assert_array_equal(np.load(tmp_path / "logits.npy")[:, 0], np.arange(CHUNKS))


def test_a_cancel_that_lands_after_the_merge_looked_at_the_status_leaves_the_job_succeeded(
        ctx: WorkerContext, store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cancel comes as the manifest is written: the folder holds the job's complete results, so the
    finished merge wins over the cancel (which answered 'cancelled' a moment before)."""
    final = leased_finalize_item(store, tmp_path, chunks=CHUNKS)
    job_id = final.payload["job"]
    answered: list[str] = []
    write_atomically = outputs._write_atomically

    def cancel_then_write(path: Path, write: Callable[[IO[bytes]], object]) -> None:
        if path.name == outputs.MANIFEST_NAME:
            answered.append(cancel(store, job_id))
        write_atomically(path, write)

    monkeypatch.setattr(outputs, "_write_atomically", cancel_then_write)

    assert process_item(ctx, final, MergeHooks()) == "finalized"

    assert answered == ["cancelled"]
    job = jobs.get_job(store, job_id, now=time.time())
    assert job.status == "succeeded" and job.error is None, job
    assert job.manifest == output_layout.read_manifest(tmp_path)
    assert not (tmp_path / outputs.PARTS_DIR).exists()
    np.testing.assert_array_equal(np.load(tmp_path / "logits.npy")[:, 0], np.arange(CHUNKS))


def test_a_job_cancelled_as_its_last_chunk_is_acked_on_a_stack_has_a_folder_that_agrees_with_its_status(
        mlp_stack: Stack) -> None:
    """The sweep's scenario: the worker is frozen once every chunk is done (its merge not started, under
    way or done), the job cancelled, the worker let go. A cancelled job's folder holds no manifest (which
    would refuse a new job there with 409) nor outputs; a resume finishes the job."""
    client, home = mlp_stack.client(), mlp_stack.settings.paths.home
    rows = np.random.default_rng(7).standard_normal((ROWS, 64), dtype=np.float32)
    np.save(home / "race.npy", rows)
    output_dir = home / "race-out"
    job = client.post("/v1/jobs", {"model": "mlp", "input_batch": str(home / "race.npy"),
                                   "output_dir": str(output_dir), "chunk_size": CHUNK, "batch_size": CHUNK})
    # Straight from Redis, every few ms: the merge of ROWS / CHUNK parts takes some 100 ms.
    job_key, deadline = mlp_stack.store.keys.job(job["id"]), time.monotonic() + 120
    while mlp_stack.store.client.hget(job_key, "chunks_done") != str(ROWS // CHUNK):
        assert time.monotonic() < deadline, client.get(f"/v1/jobs/{job['id']}")
        time.sleep(0.002)
    with frozen(mlp_stack, "worker0"):
        answered = client.delete(f"/v1/jobs/{job['id']}")
    time.sleep(2)  # the merge goes on, if it was under way

    after = client.get(f"/v1/jobs/{job['id']}")
    assert after["status"] in ("cancelled", "succeeded"), after
    assert (output_dir / outputs.MANIFEST_NAME).exists() == (after["status"] == "succeeded"), (answered, after)
    if after["status"] == "cancelled":
        assert not (output_dir / "logits.npy").exists()
        resumed = client.post(f"/v1/jobs/{job['id']}/resume")
        assert resumed["status"] in ("queued", "running"), resumed  # the worker may have taken it already
        after = wait_job(client, job["id"], timeout=120)
    assert after["status"] == "succeeded", after
    expected = direct_run(home / "models" / "mlp.onnx", rows, CHUNK)
    np.testing.assert_allclose(np.load(output_dir / "logits.npy"), expected, rtol=1e-5, atol=1e-6)
