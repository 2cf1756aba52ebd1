"""The request bell: the scripts that make an online request wait announce it, and a running chunk's
looks follow the announcements (real Redis, a real `WorkerContext`, the zoo MLP)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

from broker.config.settings import Settings
from broker.jobs import fills as job_fills
from broker.jobs import records as jobs
from broker.online import requests
from broker.online.requests import RequestSpec
from broker.queueing import leases, queues, tickets
from broker.queueing.scoring import Factors, Weights, queue_key
from broker.state.store import Store
from sits_worker.serving.between_minibatches import BetweenBatches
from sits_worker.serving.context import WorkerContext
from sits_worker.serving.request_bell import RequestBell, unread_bytes
from tests.leasing import lease_items
from tests.waiting import eventually
from tests.worker.worker_helpers import mlp_worker_context


def _submit(store: Store, request_id: str, level: int = 13) -> None:
    factors = Factors(level=level, enqueued_at=time.time())
    spec = RequestSpec(request_id=request_id, model_name="mlp", model_version="v1",
                       inputs={"features": np.zeros((1, 64), np.float32)}, rows=1, tokens=None,
                       bucket="features:64", factors=factors.to_dict(), owner="key")
    requests.submit_request(store, spec, score=queue_key(factors, Weights()), now=time.time(), max_age_seconds=600)


def test_a_submit_and_a_returned_request_are_announced(store: Store) -> None:
    bell = RequestBell(store)
    assert eventually(lambda: bell.mark() is not None)  # (None until Redis confirms the subscription)
    quiet = bell.mark()
    time.sleep(0.05)
    assert bell.mark() == quiet  # nothing announced, nothing counted

    _submit(store, "r1")
    assert eventually(lambda: bell.mark() != quiet)
    submitted = bell.mark()
    [leased] = lease_items(store, "mlp@v1", now=time.time(), lease_seconds=30, max_items=1)
    time.sleep(0.05)
    assert bell.mark() == submitted  # a lease is no announcement
    leases.return_unrun(store, [leased])  # back in the queue: waiting again
    assert eventually(lambda: bell.mark() != submitted)


class CountedLooks:
    """A leased chunk of a 64-row MLP job on `ctx`'s queue, and how many looks (queue snapshots, the real
    ones, counted) the context made since."""

    def __init__(self, ctx: WorkerContext, store: Store, tmp_path: Path) -> None:
        np.save(tmp_path / "in.npy", np.zeros((64, 64), np.float32))
        spec = jobs.JobSpec(job_id=jobs.new_job_id(), model_name="mlp", model_version="v1",
                            input_batch=str(tmp_path / "in.npy"), input_format="npy", input_checksum="sha256:0",
                            output_dir=str(tmp_path / "out"), output_names=["logits"], rows_total=64,
                            chunk_size=64, batch_size=8)
        job_fills.create_job(store, spec, now=time.time())
        self.model_ref = spec.model_ref
        self.bell_before_lease = ctx.request_bell.count()
        [self.chunk] = lease_items(store, spec.model_ref, now=time.time(), lease_seconds=60, max_items=1)
        self.snapshots = 0
        read = ctx.queue_watcher.snapshot

        def counted() -> queues.QueueSnapshot:
            self.snapshots += 1
            return read()

        ctx.queue_watcher.snapshot = counted  # type: ignore[method-assign]


def test_a_running_chunk_skips_looks_until_a_request_is_announced(store: Store, zoo_dir: Path,
                                                                  tmp_path: Path) -> None:
    """A 2 ms preemption target makes a running chunk look every millisecond, a Redis round trip each:
    with nothing announced the looks are skipped down to one a `yield_check_interval` (here 10 s); an
    announced request is served at the next mini-batch boundary."""
    ctx = mlp_worker_context(store, zoo_dir, Settings().with_overrides(
        scheduler={"yield_check_interval": "10s"},
        tenants={"acme": {"guaranteed_share": 0.5, "preemption_target": "2ms"}}))
    looks = CountedLooks(ctx, store, tmp_path)
    between = BetweenBatches(ctx, looks.chunk, ticket="")
    feed = {"features": np.zeros((8, 64), np.float32)}
    assert eventually(lambda: ctx.request_bell.mark() is not None)
    time.sleep(0.002)
    between(feed)  # the first look with the bell listening goes ahead
    assert looks.snapshots == 1
    for _ in range(20):
        time.sleep(0.002)
        assert between(feed) == []
    assert looks.snapshots == 1  # nothing announced: 20 boundaries, no look

    quiet = ctx.request_bell.mark()
    _submit(store, "express")  # an express request outranks the chunk
    assert eventually(lambda: ctx.request_bell.mark() != quiet)
    time.sleep(0.002)
    between(feed)
    assert looks.snapshots == 2
    assert store.client.zscore(store.keys.ready(looks.model_ref), "express") is None  # served in the chunk's place


def test_a_quiet_look_does_not_hold_back_the_next_announced_one(store: Store, zoo_dir: Path,
                                                               tmp_path: Path) -> None:
    """Looks that follow announcements come at most every `yield_check_interval` (here 0.5 s), the chunk's
    lease counting as one; a quiet look (the interval passed without an announcement) does not count, so
    a request announced just after it is looked at at the next boundary. A request the chunk cannot
    serve (it ranks below the chunk and rides in nothing: `merge_requests_into_jobs` is off) then holds
    the next announced look back by the interval."""
    ctx = mlp_worker_context(store, zoo_dir, Settings().with_overrides(
        scheduler={"yield_check_interval": "500ms", "merge_requests_into_jobs": False}))
    assert eventually(lambda: ctx.request_bell.mark() is not None)
    looks = CountedLooks(ctx, store, tmp_path)
    assert looks.bell_before_lease is not None
    between = BetweenBatches(ctx, looks.chunk, ticket="", bell_mark=looks.bell_before_lease)
    feed = {"features": np.zeros((8, 64), np.float32)}

    def announce(request_id: str) -> None:
        quiet = ctx.request_bell.mark()
        _submit(store, request_id, level=0)  # ranks below the chunk: the look finds nothing to serve
        assert eventually(lambda: ctx.request_bell.mark() != quiet)

    between(feed)
    assert looks.snapshots == 0  # nothing announced since the lease, which was a look
    announce("low-1")
    between(feed)
    assert looks.snapshots == 0  # within the interval of the lease
    time.sleep(0.55)
    between(feed)
    assert looks.snapshots == 1  # announced: looked once the interval passed
    time.sleep(0.55)
    between(feed)
    assert looks.snapshots == 2  # a quiet look
    announce("low-2")
    between(feed)
    assert looks.snapshots == 3  # at once: the quiet look held nothing back
    announce("low-3")
    between(feed)
    assert looks.snapshots == 3  # an announced look holds the next one back by the interval
    time.sleep(0.55)
    between(feed)
    assert looks.snapshots == 4
    waiting = store.client.zrange(store.keys.ready(looks.model_ref), 0, -1)
    assert {"low-1", "low-2", "low-3"} <= set(waiting)  # none was served or lost


def test_a_message_waiting_on_the_socket_is_seen_before_it_is_read(store: Store) -> None:
    """`unread_bytes` tells a subscription's socket holding a message from an empty one, and reading
    nothing leaves it there for the bell's thread (a real subscription on real Redis)."""
    pubsub = store.pooled_client.pubsub()
    try:
        pubsub.psubscribe(store.keys.waiting_requests("*"))
        assert pubsub.get_message(timeout=2.0)["type"] == "psubscribe"
        sock = pubsub.connection._sock
        assert not unread_bytes(sock)
        store.client.publish(store.keys.waiting_requests("mlp@v1"), "1")
        assert eventually(lambda: unread_bytes(sock))
        assert unread_bytes(sock)  # (still there: nothing was read)
        assert pubsub.get_message(timeout=1.0)["type"] == "pmessage"
        assert not unread_bytes(sock)
    finally:
        pubsub.close()
    assert not unread_bytes(sock) and not unread_bytes(None)  # a closed socket, none at all


_EARLY_SETTINGS = Settings().with_overrides(scheduler={"yield_check_interval": "10s"},
                                           tenants={"acme": {"guaranteed_share": 0.5, "preemption_target": "1s"}})
"""A look interval of 0.5 s (half the preemption target) for looks after announcements, the lease not counting
as one; quiet looks every 10 s, none within a test."""


def _status(store: Store, request_id: str) -> str:
    return str(requests.get_request(store, request_id).status)


def _inflight(store: Store, model_ref: str, request_id: str) -> bool:
    return store.client.zscore(store.keys.inflight(model_ref), request_id) is not None


def _learn_minibatch(between: BetweenBatches, feed: dict[str, np.ndarray], seconds: float) -> None:
    """A boundary, then a mini-batch of `seconds` (the block held open), so the chunk knows how long its
    mini-batches run."""
    between(feed)
    with between.running():
        time.sleep(seconds)


def test_a_request_announced_while_a_mini_batch_runs_is_leased_then_and_runs_at_its_end(
        store: Store, zoo_dir: Path, tmp_path: Path) -> None:
    """The bell's thread takes the next boundary's look while the mini-batch runs: the express request is
    leased before the mini-batch ends, and runs at the boundary without a look of its own."""
    ctx = mlp_worker_context(store, zoo_dir, _EARLY_SETTINGS)
    assert eventually(lambda: ctx.request_bell.mark() is not None)
    looks = CountedLooks(ctx, store, tmp_path)
    between = BetweenBatches(ctx, looks.chunk, ticket="", bell_mark=looks.bell_before_lease)
    feed = {"features": np.zeros((8, 64), np.float32)}
    _learn_minibatch(between, feed, 0.3)
    before = looks.snapshots

    with between.running():  # a mini-batch of about 0.3 s, within the 0.5 s look interval
        time.sleep(0.05)
        _submit(store, "express")
        assert eventually(lambda: _inflight(store, looks.model_ref, "express"), timeout=0.2)
        assert _status(store, "express") == "queued"  # leased, not run: it runs at the boundary
        assert looks.snapshots == before + 1
    between(feed)
    assert _status(store, "express") == "succeeded"
    assert looks.snapshots == before + 1  # the boundary took the early look's, and looked no more
    assert not _inflight(store, looks.model_ref, "express")


def test_no_early_look_while_an_idle_slot_waits_or_the_mini_batch_outlasts_the_interval(
        store: Store, zoo_dir: Path, tmp_path: Path) -> None:
    """A slot blocked on the doorbell takes the ring of the submit, and so the request: the running chunk
    leaves it for that slot during its mini-batch (here the slot is a bare wait, so the chunk's boundary
    serves it). A mini-batch expected to run past the look interval looks at its boundary only."""
    ctx = mlp_worker_context(store, zoo_dir, _EARLY_SETTINGS)
    assert eventually(lambda: ctx.request_bell.mark() is not None)
    looks = CountedLooks(ctx, store, tmp_path)
    between = BetweenBatches(ctx, looks.chunk, ticket="", bell_mark=looks.bell_before_lease)
    feed = {"features": np.zeros((8, 64), np.float32)}
    _learn_minibatch(between, feed, 0.3)
    store.client.delete(store.keys.doorbell)
    rung: list[bool] = []
    idle_slot = threading.Thread(target=lambda: rung.append(tickets.wait_for_doorbell(
        store, "", now=time.time(), timeout=2.0, touch=False)))
    idle_slot.start()
    assert eventually(lambda: int(store.client.info("clients")["blocked_clients"]) >= 1)
    with between.running():
        _submit(store, "first")
        idle_slot.join(timeout=2.0)
        assert rung == [True]
        time.sleep(0.1)
        assert not _inflight(store, looks.model_ref, "first")  # left to the idle slot
    between(feed)  # the boundary's own look serves it
    assert _status(store, "first") == "succeeded"

    slow = BetweenBatches(ctx, looks.chunk, ticket="", bell_mark=looks.bell_before_lease)
    _learn_minibatch(slow, feed, 1.2)  # longer than the 0.5 s interval
    with slow.running():
        _submit(store, "second")
        time.sleep(0.3)
        assert not _inflight(store, looks.model_ref, "second")
    slow(feed)
    assert _status(store, "second") == "succeeded"


def test_a_request_leased_during_a_mini_batch_no_boundary_follows_runs_right_after_it(
        store: Store, zoo_dir: Path, tmp_path: Path) -> None:
    """No boundary follows a chunk's last mini-batch: `run_early` (called by the chunk after it) runs what
    the early look leased, and so does `finish`, should the chunk end without it; nothing stays leased."""
    ctx = mlp_worker_context(store, zoo_dir, _EARLY_SETTINGS)
    assert eventually(lambda: ctx.request_bell.mark() is not None)
    looks = CountedLooks(ctx, store, tmp_path)
    feed = {"features": np.zeros((8, 64), np.float32)}
    for request_id, settle in (("after-last", "run_early"), ("at-finish", "finish")):
        between = BetweenBatches(ctx, looks.chunk, ticket="", bell_mark=ctx.request_bell.count())
        _learn_minibatch(between, feed, 0.3)
        with between.running():
            _submit(store, request_id)
            assert eventually(lambda rid=request_id: _inflight(store, looks.model_ref, rid), timeout=0.2)
        assert _status(store, request_id) == "queued"
        getattr(between, settle)()
        assert _status(store, request_id) == "succeeded", settle
        assert not _inflight(store, looks.model_ref, request_id)
