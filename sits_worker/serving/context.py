"""Per-process worker state: settings, the Redis store, the pinned device, sessions, open inputs.

Created lazily once per process under a lock, because the Celery pool may be
threads (where `worker_process_init` does not fire) or prefork (where it
must not be created in the parent), from the settings `sits_worker/device/worker_settings.py`
reads once from the process's environment.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import random
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from broker.config.settings import Settings
from broker.errors import DeviceOutOfMemory, HostMemoryCapped, InferenceTimeout
from broker.failures import breaker
from broker.failures.retry_policy import classify, describe
from broker.jobs.job_record import JobRecord
from broker.memory import oom_ceiling, reservation
from broker.memory.ledger import MemoryLedger
from broker.models.cache import WORKER_RECORD_TTL_SECONDS, ModelRecordCache
from broker.models.model_record import ModelRecord
from broker.monitoring.batch_sizes import new_tally, observe_run, run_size
from broker.monitoring.histograms import Tally
from broker.online.batching import Batching, configured, resolve
from broker.queueing.queues import QueueWatcher
from broker.state.store import Store
from broker.tuning import live
from broker.tuning.live import LiveReader
from sits_worker.device.memory_watch import MemoryWatch
from sits_worker.device.observed_profiles import ObservedLatencies
from sits_worker.device.pinning import Device, device_memory
from sits_worker.device.run_limits import RunLimits
from sits_worker.device.run_sizes import RunSize, RunSizes
from sits_worker.device.runtime import SessionCache, host_memory_cap, limit_host_memory, run_session
from sits_worker.device.worker_settings import WorkerSettings, worker_settings
from sits_worker.model.inputs import open_input
from sits_worker.model.padding import MaskSpec, mask_spec, token_limits
from sits_worker.model.source import InputSource
from sits_worker.serving import drain_report
from sits_worker.serving.chunk_commits import Commits
from sits_worker.serving.fault_injection import FaultInjector
from sits_worker.serving.lease_keeper import LeaseKeeper
from sits_worker.serving.model_streams import ModelStreams
from sits_worker.serving.request_bell import RequestBell
from sits_worker.serving.slot_overlap import SlotOverlap
from sits_worker.tenancy.fair_share import FairShare
from sits_worker.tenancy.usage_meter import UsageMeter

log = logging.getLogger(__name__)

SIZE_ERRORS = (DeviceOutOfMemory, InferenceTimeout)
"""Failures a run's own size can cause (more tokens than the device holds, a run past the time limit): counted
on the breaker only when the run was no larger than runs that worked (`sits_worker/device/run_sizes.py`), and
a merged batch that fails so is split to find its requests that fail alone (`request_runs`)."""
SIZE_CLASSES = frozenset(kind.failure_class for kind in SIZE_ERRORS)

_OPEN_INPUTS_KEPT = 8


def memory_ledger(settings: Settings, device: Device) -> MemoryLedger:
    """The reservations ledger of a worker on `device`: its capacity (NVML for a GPU, else the
    configured size) capped by `device_memory_limit`, in the unit for its kind of device."""
    resources = settings.resources
    capacity = device_memory(device, resources.device_memory)["total_bytes"]
    if resources.device_memory_limit:
        capacity = min(capacity, resources.device_memory_limit)
    unit = resources.gpu_memory_granularity if device.kind == "gpu" else resources.cpu_memory_granularity
    return MemoryLedger(capacity, unit)


@dataclass
class WorkerContext:
    """What every task of this process shares."""

    settings: Settings
    store: Store
    device: Device
    streams: int
    sessions: SessionCache
    name: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    last_served: str | None = None
    """The model whose batch this process leased last (for the round-robin policy)."""
    ledger: MemoryLedger = field(default_factory=lambda: MemoryLedger(16 * 2**30, 128 * 2**20))
    """Memory reservations on this worker's device (one worker process owns one device)."""
    queue_watcher: QueueWatcher = field(init=False)
    """Reads the queue heads, deadlines and policy in one round trip for every drain loop of this process."""
    observed: ObservedLatencies = field(default_factory=ObservedLatencies)
    """Run times of the batches this process ran, for models without a measured profile."""
    commits: Commits = field(init=False)
    """Writes computed chunks' parts and acks them while the stream slots go on (at most `streams` pending)."""
    lease_keeper: LeaseKeeper = field(init=False)
    """Extends the leases of runs longer than a quarter of `scheduler.lease_timeout` while they run."""
    request_bell: RequestBell = field(init=False)
    """Tells a running job chunk whether an online request was queued since it last looked
    (`sits_worker/serving/request_bell.py`)."""
    slot_overlap: SlotOverlap = field(default_factory=SlotOverlap)
    """Which model ran beside each job chunk on the other stream slots, for its ack (`slot_mix`)."""
    batch_sizes: Tally = field(default_factory=new_tally)
    """The rows and tokens of this process's runs, until the heartbeat adds them to Redis
    (`broker/monitoring/batch_sizes.py`)."""
    _inputs: OrderedDict[str, InputSource] = field(default_factory=OrderedDict)
    unseen_jobs: dict[str, float] = field(default_factory=dict)
    """Job id -> until when this worker passes the job's items on uncounted: a file of the job was missing
    on this host (`sits_worker/serving/execution.py`, `check_visible`), and another worker may see it."""
    model_records: ModelRecordCache = field(default_factory=lambda: ModelRecordCache(WORKER_RECORD_TTL_SECONDS))
    """Registry records kept a moment: the hot path reads one on every batch."""
    jitter: random.Random = field(default_factory=random.Random)
    """Draws the jitter of retry backoffs (`broker/failures/retry_policy.py`): unseeded, so workers differ."""
    faults: FaultInjector | None = None
    """The faults this worker injects into its own work (`faults` in the settings); None: none."""
    breakers: breaker.BreakerBoard = field(init=False)
    """This worker's circuit breakers, one per model version it ran (`broker/failures/breaker.py`)."""
    ceilings: oom_ceiling.Ceilings = field(init=False)
    """The batch ceilings device OOMs taught this worker, by model version (`broker/memory/oom_ceiling.py`)."""
    oom_steps: collections.Counter[str] = field(default_factory=collections.Counter)
    """What this worker did after its device OOMs since it started: 'halve', 'offload', 'fail' -> times."""
    run_sizes: RunSizes = field(default_factory=RunSizes)
    """The largest runs of each model that worked here: whether a run that ran out of memory or time was the
    device's fault or its own size's (`sits_worker/device/run_sizes.py`)."""
    usage: UsageMeter = field(init=False)
    """Bills this worker's runs to the tenants in them (`sits_worker/tenancy/usage_meter.py`)."""
    fair_share: FairShare = field(init=False)
    """The tenants' order this worker's leases follow (`sits_worker/tenancy/fair_share.py`)."""
    run_limits: RunLimits = field(init=False)
    """Stops this worker's runs that pass `scheduler.run_time_limit` (`sits_worker/device/run_limits.py`)."""
    memory_watch: MemoryWatch = field(init=False)
    """This worker's device-memory readings and the degrade step its leases follow
    (`sits_worker/device/memory_watch.py`)."""
    stopping: threading.Event = field(default_factory=threading.Event)
    """Set when the worker's warm shutdown begins (SIGTERM): drain loops lease nothing more, finish the
    batch they run and hand their tickets on, so the process exits within a grace period with no lease
    left to expire (`sits_worker/worker_hooks.py`)."""
    model_streams: ModelStreams = field(default_factory=ModelStreams)
    """Batches running per model version, for the models whose batching caps their streams."""
    live_batching: LiveReader = field(init=False)
    """The overrides of models' batching a tuning sweep or the batching controller set (`broker/tuning/live.py`)."""
    _padding: dict[str, tuple[ModelRecord, MaskSpec | None]] = field(default_factory=dict)
    _derived: dict[str, tuple[ModelRecord, Batching, bool]] = field(default_factory=dict)
    """Model ref -> (the record they come from, its batching settings, whether its runs are timed for
    an observed profile)."""
    _applied: dict[str, tuple[Batching, live.LiveBatching, Batching]] = field(default_factory=dict)
    """Model ref -> (its batching, the override read, the batching under it): `batching` on the hot path."""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _oom_lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.queue_watcher = QueueWatcher(self.store)
        self.live_batching = LiveReader(self.store)
        self.commits = Commits(max_pending=self.streams)
        self.lease_keeper = LeaseKeeper(self.store, self.settings.scheduler.lease_timeout)
        self.request_bell = RequestBell(self.store)
        if self.faults is None and self.settings.faults.active:
            self.faults = FaultInjector(self.settings.faults, self.store, worker=lambda: self.name)
        self.breakers = breaker.BreakerBoard(self.store, self.settings.breaker, lambda: self.name)
        self.ceilings = oom_ceiling.Ceilings(self.settings.scheduler.oom_ceiling_decay)
        self.usage = UsageMeter(self.store, device_kind=self.device.kind,
                                half_life=self.settings.fair_share.usage_half_life,
                                flush_every=self.settings.fair_share.usage_refresh)
        self.fair_share = FairShare(self.store, self.settings, self.usage)
        self.run_limits = RunLimits(self.settings.scheduler.run_time_limit)
        self.memory_watch = MemoryWatch(self.settings, self.store, self.memory_reading, self.ledger.capacity_bytes)

    @classmethod
    def create(cls, worker: WorkerSettings) -> WorkerContext:
        """A context over the Redis in the worker's settings, on its device."""
        settings, device, streams = worker.settings, worker.device, worker.streams
        limit_host_memory(host_memory_cap(settings.resources.host_memory_limit))
        store = Store.of(settings.redis)
        return cls(settings=settings, store=store, device=device, streams=streams,
                   sessions=SessionCache(device, worker.intra_op_threads),
                   ledger=memory_ledger(settings, device))

    def model(self, model_ref: str) -> ModelRecord:
        """The registry record of a model version, kept a moment (`model_records`): while a version's
        graph never changes, its measured profile lands after registration (and the estimates, batch
        costs and riders' fill follow it)."""
        return self.model_records.get(self.store, model_ref)

    def remember_model(self, model_ref: str, record: ModelRecord) -> None:
        """Keep `record` as the model version's current one (this process just wrote it: a profile
        it measured applies to its next batch, not when the cached record runs out)."""
        self.model_records.remember(model_ref, record)

    def batching(self, model_ref: str) -> Batching:
        """The batching settings of a model version: the configuration's, with its `auto` values from
        the measured profile (`broker/online/batching.py`), resolved again when the record is re-read, under
        the override a tuning sweep or the batching controller set, if any (`broker/tuning/live.py`)."""
        batching = self._derive(model_ref)[1]
        override = self.live_batching.get(model_ref)
        if override is None or time.time() >= override.until:
            return batching
        applied = self._applied.get(model_ref)  # (the hot path asks on every look: applied once per read)
        if applied is None or applied[0] is not batching or applied[1] is not override:
            applied = (batching, override, live.apply(batching, override, self.device.kind, now=time.time()))
            self._applied[model_ref] = applied
        return applied[2]

    def _derive(self, model_ref: str) -> tuple[ModelRecord, Batching, bool]:
        """What the hot path derives from a model version's record, again only when it is re-read."""
        record = self.model(model_ref)
        cached = self._derived.get(model_ref)
        if cached is None or cached[0] is not record:
            config = configured(self.settings.online, record)  # (a repository config's keys on top)
            # Observed profiles are for models without a measured one, and not for token models
            # (their run time depends on the sequence length: sits_worker/device/observed_profiles.py).
            learns = not record.token_model and not (record.profile_points and not record.observed_profile)
            cached = (record, resolve(config, record, self.device.kind), learns)
            self._derived[model_ref] = cached
        return cached

    def padding(self, model_ref: str) -> MaskSpec | None:
        """How to pad a model version's token requests (None: no declared attention mask); derived
        again only when the record is re-read (`model`), since the batch path asks on every merged
        batch, and a version registered again may come back with another probe result."""
        record = self.model(model_ref)
        cached = self._padding.get(model_ref)
        if cached is None or cached[0] is not record:
            cached = self._padding[model_ref] = (record, mask_spec(record.static_profile))
        return cached[1]

    def session(self, model_ref: str, device: Device | None = None) -> Any:
        """The ONNX Runtime session of a model version on this worker's device (or `device`)."""
        return self.sessions.get(model_ref, Path(self.model(model_ref).path), device=device)

    def run(self, model_ref: str, feed: dict[str, np.ndarray], output_names: list[str],
            session: Any = None) -> list[np.ndarray]:
        """Run one batch of `model_ref` (on `session` when given, looked up once per chunk); on device
        OOM, halved down to one row, then on the CPU when the fallback strategy says so (`_run_fitting`).
        The run's outcome counts on this worker's breaker of the model (`broker/failures/breaker.py`): a failure
        of the device's class against it, a success for it; a bad input neither (it is the client's).
        Its time is billed to the tenants of the thread's `usage.billing` scope."""
        record = self.model(model_ref)  # (a Redis error reading the record is not the device's: read it first)
        rows, tokens = run_size({name: array.shape for name, array in feed.items()},
                                record.static_profile.get("sequence_axis"))
        observe_run(self.batch_sizes, model_ref, rows, tokens)
        drain_report.note_run(model_ref, rows)
        size = RunSize.of(rows, tokens)
        started = time.perf_counter()
        try:
            outputs = self._run_fitting(model_ref, feed, output_names, session, size.tokens_per_row)
        except Exception as err:
            self.usage.add_run(time.perf_counter() - started)  # (a failed run used the device too)
            failure_class = classify(err)
            if failure_class in SIZE_CLASSES and not self.run_sizes.blames_device(model_ref, size):
                log.info("a run of %s larger than any that worked here (%s) failed (%s): its size's, not the "
                         "device's; its breaker does not count it", model_ref, size, failure_class)
            elif isinstance(err, HostMemoryCapped) and self.run_sizes.has_worked(model_ref):
                log.info("a run of %s (%s) passed resources.host_memory_limit, where its runs worked before: its "
                         "inputs', not the device's; its breaker does not count it", model_ref, size)
            elif breaker.counts(failure_class):
                self.breakers.note_run(model_ref, failed=True, error=f"{failure_class}: {describe(err)}")
            raise
        self.usage.add_run(time.perf_counter() - started)
        self.run_sizes.worked(model_ref, size)
        self.breakers.note_run(model_ref, failed=False)
        if self.faults is not None:  # (after the breaker's write: a drop fails this thread's next calls)
            self.faults.after_run()
        return outputs

    def _run_fitting(self, model_ref: str, feed: dict[str, np.ndarray], output_names: list[str],
                     session: Any = None, tokens_per_row: int | None = None) -> list[np.ndarray]:
        """The batch in runs of at most the model's OOM ceiling at its width (`tokens_per_row`); a run that runs out
        of device memory is halved, offloaded or failed (`oom_ceiling.after_oom`). An offload takes the rest of the
        batch in one CPU run: it did not fit at one row.

        The ceiling is lowered, and the ledger taught, for the runs that ran out (`_learn_oom`) only once the
        batch has run with no row running out alone: then it was too many rows. A row that runs out alone was
        the cause itself (an allocation its values size, one tenant's request merged with others' rows), or the
        device cannot run even one: either way a ceiling would only cut every tenant's later batches."""
        rows = next((int(array.shape[0]) for array in feed.values() if array.ndim), 0)
        try:
            session = session or self.session(model_ref)  # a cold load is not a batch's run time
        except DeviceOutOfMemory:
            if self.settings.scheduler.fallback_strategy != "cpu-offload-on-oom":
                raise
            return self._offload(model_ref, feed, output_names, rows)
        if not rows:
            return self._run_on_device(model_ref, feed, output_names, session)
        todo = oom_ceiling.pieces(rows, self.ceilings.rows(model_ref, now=time.time(), tokens_per_row=tokens_per_row))
        done: list[list[np.ndarray]] = []
        ran_out: list[int] = []  # the rows of each run that ran out of memory, in order
        while todo:
            start, stop = todo.pop(0)
            piece = feed if (start, stop) == (0, rows) else {name: array[start:stop] for name, array in feed.items()}
            try:
                done.append(self._run_on_device(model_ref, piece, output_names, session))
                continue
            except DeviceOutOfMemory:
                ran_out.append(stop - start)
                step = self._count_oom(model_ref, stop - start, tokens_per_row)
                if step == "fail":
                    raise
            if step == "halve":
                todo[:0] = oom_ceiling.halves(start, stop)
                continue
            rest = {name: array[start:] for name, array in feed.items()}
            done.append(self._offload(model_ref, rest, output_names, rows - start))
            break
        if ran_out and min(ran_out) > 1:
            for failed_rows in ran_out:
                self._learn_oom(model_ref, failed_rows, tokens_per_row)
        return done[0] if len(done) == 1 else [np.concatenate(parts) for parts in zip(*done, strict=True)]

    def _count_oom(self, model_ref: str, rows: int, tokens_per_row: int | None) -> oom_ceiling.OomStep:
        """A run of `rows` rows ran out of device memory: count and log it; what next."""
        step = oom_ceiling.after_oom(rows, self.settings.scheduler.fallback_strategy)
        with self._oom_lock:  # (stream slots run in threads)
            self.oom_steps[step] += 1
        log.warning("device out of memory running %d rows of %s on %s (%s tokens a row); %s", rows, model_ref,
                    self.device, tokens_per_row, step)
        return step

    def _learn_oom(self, model_ref: str, rows: int, tokens_per_row: int | None = None) -> None:
        """A run of `rows` rows ran out of device memory where its batch then ran in smaller runs: lower the
        ceiling, teach the ledger.

        Only rows of a size that has run here (`run_sizes`) teach anything: then the rows were too many, or
        the device short. Rows of more tokens than any that worked ran out for their own size; a ceiling
        lowered for them (to one row, for one such request) would cut every tenant's batches of the model
        for `oom_ceiling_decay`. The ceiling is learnt at the batch's padded width (`tokens_per_row`): one long
        row padded beside short ones cuts batches as wide, not narrower ones (`oom_ceiling.rows_at_width`)."""
        now = time.time()
        if not self.run_sizes.blames_device(model_ref, RunSize(1, tokens_per_row)):
            return
        ceiling = self.ceilings.lower(model_ref, rows, now=now, tokens_per_row=tokens_per_row)
        # (the profile's estimate, not one learnt before: a storm of OOMs must not compound it)
        estimate = reservation.BatchCost.of(self.model(model_ref), max_rows=rows, max_tokens=0).need_bytes(rows=rows)
        row_bytes = self.ledger.learn_oom(model_ref, rows, estimate, now=now)
        log.warning("%s ran out of memory at %d rows on %s: ceiling %s rows of %s tokens, %s bytes a row", model_ref,
                    rows, self.device, ceiling, tokens_per_row, row_bytes)

    def _offload(self, model_ref: str, feed: dict[str, np.ndarray], output_names: list[str],
                 rows: int) -> list[np.ndarray]:
        log.warning("running %d rows of %s on a CPU session (cpu-offload-on-oom)", rows, model_ref)
        session = self.sessions.offload(model_ref, Path(self.model(model_ref).path))
        return run_session(session, feed, output_names, limits=self.run_limits)

    def _run_on_device(self, model_ref: str, feed: dict[str, np.ndarray], output_names: list[str],
                       session: Any) -> list[np.ndarray]:
        """One run on the device's session, where faults are injected (never into an offload)."""
        learn = bool(feed) and self._derive(model_ref)[2]
        if self.faults is not None:
            self.faults.before_run(model_ref, feed)
        started = time.perf_counter()
        outputs = run_session(session, feed, output_names, limits=self.run_limits)
        if learn:
            self.observed.record(model_ref, len(next(iter(feed.values()))), time.perf_counter() - started)
        return outputs

    def oom_info(self) -> dict[str, Any]:
        """What device OOMs did on this worker, for the heartbeat: runs halved, offloaded to the CPU and
        failed since it started, and the batch ceilings in force."""
        return {"halved": self.oom_steps["halve"], "offloaded": self.oom_steps["offload"],
                "failed": self.oom_steps["fail"], "ceilings": self.ceilings.in_force(now=time.time())}

    def learnt_cost(self, model_ref: str, cost: reservation.BatchCost) -> reservation.BatchCost:
        """`cost` with the bytes a row needs raised to what a recent device OOM taught (`MemoryLedger.learn_oom`)."""
        row_bytes = self.ledger.row_bytes(model_ref, cost.bytes_per_row, now=time.time(),
                                          keep_seconds=self.settings.scheduler.oom_ceiling_decay)
        if row_bytes <= cost.bytes_per_row:
            return cost
        per_token = -(-cost.bytes_per_token * row_bytes // cost.bytes_per_row) if cost.bytes_per_row else 0
        return dataclasses.replace(cost, bytes_per_row=row_bytes, bytes_per_token=per_token)

    def memory_reading(self) -> int:
        """Bytes in use on this worker's device: NVML's used memory on a GPU, this process's resident
        memory on a CPU; as the injected faults change it (`faults.memory_reading`, `faults.memory_jitter`)."""
        if self.faults is not None:
            return self.faults.memory_reading(self._real_memory_reading)
        return self._real_memory_reading()

    def _real_memory_reading(self) -> int:
        if self.device.kind == "gpu":
            reading = device_memory(self.device, self.settings.resources.device_memory)
            return int(reading["total_bytes"]) - int(reading["free_bytes"])
        return resident_bytes()

    def note_unseen(self, job_id: str, seconds: float) -> None:
        """A file of job `job_id` is missing on this host: pass its items on for `seconds` (`unseen`)."""
        with self._lock:
            self.unseen_jobs[job_id] = time.monotonic() + seconds

    def unseen(self, job_id: str) -> bool:
        """Whether this worker passes job `job_id`'s items on now, uncounted (`note_unseen`)."""
        now = time.monotonic()
        with self._lock:
            until = self.unseen_jobs.get(job_id)
            if until is not None and until <= now:
                del self.unseen_jobs[job_id]
        return until is not None and until > now

    def job_input(self, job: JobRecord) -> InputSource:
        """The opened input file of a job, kept open for the job's next chunks; it is the file the job
        was submitted with (`job.input_stat`), opened without following a symbolic link (`open_input`)."""
        key = f"{job.id}:{job.input_checksum}"
        with self._lock:
            source = self._inputs.get(key)
            if source is not None:
                self._inputs.move_to_end(key)
                return source
        options = job.input_options or {}
        record = self.model(job.model_ref)
        source = open_input(Path(job.input_batch), record.signature, shape=options.get("shape"),
                            dtype=options.get("dtype"), mask=self.padding(job.model_ref),
                            limits=token_limits(record.static_profile), identity=job.input_stat,
                            input_format=options.get("format"), columns=options.get("columns"),
                            id_column=options.get("id_column"))
        with self._lock:
            self._inputs[key] = source
            while len(self._inputs) > _OPEN_INPUTS_KEPT:
                _, oldest = self._inputs.popitem(last=False)
                oldest.close()
        return source


def resident_bytes() -> int:
    """This process's resident memory (Linux `/proc/self/statm`; 0 where it cannot be read)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


_context: WorkerContext | None = None
_context_lock = threading.Lock()


def existing_worker_context() -> WorkerContext | None:
    """This process's context if it was created (shutdown hooks must not create one)."""
    return _context


def worker_context() -> WorkerContext:
    """This process's context, created on first use from its environment (`worker_settings`)."""
    global _context
    if _context is None:
        with _context_lock:
            if _context is None:
                _context = WorkerContext.create(worker_settings())
    return _context
