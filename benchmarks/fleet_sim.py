"""Simulated workers for `benchmarks/fleet.py`: a worker process's Redis traffic without its model runs.

A simulated worker is what a real one is to Redis: a `Store` of its own (one connection per thread), one
drain thread per stream slot, and an upkeep thread (a heartbeat every 2 s, a reaper tick every second,
the pass itself by the worker holding the turn). Each slot calls the broker functions a real slot calls
around a batch (`sits_worker/serving/drain_loop.py`, `execution.py`, `between_minibatches.py`,
`request_runs.py`), in the same order, and sleeps the time its model's profile gives for the batch's rows
(`scoring.estimate_latency_ms`) instead of running ONNX Runtime. A chunk's commit runs on its slot's thread,
not on a commit thread: the same calls, as late as the last chunks' are. What a simulated worker leaves out
is listed in docs/benchmarks.md ("How far one Redis goes").

Each slot counts its calls by broker function and times its leases; only what ends inside the measured
window counts. Every loop ends at the window's `end` (a slot in a chunk at its next mini-batch).
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import redis

from broker.jobs import progress as job_progress
from broker.jobs import records as jobs
from broker.jobs import stops as job_stops
from broker.models.model_record import ModelProfile, ModelRecord, ProfilePoint
from broker.online import requests
from broker.online.requests import QueueAtLimit, RequestResult, RequestSpec
from broker.queueing import leases, policy, queues, reaping, tickets, workers
from broker.queueing.leases import LeasedItem, LeaseOptions
from broker.queueing.scoring import Factors, Weights, estimate_latency_ms, queue_key
from broker.state.keys import Keys
from broker.state.store import Store

T = TypeVar("T")

BUCKET = "x:64"
"""The shape bucket of every simulated request and job mini-batch: one row of 64 floats."""
LEASE_SECONDS = 60.0
"""`scheduler.lease_timeout`'s default."""
LOOK_INTERVAL = 0.05
"""`scheduler.yield_check_interval`'s default: a running chunk's quiet look between mini-batches (the first
boundary this long after its last look: with no announced request, that is every look)."""
STOP_CHECK_SECONDS = 1.0
"""How often a running chunk reads its job's status (`between_minibatches.STOP_CHECK_SECONDS`)."""
DOORBELL_SLICE = 0.25
"""The longest an idle slot blocks on the doorbell before it looks again (`drain_loop`)."""
HEARTBEAT_SECONDS = 2.0
REAP_INTERVAL = 1.0
TENANTS = 8
"""Requests and jobs are spread over this many tenants (their counters are keys of their own)."""


@dataclass(frozen=True)
class SimModel:
    """A model known only by its profile: a run of n rows takes `fixed_ms + n * row_ms` (a GPU's flat
    start and per-row slope), as measured points at powers of two up to 4,096 rows."""

    name: str
    fixed_ms: float
    row_ms: float

    @property
    def ref(self) -> str:
        """Its queue's model ref."""
        return f"{self.name}@v1"

    def record(self) -> ModelRecord:
        """The registry record the scheduler's own estimate reads."""
        points = [ProfilePoint(batch_size=2 ** i, latency_ms=self.fixed_ms + self.row_ms * 2 ** i,
                               rows_per_second=2 ** i / (self.fixed_ms + self.row_ms * 2 ** i) * 1000)
                  for i in range(13)]
        return ModelRecord(name=self.name, version="v1", path="/sim", signature={"inputs": [], "outputs": []},
                           static_profile={}, profile=ModelProfile(source="measured", device="gpu:0", points=points),
                           profile_status="ready")


@dataclass(frozen=True)
class ClientPlan:
    """What one client process simulates: its workers, the tickets of their slots, and its producers."""

    url: str
    prefix: str
    worker_names: tuple[str, ...]
    streams: int
    tickets: tuple[str, ...]
    """One per slot, `streams` per worker in order."""
    models: tuple[SimModel, ...]
    request_rate: float
    """Requests a second this process's producers offer (0: none)."""
    producers: int
    total_slots: int
    """Stream slots of the whole fleet: a submit tops tickets up to it, as the API does."""
    max_batch: int = 32
    merge: bool = True
    """`scheduler.merge_requests_into_jobs`: requests ride in a chunk's mini-batches."""
    look_interval: float = LOOK_INTERVAL
    """`scheduler.yield_check_interval`: how often a running chunk looks at the queues."""


@dataclass(frozen=True)
class Window:
    """Unix times: slots start at `start`, count from `measure_from` to `measure_to`, and stop at `end`."""

    start: float
    measure_from: float
    measure_to: float
    end: float
    spread: float = 0.0
    """Slots start at random points within this many seconds after `start`, so that the fleet's chunks do
    not all end at once (a real fleet's are out of step), and the window's counts do not depend on where
    their common ends fall."""

    def counts(self, at: float) -> bool:
        """Whether something that ended at `at` is in the measured window."""
        return self.measure_from <= at < self.measure_to


@dataclass
class Tally:
    """What one thread counted inside the window; tallies add up (`merge`)."""

    calls: Counter[str] = field(default_factory=Counter)
    """Client calls (round trips) by broker function."""
    events: Counter[str] = field(default_factory=Counter)
    """leases, empty_leases, chunks, finalized, requests, job_rows, request_rows, submitted, rejected ..."""
    lease_ms: list[float] = field(default_factory=list)
    """Client-side time of each lease call that leased something."""
    request_ms: list[float] = field(default_factory=list)
    """Submit to completion of each request completed."""
    errors: Counter[str] = field(default_factory=Counter)

    def merge(self, other: Tally) -> None:
        """Add `other` into this one."""
        self.calls.update(other.calls)
        self.events.update(other.events)
        self.lease_ms += other.lease_ms
        self.request_ms += other.request_ms
        self.errors.update(other.errors)


def open_store(plan: ClientPlan) -> Store:
    """A worker process's store: a pool of its own, each thread holding one connection of it."""
    client = redis.Redis.from_url(plan.url, decode_responses=True, health_check_interval=30)
    return Store(client=client, keys=Keys(prefix=plan.prefix))


class SimWorker:
    """One simulated worker process: its store, queue watcher, slots and upkeep."""

    def __init__(self, plan: ClientPlan, name: str, tickets_of_slots: tuple[str, ...], window: Callable[[], Window],
                 stop: threading.Event) -> None:
        self.plan, self.name = plan, name
        self.store = open_store(plan)
        self.watcher = queues.QueueWatcher(self.store)
        self.records = {model.ref: model.record() for model in plan.models}
        self.window, self.stop = window, stop
        self.slots = [SimSlot(self, ticket) for ticket in tickets_of_slots]
        self.upkeep_tally = Tally()

    def run_seconds(self, model_ref: str, rows: int) -> float:
        """How long a run of `rows` rows of the model takes by its profile."""
        return estimate_latency_ms(self.records[model_ref], rows=max(rows, 1), tokens=None) / 1000

    def upkeep(self) -> None:
        """The heartbeat and reaper threads of a worker, on one thread: bounded by the window's end."""
        beat_at = reap_at = time.time()
        info = {"device": "gpu:0", "streams": self.plan.streams, "pid": 0, "celery_name": self.name}
        while not self.stop.is_set() and time.time() < self.window().end:
            now = time.time()
            try:
                if now >= beat_at:
                    workers.record_heartbeat(self.store, self.name, info, now=now)
                    _count(self.upkeep_tally, self.window(), "heartbeat")
                    beat_at = now + HEARTBEAT_SECONDS
                if now >= reap_at:
                    reap_at = now + REAP_INTERVAL
                    _count(self.upkeep_tally, self.window(), "reaper_turn")
                    if workers.take_reaper_turn(self.store, self.name, hold_seconds=2.5 * REAP_INTERVAL):
                        reaping.reap_expired_leases(self.store, now=now, max_attempts=3)
                        _count(self.upkeep_tally, self.window(), "reap_pass")
            except Exception as err:  # (counted, never fatal: the slots go on)
                self.upkeep_tally.errors[type(err).__name__] += 1
            self.stop.wait(max(0.01, min(beat_at, reap_at) - time.time()))


def _count(tally: Tally, window: Window, call: str) -> None:
    if window.counts(time.time()):
        tally.calls[call] += 1


class SimSlot:
    """One stream slot's drain loop: look, lease, "run" (sleep the profile's time), acknowledge."""

    def __init__(self, worker: SimWorker, ticket: str) -> None:
        self.worker, self.ticket = worker, ticket
        self.store = worker.store
        self.tally = Tally()
        self.last_served: str | None = None
        self.touched_at = time.monotonic()
        self.options = LeaseOptions(max_items=worker.plan.max_batch, max_rows=worker.plan.max_batch,
                                    max_chunks=1, carry_chunk=worker.plan.merge)
        self.requests_only = LeaseOptions(max_items=worker.plan.max_batch, max_rows=worker.plan.max_batch,
                                          max_chunks=1, requests_only=True)

    def call(self, name: str, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Call a broker function, counted by name when it ends inside the window."""
        result = function(*args, **kwargs)
        _count(self.tally, self.worker.window(), name)
        return result

    def over(self) -> bool:
        """Whether the run is over (the window's end, or the fleet was stopped)."""
        return self.worker.stop.is_set() or time.time() >= self.worker.window().end

    def run(self) -> None:
        """The drain loop, from a random point of the window's spread until its end; errors are counted and
        the loop goes on."""
        window = self.worker.window()
        self.worker.stop.wait(max(0.0, window.start + random.uniform(0.0, window.spread) - time.time()))
        while not self.over():
            try:
                self.step()
            except leases.StaleTicket:
                self.tally.errors["stale_ticket"] += 1
                return
            except Exception as err:
                self.tally.errors[type(err).__name__] += 1
                time.sleep(0.01)

    def step(self) -> None:
        """One look at the queues, and the batch it leads to (or a wait on the doorbell)."""
        snapshot = self.call("queue_snapshot", self.worker.watcher.snapshot)
        if not snapshot.heads:
            touch = time.monotonic() - self.touched_at > 7.5  # (ticket_timeout / 4)
            self.touched_at = time.monotonic() if touch else self.touched_at
            self.call("wait_for_doorbell", tickets.wait_for_doorbell, self.store, self.ticket, now=time.time(),
                      timeout=min(DOORBELL_SLICE, max(0.0, self.worker.window().end - time.time())), touch=touch)
            return
        leased: list[LeasedItem] = []
        for model_ref in policy.model_order(snapshot.heads, "graph-aware-backfill", self.last_served):
            leased = self.lease(model_ref, self.options)
            if leased:
                self.last_served = model_ref
                break
        if not leased:
            time.sleep(0.001)  # (another slot took the work: look again, as the drain loop does)
            return
        online = [item for item in leased if item.payload.get("kind") == "request"]
        offline = [item for item in leased if item.payload.get("kind") != "request"]
        if not offline:
            self.run_requests(online)
        elif offline[0].payload.get("kind") == "chunk":
            self.run_chunk(offline[0], carried=online)
        else:
            self.run_finalize(offline[0])

    def lease(self, model_ref: str, options: LeaseOptions) -> list[LeasedItem]:
        """One `lease_batch` call, timed."""
        started = time.perf_counter()
        result = self.call("lease_batch", leases.lease_batch, self.store, model_ref, options, now=time.time(),
                           lease_seconds=LEASE_SECONDS, ticket=self.ticket)
        if self.worker.window().counts(time.time()):
            if result.items:
                self.tally.events["leases"] += 1
                self.tally.lease_ms.append((time.perf_counter() - started) * 1000)
            else:
                self.tally.events["empty_leases"] += 1
        return result.items

    def run_requests(self, items: list[LeasedItem]) -> None:
        """A batch of requests: read their inputs (they came with the lease), run, complete them."""
        inputs = requests.load_inputs(self.store, items)  # (no round trip: the lease brought them)
        rows = sum(len(next(iter(tensors.values()))) for tensors in inputs if tensors)
        run_started = time.time()
        time.sleep(self.worker.run_seconds(items[0].model_ref, rows))
        output = np.zeros((1, 10), np.float32)
        results = [RequestResult(item, outputs={"y": output}) for item in items]
        self.call("complete_requests", requests.complete_requests, self.store, results, now=time.time(),
                  keep_seconds=30, batch_size=len(items), worker=self.worker.name, run_started=run_started,
                  run_rows=rows)
        now = time.time()
        if self.worker.window().counts(now):
            self.tally.events["requests"] += len(items)
            self.tally.events["request_rows"] += rows
            self.tally.events["request_batches"] += 1
            self.tally.request_ms += [(now - float(item.payload["factors"]["enqueued_at"])) * 1000 for item in items]

    def run_chunk(self, item: LeasedItem, carried: list[LeasedItem]) -> None:
        """A job chunk: start it, read its job, run its mini-batches with a look between them as a real
        chunk does (requests that outrank it run in place, same-model requests ride along), commit it."""
        job_id = item.payload["job"]
        if self.call("start_item", job_progress.start_item, self.store, job_id, now=time.time(),
                     chunk=True) != "running":
            self.call("finish_item", leases.finish_item, self.store, item, job_id, now=time.time())
            return
        job = self.call("get_job", jobs.get_job, self.store, job_id, now=time.time())
        rows = int(item.payload["stop"]) - int(item.payload["start"])
        batch_rows = int(job.batch_size)
        looked_at = stop_checked = started = time.monotonic()
        riders, first = carried, 0
        full = self.worker.run_seconds(item.model_ref, batch_rows)
        while first < rows:
            if self.over():
                return  # (left leased: the run is over)
            if time.monotonic() - stop_checked >= STOP_CHECK_SECONDS:
                stop_checked = time.monotonic()
                self.call("stopped_status", job_stops.stopped_status, self.store, job_id)
            if first and time.monotonic() - looked_at >= self.worker.plan.look_interval:
                looked_at = time.monotonic()
                riders = self.look(item)
            # The mini-batches up to the boundary where the next look or status read is due run in one sleep:
            # the same calls at the same boundaries, fewer wake-ups of the client.
            due = min(looked_at + self.worker.plan.look_interval, stop_checked + STOP_CHECK_SECONDS)
            count = 1 if riders else max(1, math.ceil((due - time.monotonic()) / full))
            pieces = [min(batch_rows, rows - start) for start in range(first, min(rows, first + count * batch_rows),
                                                                        batch_rows)]
            rider_rows = sum(int(rider.payload.get("rows") or 1) for rider in riders)
            time.sleep(self.worker.run_seconds(item.model_ref, pieces[0] + rider_rows) + full * (len(pieces) - 1))
            if self.worker.window().counts(time.time()):
                self.tally.events["job_rows_run"] += sum(pieces)
            if riders:
                self.complete_riders(riders, job_rows=pieces[0])
                riders = []
            first += sum(pieces)
        self.call("extend_lease", leases.extend_lease, self.store, item, "", now=time.time(),
                  lease_seconds=LEASE_SECONDS)
        self.call("start_item", job_progress.start_item, self.store, job_id, now=time.time())
        reply = self.call("ack_chunk", job_progress.ack_chunk, self.store, item, now=time.time(),
                          worker=self.worker.name, run_seconds=time.monotonic() - started)
        if self.worker.window().counts(time.time()):
            self.tally.events["chunks"] += 1
            self.tally.events["job_rows"] += rows
            self.tally.events["last_chunks"] += int(reply == 2)

    def look(self, chunk: LeasedItem) -> list[LeasedItem]:
        """A chunk's look between mini-batches (`between_minibatches`): one batch of requests that outrank
        it runs in its place; requests of its own model ride in its next mini-batch."""
        snapshot = self.call("queue_snapshot", self.worker.watcher.snapshot)
        score = float(chunk.payload.get("score") or 0.0)
        served = False
        for model_ref, head in sorted(snapshot.heads.items(), key=lambda pair: pair[1]):
            if head >= score:
                break
            if snapshot.waiting_requests.get(model_ref):
                urgent = self.lease(model_ref, self.requests_only)
                if urgent:
                    self.run_requests(urgent)
                    served = True
                    break
        if not self.worker.plan.merge or not (served or snapshot.waiting_requests.get(chunk.model_ref)):
            return []
        plan = self.worker.plan
        return self.call("lease_riders", leases.lease_riders, self.store, chunk.model_ref, BUCKET, now=time.time(),
                         lease_seconds=LEASE_SECONDS, max_items=plan.max_batch, max_rows=plan.max_batch,
                         window=4 * plan.max_batch, ticket=self.ticket)

    def complete_riders(self, riders: list[LeasedItem], *, job_rows: int) -> None:
        """Answer the requests that rode in a mini-batch."""
        requests.load_inputs(self.store, riders)
        output = np.zeros((1, 10), np.float32)
        self.call("complete_requests", requests.complete_requests, self.store,
                  [RequestResult(rider, outputs={"y": output}) for rider in riders], now=time.time(), keep_seconds=30,
                  batch_size=job_rows + len(riders), worker=self.worker.name, job_rows=job_rows)
        now = time.time()
        if self.worker.window().counts(now):
            self.tally.events["requests"] += len(riders)
            self.tally.events["request_rows"] += len(riders)
            self.tally.events["riders"] += len(riders)
            self.tally.request_ms += [(now - float(rider.payload["factors"]["enqueued_at"])) * 1000
                                      for rider in riders]

    def run_finalize(self, item: LeasedItem) -> None:
        """A job's finalize step: start it, read the job, check it may publish, finish it (no merge is run)."""
        job_id = item.payload["job"]
        if self.call("start_item", job_progress.start_item, self.store, job_id, now=time.time()) == "running":
            self.call("get_job", jobs.get_job, self.store, job_id, now=time.time())
            self.call("start_item", job_progress.start_item, self.store, job_id, now=time.time())
            self.call("finish_item", leases.finish_item, self.store, item, job_id, now=time.time(),
                      job_status="succeeded", job_fields={"manifest": "{}"})
            if self.worker.window().counts(time.time()):
                self.tally.events["finalized"] += 1
        else:
            self.call("finish_item", leases.finish_item, self.store, item, job_id, now=time.time())


class Producer:
    """Online requests offered at a steady rate (open loop), as the API would queue them: one row each,
    scored with the default weights, tenants in turn, under the default queue and tenant caps."""

    def __init__(self, plan: ClientPlan, rate: float, index: int, window: Callable[[], Window],
                 stop: threading.Event) -> None:
        self.plan, self.rate, self.index = plan, rate, index
        self.store = open_store(plan)
        self.window, self.stop = window, stop
        self.tally = Tally()
        self.records = {model.ref: model.record() for model in plan.models}
        self.row = np.zeros((1, 64), np.float32)

    def run(self) -> None:
        """Submit until the window's end; a producer behind its pace by over half a second skips ahead
        (it counts `behind`) instead of sending a burst."""
        if self.rate <= 0:
            return
        models, weights = self.plan.models, Weights()
        gap = 1.0 / self.rate
        due = self.window().start + gap * (self.index + 1) / max(1, self.plan.producers)
        sent = 0
        while not self.stop.is_set() and time.time() < self.window().end:
            wait = due - time.time()
            if wait > 0:
                self.stop.wait(wait)
                continue
            if wait < -0.5:
                due = time.time()
                if self.window().counts(due):
                    self.tally.events["behind"] += 1
            model = models[sent % len(models)]
            self.submit(model, tenant=f"t{(sent + self.index) % TENANTS}", weights=weights)
            sent += 1
            due += gap

    def submit(self, model: SimModel, *, tenant: str, weights: Weights) -> None:
        """Queue one request, as `sits_api/intake/requests.py` does (no waiter: its result stays in its hash)."""
        now = time.time()
        factors = Factors(level=0, est_latency_ms=estimate_latency_ms(self.records[model.ref], rows=1, tokens=None),
                          enqueued_at=now)
        spec = RequestSpec(request_id=requests.new_request_id(), model_name=model.name, model_version="v1",
                           inputs={"x": self.row}, rows=1, tokens=None, bucket=BUCKET, factors=factors.to_dict(),
                           owner=f"{tenant}-key", tenant=tenant)
        try:
            requests.submit_request(self.store, spec, score=queue_key(factors, weights), now=now,
                                    max_age_seconds=3600, ticket_target=self.plan.total_slots, max_waiting=4096,
                                    tenant_max_queued=1024, tenant_max_queued_bytes=256 * 2 ** 20)
            outcome = "submitted"
        except QueueAtLimit:
            outcome = "rejected"
        except Exception as err:
            self.tally.errors[type(err).__name__] += 1
            return
        if self.window().counts(time.time()):
            self.tally.calls["submit_request"] += 1
            self.tally.events[outcome] += 1


class FleetClient:
    """One client process's part of the fleet: its simulated workers and producers, as threads.

    `start` opens every thread (each connects and waits), `go` releases them at a common window,
    `join` waits for them (bounded by the window's end), `result` adds their tallies up."""

    THREAD_STACK = 256 * 1024
    """Bytes of stack per thread: a thousand threads of the default 8 MiB would reserve 8 GiB."""

    def __init__(self, plan: ClientPlan) -> None:
        self.plan = plan
        self.stop = threading.Event()
        self._go = threading.Event()
        self._window: Window | None = None
        self._ready = threading.Semaphore(0)
        per = plan.streams
        self.workers = [SimWorker(plan, name, plan.tickets[per * i:per * (i + 1)], self.window, self.stop)
                        for i, name in enumerate(plan.worker_names)]
        rate = plan.request_rate / max(1, plan.producers)
        self.producers = [Producer(plan, rate, index, self.window, self.stop) for index in range(plan.producers)
                          ] if plan.request_rate > 0 else []
        self.threads: list[threading.Thread] = []
        self.cpu_seconds = 0.0

    def window(self) -> Window:
        """The common window (set by `go`)."""
        assert self._window is not None
        return self._window

    def _thread(self, store: Store, body: Callable[[], None]) -> None:
        try:
            store.client.ping()  # (connects: the fleet's connections open before the window, as a worker's do)
        finally:
            self._ready.release()
        self._go.wait()
        if not self.stop.is_set():
            body()

    def start(self, timeout: float = 60.0) -> None:
        """Start every thread and wait until each has connected (TimeoutError past `timeout`)."""
        old = threading.stack_size(self.THREAD_STACK)
        try:
            for worker in self.workers:
                for slot in worker.slots:
                    self.threads.append(threading.Thread(target=self._thread, args=(worker.store, slot.run),
                                                         daemon=True))
                self.threads.append(threading.Thread(target=self._thread, args=(worker.store, worker.upkeep),
                                                     daemon=True))
            for producer in self.producers:
                self.threads.append(threading.Thread(target=self._thread, args=(producer.store, producer.run),
                                                     daemon=True))
            for thread in self.threads:
                thread.start()
        finally:
            threading.stack_size(old)
        ends = time.monotonic() + timeout
        for _ in self.threads:
            if not self._ready.acquire(timeout=max(0.0, ends - time.monotonic())):
                self.stop.set()
                self._go.set()
                raise TimeoutError(f"the fleet's threads did not connect within {timeout:g} s")

    def go(self, window: Window) -> None:
        """Release the threads; they run from `window.start` (CPU time counts over the measured window)."""
        self._window = window
        self._go.set()

    def measure_cpu(self) -> None:
        """Take this process's CPU seconds over the measured window (called from the process's main thread:
        waits for the window's start, then for its end)."""
        window = self.window()
        time.sleep(max(0.0, window.measure_from - time.time()))
        first = time.process_time()
        time.sleep(max(0.0, window.measure_to - time.time()))
        self.cpu_seconds = time.process_time() - first

    def join(self, grace: float = 5.0) -> int:
        """Wait for every thread to end (the window's end plus `grace`); returns how many did not."""
        ends = time.monotonic() + max(0.0, self.window().end - time.time()) + grace
        for thread in self.threads:
            thread.join(max(0.0, ends - time.monotonic()))
        self.stop.set()
        left = [thread for thread in self.threads if thread.is_alive()]
        for worker in self.workers:
            worker.store.pooled_client.close()
        for producer in self.producers:
            producer.store.pooled_client.close()
        return len(left)

    def result(self) -> dict[str, Any]:
        """The threads' tallies added up, and this process's CPU seconds over the window (picklable)."""
        total = Tally()
        for worker in self.workers:
            total.merge(worker.upkeep_tally)
            for slot in worker.slots:
                total.merge(slot.tally)
        for producer in self.producers:
            total.merge(producer.tally)
        return {"calls": dict(total.calls), "events": dict(total.events), "lease_ms": total.lease_ms,
                "request_ms": total.request_ms, "errors": dict(total.errors), "cpu_seconds": self.cpu_seconds}


def client_process(plan: ClientPlan, ready: Any, go: Any, results: Any) -> None:
    """A client process's main: start its part, say it is ready, run in the window it is given, send the
    result. `ready` and `results` are multiprocessing queues, `go` one that brings the `Window`."""
    client = FleetClient(plan)
    try:
        client.start()
    except TimeoutError as err:
        ready.put(str(err))
        return
    ready.put("ready")
    window = go.get(timeout=120)
    client.go(window)
    client.measure_cpu()
    left = client.join()
    outcome = client.result()
    outcome["threads_left"] = left
    results.put(outcome)


def percentile(values: list[float], q: float) -> float:
    """The `q` quantile of `values` (nearest rank); NaN for none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
