"""What deadline admission reads from Redis: every active job (with a deadline or not), its model's
speed, the live workers, and the calibration of past predictions against what really happened.

Read in a fixed number of round trips per submit (`read_figures`); the arithmetic over them is pure
(`broker/jobs/finish_prediction.py`), and `broker/sla/admission.py` turns it into a verdict.

A model's speed is its measured profile's rows per second at the job's batch size
(`chunking.profiled_rows_per_second`) on one stream slot; a CPU worker's streams are slots side by
side (each on cores of its own: `fit_to_cores`), a GPU worker's share one device and count once. A
model without a measured profile is estimated from its static FLOPs (`scoring.estimate_latency_ms`),
which is rough: `estimate` says which was used.

Jobs that end calibrate what the profile misses (`drop_ended`): each model version's factor, how much
longer its chunks really took, and each pair's, how much longer beside one neighbour model on a
worker's other slots (`slot_mix`, from `sits_worker/serving/slot_overlap.py`). The plan scales each
chunk by the pair it starts in (`contention`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Protocol

from broker.jobs import chunking
from broker.jobs.finish_prediction import Fleet, Work, finishes, recalibrated, work_seconds
from broker.jobs.records import ACTIVE_STATUSES
from broker.jobs.views import ActiveJobView, EndedJobView
from broker.models.model_record import ModelRecord
from broker.models.registry import get_model
from broker.queueing import workers
from broker.queueing.scoring import estimate_latency_ms
from broker.queueing.settings import SchedulerSettings
from broker.sla import watch as sla_watch
from broker.sla.settings import SlaSettings
from broker.state.store import Store, translate_redis_errors


class Settings(Protocol):
    """The two sections of the settings admission reads. Any object with them will do; the processes
    pass their one `broker.config.settings.Settings`, which sits above this room and so is not imported."""

    @property
    def sla(self) -> SlaSettings: ...

    @property
    def scheduler(self) -> SchedulerSettings: ...


@dataclass(frozen=True)
class Speed:
    """A model's seconds per row on one worker, and where the figure came from."""

    seconds_per_row: float
    estimate: str
    """'measured' (the model's profile) or 'static' (its FLOPs at an assumed speed)."""


def model_speed(record: ModelRecord, batch_size: int) -> Speed:
    """Seconds per row of the model `record` at `batch_size` on one stream slot (its profile was measured
    on one)."""
    rate = chunking.profiled_rows_per_second(record, batch_size)
    if rate:
        return Speed(1.0 / rate, "measured")
    per_row = estimate_latency_ms(record, rows=batch_size, tokens=None) / 1000 / max(1, batch_size)
    return Speed(per_row, "static")


@dataclass(frozen=True)
class LiveFleet:
    """The live workers as the speed of a model is reckoned on them."""

    workers: int
    streams: int
    device_kind: str

    @property
    def slots_per_worker(self) -> int:
        """Stream slots of one worker that run chunks side by side at a slot's speed: a CPU worker's
        streams each have cores of their own (`fit_to_cores`); a GPU worker's share one device and count
        once."""
        return self.streams if self.device_kind == "cpu" else 1

    @property
    def slots(self) -> int:
        """Stream slots of the fleet (`slots_per_worker` on each live worker)."""
        return self.workers * self.slots_per_worker


def live_fleet(settings: Settings, store: Store, *, now: float) -> LiveFleet:
    """How many workers are alive, with how many streams, on which kind of device."""
    live = [worker for worker in workers.list_workers(store, now=now,
                                                      timeout=settings.scheduler.worker_heartbeat_timeout)
            if worker["alive"]]
    streams = max((int(worker.get("streams", 1)) for worker in live), default=1)
    device_kind = "cpu" if all(str(worker.get("device", "cpu")).startswith("cpu") for worker in live) else "gpu"
    return LiveFleet(len(live), streams, device_kind)


@dataclass(frozen=True)
class Figures:
    """What the store says now: the active jobs' remaining work and the fleet."""

    active: list[Work]
    running: list[Work]
    """The active jobs with a chunk running: chunks of those behind a new job hold slots it needs."""
    fleet: LiveFleet
    calibrations: dict[str, float]
    """By model version (its content hash, whatever name it is registered under), how much longer its
    jobs really ran than their profile says (`calibrations`)."""
    contention: dict[tuple[str, str], float] = field(default_factory=dict)
    """(version, neighbour version) -> how much longer than its calibration says the version's chunks run
    beside that neighbour on the other slots of a worker (`contention`)."""

    def plan_fleet(self, blocking_seconds: float = 0.0, blocked_slots: int = 1,
                   job_latency_seconds: float = 0.0) -> Fleet:
        """The live fleet as the plan places chunks on it: its slots, how they share workers, what each
        pair of models costs beside each other and the models running now (`running_models`)."""
        return Fleet(self.fleet.slots, blocking_seconds, blocked_slots, job_latency_seconds,
                     slots_per_worker=self.fleet.slots_per_worker, contention=self.contention,
                     running_models=running_models(self.running, self.fleet))

    def calibration(self, version: str) -> float:
        """The factor of a version's predicted device time; 1 for one no job has calibrated yet."""
        return self.calibrations.get(version, 1.0)


def read_figures(settings: Settings, store: Store, *, now: float) -> Figures:
    """The active jobs (dropping from the index those that ended, which calibrate their models' speed)
    and the live workers."""
    fleet = live_fleet(settings, store, now=now)
    with translate_redis_errors():
        entries = store.client.zrange(store.keys.jobs_active, 0, -1, withscores=True)
        pipe = store.client.pipeline(transaction=False)
        for job_id, _ in entries:
            pipe.hmget(store.keys.job(job_id), ActiveJobView.names())
        views = [ActiveJobView.of(reply) for reply in (pipe.execute() if entries else [])]
    drop_ended(store, [job_id for (job_id, _), job in zip(entries, views, strict=True)
                       if job.status not in ACTIVE_STATUSES], fleet)
    factors = calibrations(store)
    active: list[Work] = []
    running: list[Work] = []
    records: dict[str, ModelRecord | None] = {}
    for (job_id, score), job in zip(entries, views, strict=True):
        model_ref = job.model_ref or ""
        if job.status not in ACTIVE_STATUSES:
            continue
        if model_ref not in records:
            records[model_ref] = _model_or_none(store, model_ref)
        record = records[model_ref]
        if record is None:
            continue
        speed = model_speed(record, int(job.batch_size or 1))
        remaining_chunks = max(1, int(job.chunks_total or 0) - int(job.chunks_done or 0))
        rows_left = int(job.rows_total or 0) - int(job.rows_done or 0)
        factor = factors.get(_version(model_ref), 1.0)
        seconds = work_seconds(rows_left, seconds_per_row=speed.seconds_per_row, chunks=remaining_chunks) * factor
        chunk_rows = min(int(job.chunk_size or 0), rows_left)
        chunk_seconds = work_seconds(chunk_rows, seconds_per_row=speed.seconds_per_row, chunks=1) * factor
        active.append(Work(job_id, float(score), seconds, float(job.deadline) if job.deadline else None,
                           remaining_chunks, _version(model_ref),
                           chunk_started_at=float(job.chunk_started_at) if job.chunk_started_at else None,
                           chunk_seconds=chunk_seconds if chunk_rows > 0 else None,
                           max_slots=int(job.max_slots) if job.max_slots else None))
        if job.status == "running":
            running.append(active[-1])
    return Figures(active, running, fleet, factors, contention(factors))


def calibrations(store: Store) -> dict[str, float]:
    """Each calibrated model version's factor (`keys.admission_calibration`), and each pair's (version and
    neighbour version, `MIX_SEPARATOR` between)."""
    return _calibration_state(store)[0]


MIX_SEPARATOR = "~"
"""Between a version and its neighbour's in a pair's calibration field: `<version>~<neighbour>`."""


MIX_MIN_SECONDS = 0.2
"""A job's time beside one neighbour that teaches the pair's factor: shorter spells say little."""


def contention(factors: dict[str, float]) -> dict[tuple[str, str], float]:
    """Each calibrated pair's factor over its version's own: how much slower than on average its chunks
    run beside that neighbour (`finish_prediction.Fleet.contention`). The version's factor averages its
    jobs over whatever ran beside them; a pair's, its time beside that one neighbour (`slot_mix`)."""
    out = {}
    for name, factor in factors.items():
        version, separator, neighbour = name.partition(MIX_SEPARATOR)
        if separator and factors.get(version):
            out[(version, neighbour)] = round(factor / factors[version], 4)
    return out


def _calibration_state(store: Store) -> tuple[dict[str, float], dict[str, int]]:
    """The factors by model version, and how many jobs taught each, in one read."""
    with translate_redis_errors():
        raw = store.client.hgetall(store.keys.admission_calibration)
    factors = {field: float(value) for field, value in raw.items() if "|" not in field}
    counts = {field.partition("|")[0]: int(value) for field, value in raw.items() if field.endswith("|jobs")}
    return factors, counts


def _version(model_ref: str) -> str:
    return model_ref.rpartition("@")[2]


def drop_ended(store: Store, job_ids: list[str], fleet: LiveFleet) -> int:
    """Take jobs that ended out of `keys.jobs_active`; each that succeeded in one run calibrates its model:
    the slot time its chunks took (`busy_seconds`, kept by the acks) over what its profile foresaw
    (`finish_prediction.recalibrated`). Slot time, not the time from first lease to finish: a job that
    later jobs passed (earlier deadlines, higher priority) waited, but did not run slower. Only the
    process whose ZREM took a job counts it; two counting
    different jobs at once may each write a model's factor, and the later write wins, which an average
    of many jobs can afford. A job one of whose chunks lost its lease (`slot_time_partial`: a frozen
    worker's run counts its freeze) calibrates nothing. Returns how many were dropped."""
    if not job_ids:
        return 0
    with translate_redis_errors():
        pipe = store.client.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hmget(store.keys.job(job_id), EndedJobView.names())
            pipe.zrem(store.keys.jobs_active, job_id)
        replies = pipe.execute()
        removed_here = [EndedJobView.of(reply) for reply, removed in zip(replies[0::2], replies[1::2], strict=True)
                        if removed]
        dropped = len(removed_here)
        # (a job one of whose chunks lost its lease: its slot time is no measure)
        taken = [job for job in removed_here if not job.slot_time_partial]
        sla_watch.learn_from(store, [
            {"status": job.status or "", "finished_at": job.finished_at or "", "deadline": job.deadline or "",
             "sla_snapshots": job.sla_snapshots or ""} for job in removed_here])
        factors, counts = _calibration_state(store)
        changed: dict[str, float] = {}
        for job in taken:
            started, finished, busy, mix = job.started_at, job.finished_at, job.busy_seconds, job.slot_mix
            rows, chunks, model_ref = job.rows_total, job.chunks_total, job.model_ref or ""
            if job.status != "succeeded" or not (started and finished) or job.resumed_at or fleet.workers < 1:
                continue
            record = _model_or_none(store, model_ref)
            if record is None:
                continue
            speed = model_speed(record, int(job.batch_size or 1))
            alone = Work(job_id="", score=0.0, chunks=max(1, int(chunks or 0)),
                         seconds=work_seconds(int(rows or 0), seconds_per_row=speed.seconds_per_row,
                                              chunks=int(chunks or 0)))
            # its chunks' slot time against the slot time foreseen; without it (a job acked before slot
            # times were kept), its run from first lease to finish against that alone on the slots
            real, foreseen = (float(busy), alone.seconds) if busy else (
                float(finished) - float(started), finishes([alone], Fleet(fleet.slots), now=0.0)[0])
            version = _version(model_ref)
            factor = changed.get(version, factors.get(version, 1.0))
            counts[version] = counts.get(version, 0) + 1
            changed[version] = recalibrated(factor, real=real, predicted=foreseen, samples=counts[version])
            changed[f"{version}|jobs"] = counts[version]
            for neighbour, (seconds, mixed_rows) in (json.loads(mix) if mix and busy else {}).items():
                pair = f"{version}{MIX_SEPARATOR}{neighbour}"
                if seconds < MIX_MIN_SECONDS or mixed_rows <= 0:
                    continue
                counts[pair] = counts.get(pair, 0) + 1
                share = alone.seconds * mixed_rows / max(1, int(rows or 0))
                changed[pair] = recalibrated(changed.get(pair, factors.get(pair, 1.0)), real=seconds,
                                             predicted=share, samples=counts[pair])
                changed[f"{pair}|jobs"] = counts[pair]
        if changed:
            store.client.hset(store.keys.admission_calibration, mapping=changed)
    return dropped


def _model_or_none(store: Store, model_ref: str) -> ModelRecord | None:
    try:
        return get_model(store, model_ref)
    except Exception:  # a version deleted under a running job: its work cannot be estimated
        return None


def running_models(running: list[Work], fleet: LiveFleet) -> list[str]:
    """A guess at the models on the fleet's slots now, slot by slot: each running job's on as many slots as
    its chunks can fill, the latest in queue order first (as `blocking` holds the first slots for work
    behind a new job). Which slot runs which is not read from the workers: the plan needs only the mix."""
    models: list[str] = []
    for work in sorted(running, key=lambda work: (work.score, work.job_id), reverse=True):
        models += [work.model] * min(max(1, work.chunks), fleet.slots - len(models))
    return models
