"""Property: no sequence of enqueue / lease / ack / expire / retry / cancel / resume loses or duplicates an item.

A hypothesis state machine drives the real Lua scripts on the session's
Redis. Simulated workers hold leases (possibly stale ones: reaped, taken back
by a resume, or of a cancelled job) and process them the way
`sits_worker.serving.execution.process_item` and `sits_worker.serving.request_runs` do; the reaper
step mirrors `sits_worker.upkeep.reaper.reap`. Online requests share the queues
with job chunks: leased in merged batches (taking a chunk along), or as
riders of a chunk's mini-batch, some with a timeout (rejected or delayed by the
reaper's pass) or refused by a full queue. After every step each chunk of every
active job must be in exactly one place: waiting, leased, done, or dead; each
request waiting, leased, dead, or finished with exactly one result; what
`max_queue_size` counts is exactly the requests waiting; and each model's tenant indexes hold exactly its
waiting items split by tenant, at their scores (a queue stored before the indexes: none that does not wait,
until a reaper pass has indexed it whole). Jobs and requests belong to a few tenants, and some leases
follow a fair-share order through those indexes.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from broker.errors import Conflict
from broker.failures import retries
from broker.jobs import fills as job_fills
from broker.jobs import lists as job_lists
from broker.jobs import progress as job_progress
from broker.jobs import records as jobs
from broker.jobs import stops as job_stops
from broker.online import requests
from broker.online import timeouts as request_timeouts
from broker.online.requests import RequestResult, RequestSpec
from broker.queueing import leases, policy, queues, reaping, tenant_index
from broker.queueing.leases import LeasedItem
from broker.queueing.scoring import Factors, Weights, queue_key
from broker.state.embedded import EmbeddedRedis
from broker.state.keys import Keys
from broker.state.store import Store
from tests.broker.broker_helpers import NOW, ack, fresh_prefix, job_spec
from tests.leasing import lease_items

MODELS = ("mlp@v1", "cnn@v1")
MAX_ATTEMPTS = 2
MAX_JOBS = 4
MAX_REQUESTS = 8
BUCKETS = ("x:1", "x:2")
TENANTS = ("", "a", "b")
FAIR_ORDERS = (None, {"order": ["a", "b"], "held": [], "window": 2}, {"order": ["b"], "held": ["a"], "window": 3},
               {"order": ["a"], "held": [], "window": 4, "only": True})
"""The fair-share orders a lease may follow (none: the queue's own order)."""


class QueueMachine(RuleBasedStateMachine):
    """Jobs in two model queues, workers that may be slow, crash or retry, a reaper and a user."""

    redis_url = ""
    """Set by the test to its session server's URL (the machine is built once per example)."""

    def __init__(self) -> None:
        super().__init__()
        self.client: Any = redis.Redis.from_url(self.redis_url, decode_responses=True)  # as Store.client
        self.store = Store(client=self.client, keys=Keys(prefix=fresh_prefix()))
        self.now = NOW
        self.job_ids: list[str] = []
        self.held: list[LeasedItem] = []  # leases some worker believes it holds (maybe stale)
        self.request_ids: list[str] = []
        self.rejected: dict[str, int] = {}  # counters field -> requests refused by a full queue
        self.failures: dict[str, int] = {}  # counters field -> failures retried or final
        # mlp@v1 is an older version (a reaper pass prunes its queue whenever it runs dry), cnn@v1 the latest
        self.client.hset(self.store.keys.model_latest, mapping={"mlp": "v2", "cnn": "v1"})

    @initialize(model=st.sampled_from(MODELS), rows_total=st.integers(1, 6), chunk_size=st.integers(1, 3))
    def first_job(self, model: str, rows_total: int, chunk_size: int) -> None:
        self.add_job(model, rows_total, chunk_size, priority=0, tenant="a")

    def teardown(self) -> None:
        for key in self.client.scan_iter(f"{self.store.keys.prefix}:*", count=1000):
            self.client.delete(key)
        self.client.close()

    # --- what the API does ------------------------------------------------------------------

    @precondition(lambda self: len(self.job_ids) < MAX_JOBS)
    @rule(
        model=st.sampled_from(MODELS),
        rows_total=st.integers(1, 6),
        chunk_size=st.integers(1, 3),
        priority=st.sampled_from([0, 7]),
        stored_before_counts=st.booleans(),
        tenant=st.sampled_from(TENANTS),
    )
    def create_job(self, model: str, rows_total: int, chunk_size: int, priority: int,
                   stored_before_counts: bool, tenant: str) -> None:
        """A new job; or, until the old jobs are all counted, one as a version before the per-status job
        counts stored it (not counted)."""
        self.add_job(model, rows_total, chunk_size, priority, tenant=tenant)
        if stored_before_counts and not self.client.exists(self.store.keys.job_counts_built):
            job_id = self.job_ids[-1]
            status = self.client.hget(self.store.keys.job(job_id), "status")
            self.client.hdel(self.store.keys.job(job_id), "counted")
            self.client.hincrby(self.store.keys.job_counts, status, -1)

    @rule(limit=st.integers(1, 3))
    def count_old_jobs(self, limit: int) -> None:
        """A reaper pass counts a page of old jobs (`job_lists.count_old_jobs`)."""
        job_lists.count_old_jobs(self.store, limit=limit)

    def add_job(self, model: str, rows_total: int, chunk_size: int, priority: int, *, tenant: str) -> None:
        name, _, version = model.partition("@")
        spec = dataclasses.replace(job_spec(
            f"j{len(self.job_ids)}",
            model_name=name,
            model_version=version,
            rows_total=rows_total,
            chunk_size=chunk_size,
            priority=priority,
        ), tenant=tenant)
        weights, ordering = policy.get_policy(self.store, default="dynamic")
        job_fills.create_job(self.store, spec, now=self.now, weights=weights, ordering=ordering)
        self.job_ids.append(spec.job_id)

    @precondition(lambda self: len(self.request_ids) < MAX_REQUESTS)
    @rule(model=st.sampled_from(MODELS), bucket=st.sampled_from(BUCKETS), rows=st.integers(1, 2),
          level=st.sampled_from([0, 12]), timeout=st.sampled_from([{}, {"expires_at": 1}, {"delay_at": 1},
                                                                     {"expires_at": 20}, {"delay_at": 20}]),
          limits=st.sampled_from([(0, 0), (3, 0), (0, 1)]), tenant=st.sampled_from(TENANTS))
    def submit_request(self, model: str, bucket: str, rows: int, level: int, timeout: dict[str, int],
                       limits: tuple[int, int], tenant: str) -> None:
        """An online request, scored with the live policy as the API does, maybe with a timeout (rejected
        or delayed past it) and under a queue limit (the model's, or its level's)."""
        name, _, version = model.partition("@")
        factors = Factors(level=level, est_latency_ms=5.0, enqueued_at=self.now)
        weights, ordering = policy.get_policy(self.store, default="dynamic")
        request_id = f"r{len(self.request_ids)}"  # (its own inbox counts its results)
        spec = RequestSpec(request_id=request_id, model_name=name, model_version=version,
                           inputs={"x": np.zeros((rows, 1), np.float32)}, rows=rows, tokens=None, bucket=bucket,
                           factors=factors.to_dict(), reply_to=self.store.keys.inbox(request_id), tenant=tenant,
                           **{action: self.now + after for action, after in timeout.items()})
        waiting = self.store.keys.waiting_requests(model)
        try:
            requests.submit_request(self.store, spec, score=queue_key(factors, weights, ordering), now=self.now,
                                    max_age_seconds=3600, policy_json=self.client.get(self.store.keys.policy) or "",
                                    max_waiting=limits[0], max_waiting_at_level=limits[1])
        except requests.QueueAtLimit as full:
            assert full.waiting == (self.client.zcard(waiting) if full.level is None
                                    else self.client.zcount(waiting, level, level)) >= max(limits)
            assert not self.client.exists(self.store.keys.request(spec.request_id))
            field = f"requests_rejected_{'queue' if full.level is None else 'level'}_full:{model}"
            self.rejected[field] = self.rejected.get(field, 0) + 1
            return
        self.request_ids.append(spec.request_id)

    @precondition(lambda self: self.job_ids)
    @rule(action=st.sampled_from(["cancel", "resume"]), pick=st.integers(0, MAX_JOBS - 1))
    def user(self, action: str, pick: int) -> None:
        """A user cancels a job, or resumes one (a succeeded job must refuse)."""
        job_id = self.job_ids[pick % len(self.job_ids)]
        if action == "cancel":
            job_stops.stop_job(self.store, job_id, status="cancelled", error="cancelled by the user", now=self.now)
            return
        succeeded = self.status(job_id) == "succeeded"
        try:
            weights, ordering = policy.get_policy(self.store, default="dynamic")
            job_fills.resume_job(self.store, job_id, now=self.now, weights=weights, ordering=ordering)
        except Conflict:
            assert succeeded
        else:
            assert not succeeded

    # --- what workers do ----------------------------------------------------------------------

    @rule(model=st.sampled_from(MODELS), max_items=st.integers(1, 3), lease_seconds=st.sampled_from([10, 60]),
          carry_chunk=st.booleans(), requests_only=st.booleans(), fair=st.sampled_from(FAIR_ORDERS))
    def lease(self, model: str, max_items: int, lease_seconds: int, carry_chunk: bool, requests_only: bool,
              fair: dict[str, Any] | None) -> None:
        leased = lease_items(self.store, model, now=self.now, lease_seconds=lease_seconds, max_items=max_items,
                                    max_chunks=1, carry_chunk=carry_chunk, requests_only=requests_only, tenants=fair)
        if fair is not None:  # a held tenant's work is never leased, nor, with `only`, an unranked one's
            allowed = set(fair["order"]) - set(fair["held"]) if fair.get("only") else None
            for item in leased:
                tenant = item.payload.get("tenant") or ""
                assert tenant not in fair["held"] and (allowed is None or tenant in allowed), (tenant, fair)
        kinds = [item.payload["kind"] for item in leased]
        if requests_only or not carry_chunk:
            assert len(set(kinds)) <= 1, kinds
        assert "request" not in kinds[kinds.index("chunk"):] if "request" in kinds and "chunk" in kinds else True
        self.held += leased

    @rule(model=st.sampled_from(MODELS), bucket=st.sampled_from(BUCKETS), max_rows=st.integers(1, 3))
    def lease_riders(self, model: str, bucket: str, max_rows: int) -> None:
        """A running chunk of `model` looks for requests to ride in its next mini-batch."""
        riders = leases.lease_riders(self.store, model, bucket, now=self.now, lease_seconds=60, max_items=3,
                                     max_rows=max_rows)
        assert all(item.payload["kind"] == "request" and item.payload["bucket"] == bucket for item in riders)
        assert sum(item.payload["rows"] for item in riders) <= max_rows
        self.held += riders

    @precondition(lambda self: self.held)
    @rule(pick=st.integers(0, 20), ack_lost=st.booleans())
    def process(self, pick: int, ack_lost: bool) -> None:
        """Run a held item to its end, as `process_item` does; if the ack is lost the worker runs it again later."""
        item = self.held[pick % len(self.held)] if ack_lost else self.held.pop(pick % len(self.held))
        if item.payload["kind"] == "request":
            requests.complete_requests(self.store, [RequestResult(item, outputs={})], now=self.now, keep_seconds=3600,
                                       batch_size=1, worker="w1")
            return
        job_id = item.payload["job"]
        status = job_progress.start_item(self.store, job_id, now=self.now, chunk=item.payload["kind"] == "chunk")
        if status != "running":
            leases.finish_item(self.store, item, job_id, now=self.now)
        elif item.payload["kind"] == "finalize":
            leases.finish_item(self.store, item, job_id, now=self.now, job_status="succeeded")
        else:
            ack(self.store, item, now=self.now)

    @precondition(lambda self: self.held)
    @rule(pick=st.integers(0, 20), retryable=st.booleans())
    def fail(self, pick: int, retryable: bool) -> None:
        """The worker dies holding the item (only its lease deadline remains), or hits a retryable error
        and expires its own lease so the reaper retries the item soon."""
        item = self.held.pop(pick % len(self.held))
        if retryable:
            self.client.zadd(self.store.keys.inflight(item.model_ref), {item.item_id: 0}, xx=True)

    @precondition(lambda self: self.held)
    @rule(pick=st.integers(0, 20), delay=st.sampled_from([0.0, 5.0, 30.0]), retries_left=st.booleans())
    def fail_by_class(self, pick: int, delay: float, retries_left: bool) -> None:
        """A run fails in a class of the retry matrix, as `execution.settle_failure` and
        `request_runs._settle_failed_run` settle it: parked for its backoff, or failed for good."""
        item = self.held.pop(pick % len(self.held))
        outcome = retries.retry_later(self.store, item, failure_class="device_oom", error="oom",
                                      delays=[delay] * 3 if retries_left else [], now=self.now)
        if not outcome.gone:  # (counted for /metrics: retried, or final)
            field = f"failures_{'retried' if outcome.retried else 'final'}_device_oom:{item.model_ref}"
            self.failures[field] = self.failures.get(field, 0) + 1
        if outcome.retried or outcome.gone:
            return
        if item.payload["kind"] == "request":
            requests.complete_requests(self.store, [RequestResult(item, error="oom")], now=self.now,
                                       keep_seconds=3600, batch_size=1, worker="w1")
        else:
            job_stops.stop_job(self.store, item.payload["job"], status="failed", error="oom", now=self.now)

    @rule(model=st.sampled_from(MODELS), carry_chunk=st.booleans(), chunks_only=st.booleans())
    def lease_and_give_back_unrun(self, model: str, carry_chunk: bool, chunks_only: bool) -> None:
        """A worker leases a batch and at once returns what it cannot run now (a job chunk that does not
        fit the device's free memory, `sits_worker.serving.leasing.admitted`); it runs the rest."""
        leased = lease_items(self.store, model, now=self.now, lease_seconds=60, max_items=3, max_chunks=1,
                                    carry_chunk=carry_chunk)
        back = [item for item in leased if item.payload["kind"] == "chunk" or not chunks_only]
        attempts_before = {item.item_id: item.attempts - 1 for item in back}
        leases.return_unrun(self.store, back)
        for item in back:
            assert int(self.client.hget(self.store.keys.attempts, item.item_id) or 0) == attempts_before[item.item_id]
        self.held += [item for item in leased if item not in back]

    @rule(delta=st.sampled_from([0.0, 0.1, 5.0]), alpha=st.sampled_from([0.0, 0.4, 3.0]),
          ordering=st.sampled_from(["fifo", "dynamic"]), count=st.sampled_from([1, 3, 200]))
    def hot_policy_update(self, delta: float, alpha: float, ordering: str, count: int) -> None:
        weights = Weights(alpha=alpha, delta=delta)
        policy.save_policy(self.store, weights, ordering)
        policy.rescore_all(self.store, weights, ordering, count=count, settle_seconds=0)  # no concurrent enqueuers

    @rule(seconds=st.sampled_from([0, 1, 15, 61]), reap=st.booleans())
    def time_passes(self, seconds: int, reap: bool) -> None:
        """Time advances; maybe a reaper pass runs, as `sits_worker.upkeep.reaper.reap` does it."""
        self.now += seconds
        if not reap:
            return
        result = reaping.reap_expired_leases(self.store, now=self.now, max_attempts=MAX_ATTEMPTS)
        for model in MODELS:  # every retry due is back in its queue, and no mark of one is left behind
            assert self.client.zrangebyscore(self.store.keys.retrying(model), "-inf", self.now) == []
        weights, ordering = policy.get_policy(self.store, default="dynamic")
        request_timeouts.expire_all(self.store, now=self.now, weights=weights, ordering=ordering, keep_seconds=3600)
        for model_ref, item_id, payload in result.dead_items:
            if payload.get("kind") == "request":
                item = LeasedItem(item_id, model_ref, payload, MAX_ATTEMPTS)
                requests.complete_requests(self.store, [RequestResult(item, error="died")], now=self.now,
                                           keep_seconds=3600, batch_size=1, worker="reaper")
                leases.finish_item(self.store, item, "", now=self.now)
                continue
            job_id = payload.get("job", "")
            if job_id:
                job_stops.stop_job(self.store, job_id, status="failed", error=f"{item_id} failed", now=self.now)
            item = LeasedItem(item_id, model_ref, payload, MAX_ATTEMPTS)
            leases.finish_item(self.store, item, job_id, now=self.now)

    @rule()
    def prune_old_queues(self) -> None:
        """A reaper pass prunes the older version's queue if it ran dry."""
        queues.prune_old_queues(self.store)

    @rule(model=st.sampled_from(MODELS))
    def stored_before_the_tenant_indexes(self, model: str) -> None:
        """The model's queue as a version before the tenant indexes left it: no index, no mark."""
        ready = self.store.keys.ready(model)
        self.client.delete(*self.client.scan_iter(f"{ready}|*", count=1000),
                           self.store.keys.ready_of_tenant_built(model), self.store.keys.ready_of_tenant_cursor(model))

    @rule(page=st.sampled_from([1, 2, 100]))
    def index_waiting_items(self, page: int) -> None:
        """A reaper pass indexes a page of each queue stored before the tenant indexes."""
        tenant_index.index_waiting_items(self.store, page=page)

    # --- invariants --------------------------------------------------------------------------------

    @invariant()
    def every_queue_with_items_is_in_the_set_drain_loops_read(self) -> None:
        keys = self.store.keys
        for model in MODELS:
            if self.client.zcard(keys.ready(model)) or self.client.zcard(keys.inflight(model)):
                assert self.client.sismember(keys.queues, model), model

    def status(self, job_id: str) -> str:
        return str(self.client.hget(self.store.keys.job(job_id), "status"))

    @invariant()
    def every_chunk_of_an_active_job_is_in_exactly_one_place(self) -> None:
        keys = self.store.keys
        ready = {model: set(self.client.zrange(keys.ready(model), 0, -1)) for model in MODELS}
        inflight = {model: set(self.client.zrange(keys.inflight(model), 0, -1)) for model in MODELS}
        dead = set(self.client.zrange(keys.dead, 0, -1))
        for model in MODELS:
            assert not ready[model] & inflight[model], "an item is both waiting and leased"
        for job_id in self.job_ids:
            job = self.client.hgetall(keys.job(job_id))
            model = job["model_ref"]
            done = {int(index) for index in self.client.smembers(keys.job_done(job_id))}
            chunks_total = int(job["chunks_total"])
            ranges = jobs.chunk_ranges(int(job["rows_total"]), int(job["chunk_size"]))
            assert int(job["chunks_done"]) == len(done), "chunks_done disagrees with the done set"
            assert int(job["rows_done"]) == sum(ranges[i][1] - ranges[i][0] for i in done)
            assert done <= set(range(chunks_total))
            ids = [jobs.chunk_item_id(job_id, i) for i in range(chunks_total)]
            final_id = jobs.finalize_item_id(job_id)
            if job["status"] in jobs.ACTIVE_STATUSES:
                for index, item_id in enumerate(ids):
                    places = [item_id in ready[model], item_id in inflight[model], index in done, item_id in dead]
                    assert sum(places) == 1, f"{item_id} is in {places} (ready, inflight, done, dead)"
                final_places = [final_id in ready[model], final_id in inflight[model], final_id in dead]
                assert sum(final_places) == (1 if len(done) == chunks_total else 0), (final_id, final_places)
            else:
                for item_id in [*ids, final_id]:
                    assert item_id not in ready[model] and item_id not in inflight[model], (
                        f"{item_id} of a {job['status']} job is still queued"
                    )

    @invariant()
    def every_request_is_in_exactly_one_place_and_finishes_once(self) -> None:
        keys = self.store.keys
        dead = set(self.client.zrange(keys.dead, 0, -1))
        for request_id in self.request_ids:
            record = self.client.hgetall(keys.request(request_id))
            model = f"{record['model']}@{record['model_version']}"
            finished = self.client.llen(keys.inbox(request_id))  # (each request's own, as submitted)
            places = [self.client.zscore(keys.ready(model), request_id) is not None,
                      self.client.zscore(keys.inflight(model), request_id) is not None,
                      request_id in dead, finished > 0]
            assert sum(places) == 1, f"{request_id} is in {places} (ready, inflight, dead, finished)"
            assert finished <= 1, f"{request_id} got {finished} results"
            assert (record["status"] in ("succeeded", "failed")) == (finished == 1), record["status"]

    @invariant()
    def job_counts_hold_every_counted_job_once_under_its_status(self) -> None:
        keys = self.store.keys
        counted: dict[str, int] = {}
        for job_id in self.job_ids:
            status, mark = self.client.hmget(keys.job(job_id), ["status", "counted"])
            if mark:
                counted[status] = counted.get(status, 0) + 1
            else:
                assert not self.client.exists(keys.job_counts_built), f"{job_id} is not counted"
        assert job_lists.decode_status_counts(self.client.hgetall(keys.job_counts)) == dict(sorted(counted.items()))

    @invariant()
    def counters_total_what_was_served(self) -> None:
        keys = self.store.keys
        expected: dict[str, int] = {}
        for job_id in self.job_ids:
            model, rows_done = self.client.hmget(keys.job(job_id), ["model_ref", "rows_done"])
            if int(rows_done):
                expected[f"job_rows:{model}"] = expected.get(f"job_rows:{model}", 0) + int(rows_done)
        for request_id in self.request_ids:
            record = self.client.hgetall(keys.request(request_id))
            if record["status"] in ("succeeded", "failed"):
                field = f"requests_{record['status']}:{record['model']}@{record['model_version']}"
                expected[field] = expected.get(field, 0) + 1
        expected |= self.rejected | self.failures
        assert {field: int(total) for field, total in self.client.hgetall(keys.counters).items()} == expected

    @invariant()
    def the_waiting_requests_counted_are_the_requests_in_the_ready_queue(self) -> None:
        """What `max_queue_size` counts, at the level each was submitted at, is what waits: no bookkeeping
        path (lease, riders, return, reap, timeout) loses or keeps one."""
        keys = self.store.keys
        for model in MODELS:
            waiting = dict(self.client.zrange(keys.waiting_requests(model), 0, -1, withscores=True))
            ready = self.client.zrange(keys.ready(model), 0, -1)
            payloads = [json.loads(raw) for raw in self.client.hmget(keys.items, ready)] if ready else []
            expected = {item_id: float(payload["factors"].get("base_level", payload["factors"]["level"]))
                        for item_id, payload in zip(ready, payloads, strict=True) if payload["kind"] == "request"}
            assert waiting == expected, model

    @invariant()
    def tenant_indexes_hold_the_waiting_items_split_by_tenant(self) -> None:
        """Every script that queues, leases, returns, re-scores or takes out an item keeps its tenant's index in
        step: once built, each index is exactly its tenant's waiting items at their scores; before, it holds
        nothing else."""
        keys = self.store.keys
        for model in MODELS:
            ready_key = keys.ready(model)
            ready = dict(self.client.zrange(ready_key, 0, -1, withscores=True))
            payloads = [json.loads(raw) for raw in self.client.hmget(keys.items, list(ready))] if ready else []
            expected: dict[str, dict[str, float]] = {}
            for (item_id, score), payload in zip(ready.items(), payloads, strict=True):
                expected.setdefault(payload.get("tenant") or "", {})[item_id] = score
            indexed = {key[len(ready_key) + 1:]: dict(self.client.zrange(key, 0, -1, withscores=True))
                       for key in self.client.scan_iter(f"{ready_key}|*", count=1000)}
            if self.client.exists(keys.ready_of_tenant_built(model)):
                assert indexed == expected, model
            else:
                for tenant, entries in indexed.items():
                    assert entries.items() <= expected.get(tenant, {}).items(), (model, tenant)

    @invariant()
    def waiting_scores_follow_the_live_policy(self) -> None:
        """What the Lua re-score wrote equals what Python's queue_key computes."""
        weights, ordering = policy.get_policy(self.store, default="dynamic")
        for model in MODELS:
            for item_id, score in self.client.zrange(self.store.keys.ready(model), 0, -1, withscores=True):
                factors = Factors.from_dict(json.loads(self.client.hget(self.store.keys.items, item_id))["factors"])
                assert score == pytest.approx(queue_key(factors, weights, ordering), rel=1e-12, abs=1e-9)

    @invariant()
    def payloads_exist_exactly_for_queued_items(self) -> None:
        keys = self.store.keys
        queued: set[str] = set(self.client.zrange(keys.dead, 0, -1))
        for model in MODELS:
            queued |= set(self.client.zrange(keys.ready(model), 0, -1))
            queued |= set(self.client.zrange(keys.inflight(model), 0, -1))
        assert set(self.client.hkeys(keys.items)) == queued
        assert set(self.client.hkeys(keys.attempts)) <= queued


@pytest.mark.parametrize("examples", [
    25,  # (the default run: about 12 s on the reference machine)
    pytest.param(400, marks=pytest.mark.slow),  # (a deeper search, with -m slow)
])
def test_no_operation_sequence_loses_or_duplicates_an_item(redis_server: EmbeddedRedis, examples: int) -> None:
    class OnSessionRedis(QueueMachine):
        redis_url = redis_server.url

    run_state_machine_as_test(
        OnSessionRedis,
        settings=settings(
            max_examples=examples, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
        ),
    )
