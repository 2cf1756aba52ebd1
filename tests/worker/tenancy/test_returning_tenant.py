"""A tenant that fair share took for absent from a model's queue comes back with an online request: the
drain loop's next lease takes that request first, from the model's waiting requests, instead of a chunk
of the tenant that flooded the queue in the meantime; and a slot waiting for the disk does not make it
wait (real Redis, a real `WorkerContext`)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

from broker.config.settings import Settings
from broker.jobs import fills as job_fills
from broker.jobs import records as jobs
from broker.jobs import stops as job_stops
from broker.memory.reservation import Admission
from broker.online import requests
from broker.online.requests import RequestSpec
from broker.queueing import leases
from broker.state.store import Store
from sits_worker.serving.drain_loop import COMMIT_WAIT_SECONDS, _lease_admitted, _wait_for_room
from tests.waiting import eventually
from tests.worker.worker_helpers import mlp_worker_context

SHARES = {"s1": {"guaranteed_share": 0.7}, "s2": {"guaranteed_share": 0.3}}


def test_only_absent_tenants_ranking_above_every_present_one_are_returning(store: Store, zoo_dir: Path) -> None:
    ctx = mlp_worker_context(store, zoo_dir, Settings().with_overrides(tenants=SHARES))
    assert ctx.fair_share.returning_option("mlp@v1") is None  # nobody absent
    ctx.fair_share.note_absent("mlp@v1", ["s2"])
    assert ctx.fair_share.returning_option("mlp@v1") is None  # s2 ranks below s1, which is present
    ctx.fair_share.note_absent("mlp@v1", ["s1"])
    assert ctx.fair_share.returning_option("mlp@v1") == {"order": ["s1", "s2"], "held": [], "window": 4096,
                                                         "only": True}
    assert ctx.fair_share.returning_option("other@v1") is None  # absent from mlp's queue only
    off = mlp_worker_context(store, zoo_dir, Settings().with_overrides(tenants=SHARES, fair_share={"enabled": False}))
    off.fair_share.note_absent("mlp@v1", ["s1"])
    assert off.fair_share.returning_option("mlp@v1") is None


def test_a_returning_tenants_request_is_leased_before_the_chunks_in_front_of_it(store: Store, zoo_dir: Path,
                                                                               tmp_path: Path) -> None:
    ctx = mlp_worker_context(store, zoo_dir, Settings().with_overrides(tenants=SHARES))
    np.save(tmp_path / "in.npy", np.zeros((64 * 50, 64), np.float32))
    spec = jobs.JobSpec(job_id=jobs.new_job_id(), model_name="mlp", model_version="v1",
                        input_batch=str(tmp_path / "in.npy"), input_format="npy", input_checksum="sha256:0",
                        output_dir=str(tmp_path / "out"), output_names=["logits"], rows_total=64 * 50,
                        chunk_size=64, batch_size=8, owner="k2", tenant="s2")
    job_fills.create_job(store, spec, now=time.time())
    full = Admission("mlp@v1", 64, 0)
    taken, _ = _lease_admitted(ctx, [full], "", notes=leases.LeaseNotes(),
                               waiting_requests=ctx.queue_watcher.snapshot().waiting_requests)
    assert taken and {item.payload["kind"] for item in taken} == {"chunk"}  # (a run unit of chunks, or one)
    # s1 has no work: its full scan took it for absent
    assert ctx.fair_share.returning_option("mlp@v1") is not None

    request = RequestSpec(request_id="back", model_name="mlp", model_version="v1",
                          inputs={"features": np.zeros((1, 64), np.float32)}, rows=1, tokens=None,
                          bucket="features:64", factors={"level": 0, "enqueued_at": time.time()}, owner="k1",
                          tenant="s1")
    requests.submit_request(store, request, score=1e9, now=time.time(), max_age_seconds=60)  # behind every chunk
    snapshot = ctx.queue_watcher.snapshot()
    leased, admission = _lease_admitted(ctx, [full], "", notes=leases.LeaseNotes(),
                                        waiting_requests=snapshot.waiting_requests)
    assert [item.item_id for item in leased] == ["back"] and admission == full

    # without the waiting requests' count (as an older snapshot would say), the lease follows the order
    # that leaves s1 out: the next chunk
    requests.submit_request(store, RequestSpec(**{**request.__dict__, "request_id": "later"}), score=1e9,
                            now=time.time(), max_age_seconds=60)
    others, _ = _lease_admitted(ctx, [full], "", notes=leases.LeaseNotes(), waiting_requests={})
    assert others and {item.payload["kind"] for item in others} == {"chunk"}


def test_a_slot_waiting_for_commit_room_stops_at_an_announced_request(store: Store, zoo_dir: Path) -> None:
    """A slot whose commit thread is full waits for the disk up to 50 ms, but no longer than until an online
    request is announced since the loop's snapshot: that request is the next lease's to serve."""
    ctx = mlp_worker_context(store, zoo_dir, Settings().with_overrides(
        tenants={"s1": {"guaranteed_share": 0.7, "preemption_target": "10ms"}}))
    gate = threading.Event()
    ctx.commits.submit(lambda: gate.wait(10))  # the only commit slot, held
    try:
        assert not ctx.commits.has_room()
        deadline = time.monotonic() + 3
        while ctx.request_bell.mark() is None:  # (subscribed: counts are known)
            assert time.monotonic() < deadline
            time.sleep(0.005)
        mark = ctx.request_bell.count()
        started = time.monotonic()
        _wait_for_room(ctx, mark)
        assert time.monotonic() - started >= COMMIT_WAIT_SECONDS  # nothing announced: the whole wait

        request = RequestSpec(request_id="r1", model_name="mlp", model_version="v1",
                              inputs={"features": np.zeros((1, 64), np.float32)}, rows=1, tokens=None,
                              bucket="features:64", factors={"level": 0, "enqueued_at": time.time()}, owner="k1",
                              tenant="s1")
        requests.submit_request(store, request, score=1.0, now=time.time(), max_age_seconds=60)
        while ctx.request_bell.count() == mark:
            assert time.monotonic() < deadline + 3
            time.sleep(0.001)
        started = time.monotonic()
        _wait_for_room(ctx, mark)
        assert time.monotonic() - started < COMMIT_WAIT_SECONDS / 2  # announced: back at once
    finally:
        gate.set()


def test_a_tenant_without_a_job_of_the_model_stays_out_of_its_scans_until_it_submits_one(
        store: Store, zoo_dir: Path, tmp_path: Path) -> None:
    """A tenant a full scan found nothing of is left out of the model's order for 0.5 s, and for longer while
    the worker's view of the active jobs shows it none of that model (each full scan of a deep queue costs
    milliseconds of Redis time); its job, once submitted, brings it back within a view's refresh."""
    ctx = mlp_worker_context(store, zoo_dir, Settings().with_overrides(tenants=SHARES))
    assert ctx.fair_share.lease_option("mlp@v1")["order"] == ["s1", "s2"]
    ctx.fair_share.note_absent("mlp@v1", ["s1"])
    ends = time.monotonic() + 0.8
    while time.monotonic() < ends:  # (orders asked for all along, as a busy worker's leases do)
        assert ctx.fair_share.lease_option("mlp@v1")["order"] == ["s2"]
        time.sleep(0.02)

    np.save(tmp_path / "s1.npy", np.zeros((64, 64), np.float32))
    job_fills.create_job(store, jobs.JobSpec(
        job_id=jobs.new_job_id(), model_name="mlp", model_version="v1", input_batch=str(tmp_path / "s1.npy"),
        input_format="npy", input_checksum="sha256:0", output_dir=str(tmp_path / "s1"), output_names=["logits"],
        rows_total=64, chunk_size=64, batch_size=8, owner="k1", tenant="s1"), now=time.time())
    assert eventually(lambda: ctx.fair_share.lease_option("mlp@v1")["order"] == ["s1", "s2"],
                      timeout=3, interval=0.02), "the tenant's new job did not bring it back"


def test_the_active_jobs_view_names_each_models_tenants_and_is_not_read_past_its_bound(store: Store,
                                                                                      tmp_path: Path) -> None:
    np.save(tmp_path / "in.npy", np.zeros((64, 64), np.float32))
    job_ids = [jobs.new_job_id() for _ in range(3)]
    for number, (job_id, tenant) in enumerate(zip(job_ids, ("s1", "s2", "s2"), strict=True)):
        job_fills.create_job(store, jobs.JobSpec(
            job_id=job_id, model_name="mlp", model_version="v1", input_batch=str(tmp_path / "in.npy"),
            input_format="npy", input_checksum="sha256:0", output_dir=str(tmp_path / f"out{number}"),
            output_names=["logits"], rows_total=64, chunk_size=64, batch_size=8, owner=f"k{number}", tenant=tenant),
            now=time.time())
    known: dict[str, tuple[str, str]] = {}
    assert jobs.active_job_tenants(store, most=3, known=known) == {"mlp@v1": {"s1", "s2"}}
    assert len(known) == 3  # (cached: the next read reads only their statuses)
    job_stops.stop_job(store, job_ids[0], status="cancelled", error="", now=time.time())
    assert jobs.active_job_tenants(store, most=3, known=known) == {"mlp@v1": {"s2"}}  # (still indexed, ended)
    assert jobs.active_job_tenants(store, most=2, known=known) is None  # (three jobs: past the bound, not read)


def test_an_absent_tenant_behind_a_present_one_comes_back_after_the_moment(store: Store, zoo_dir: Path) -> None:
    """Only absent tenants at the head of the order (whose requests a free slot's lease takes first) stay
    out longer for having no job; one behind a present tenant comes back after `ABSENT_SECONDS`."""
    ctx = mlp_worker_context(store, zoo_dir, Settings().with_overrides(tenants={
        "s1": {"guaranteed_share": 0.5}, "s2": {"guaranteed_share": 0.3}, "s3": {"guaranteed_share": 0.2}}))
    assert ctx.fair_share.lease_option("mlp@v1")["order"] == ["s1", "s2", "s3"]
    ctx.fair_share.note_absent("mlp@v1", ["s2"])
    assert ctx.fair_share.lease_option("mlp@v1")["order"] == ["s1", "s3"]
    assert ctx.fair_share.returning_option("mlp@v1") is None  # (s1 is present ahead of it)
    deadline = time.monotonic() + 3
    while ctx.fair_share.lease_option("mlp@v1")["order"] != ["s1", "s2", "s3"]:  # (orders asked for all along)
        assert time.monotonic() < deadline, "a tenant behind a present one stayed out"
        time.sleep(0.02)
