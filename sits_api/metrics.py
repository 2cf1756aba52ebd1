"""`GET /metrics`: the system's figures in the Prometheus exposition format.

A custom `prometheus_client` collector reads them from Redis at each scrape (`broker.monitoring.stats`): the API
runs several gunicorn processes (and maybe several replicas), so any counter kept in a process would
be wrong, and every replica answers the same figures (an API process adds its own HTTP answers to
Redis every second or so, `sits_api/http/request_metrics.py`). Counts only: no job or request ids, owners,
key names or the Redis URL. Labels are model names and versions, worker names and devices, the API's route
templates, and values of small fixed sets (status, phase, reason, priority class, outcome, method, the
histograms' bounds). The per-version histograms and summaries show a name's newest versions alone and sum
the older ones under version "other" (`sits_api/metric_versions.py`): a tenant's versions add few series.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.utils import floatToGoString

from broker.config.settings import Settings
from broker.errors import ModelNotFound
from broker.failures import breaker
from broker.failures.settings import FAILURE_CLASSES
from broker.jobs.records import ACTIVE_STATUSES, FINAL_STATUSES
from broker.models import registry
from broker.monitoring.batch_sizes import ROW_BUCKETS, TOKEN_BUCKETS
from broker.monitoring.sla_metrics import LATENCY_BUCKETS, RISK_JOBS, Histogram
from broker.monitoring.stats import SystemStats, read_stats
from broker.online.batching import configured
from broker.online.settings import ModelBatching
from broker.queueing import re_estimate
from broker.schedules import book as schedule_book
from broker.schedules import runs as schedule_runs
from broker.schedules import stats as schedule_stats
from broker.state.store import Store, translate_redis_errors
from broker.tenants import records as tenants
from broker.tenants.shares import decayed
from broker.tenants.usage import read_usage
from broker.tuning import live
from sits_api.http.request_metrics import HttpCounts
from sits_api.metric_versions import model_labels, shown_versions, summed_by_shown_version

MODEL = ["model", "version"]
WORKER = ["worker", "device"]
REQUEST_STATUSES = ("succeeded", "failed", "expired")

_WORKER_GAUGES = (
    # (metric, help, where in the heartbeat: key, or (key, key) inside its memory ledger stats)
    ("sits_worker_streams", "Stream slots of the worker: how many batches it runs at once (max_concurrent_streams).",
     "streams"),
    ("sits_worker_batches_running", "Batches the worker runs now.", ("memory", "batches_running")),
    ("sits_worker_memory_capacity_bytes", "Device memory the worker reserves batches against.",
     ("memory", "capacity_bytes")),
    ("sits_worker_memory_reserved_bytes",
     "Device memory reserved by the batches running now, in whole gpu/cpu_memory_granularity units.",
     ("memory", "reserved_bytes")),
    ("sits_worker_memory_used_bytes", "Of the reserved memory, what the running batches need by their profiles.",
     ("memory", "used_bytes")),
    ("sits_worker_memory_fragmentation_ratio",
     "Reserved but unused memory / reserved memory, of the batches running now (0 when none runs).",
     ("memory", "fragmentation")),
    ("sits_worker_commits_pending", "Computed job chunks waiting for their part files to be written.",
     "commits_pending"),
    ("sits_gpu_utilization_ratio", "The worker's GPU's utilisation over NVML's last sample period (absent for a "
     "worker without a GPU or NVML).", ("gpu", "utilization")),
    ("sits_gpu_memory_used_bytes", "Memory in use on the worker's GPU, every process's, as NVML reads it (absent "
     "without a GPU).", ("gpu", "memory_used_bytes")),
    ("sits_gpu_memory_total_bytes", "The worker's GPU's memory, as NVML reads it (absent without a GPU).",
     ("gpu", "memory_total_bytes")),
    ("sits_degrade_step", "The worker's degrade step: 0 every class served, 1 P1 served as P2, 2 P2 paused too "
     "(its device memory jitters; degrade in the settings).", ("degrade", "step")),
    ("sits_memory_jitter_ratio", "How far the worker's device-memory readings over degrade.window both rose and "
     "fell, as a share of its capacity (the degrade steps compare it with degrade.jitter_threshold).",
     ("degrade", "jitter")),
)
_WORKER_COUNTERS = (
    ("sits_worker_memory_waits", "Times a free stream slot of the worker, with work waiting, got nothing for "
     "lack of memory (since the worker started).", ("memory", "memory_waits")),
    ("sits_worker_backfills", "Times a stream slot of the worker took batches around a queue head that did not "
     "fit (graph-aware backfill; since the worker started).", ("memory", "backfills")),
    ("sits_degrade_changes", "Times the worker's degrade step changed, down or back (since the worker started).",
     ("degrade", "steps_taken")),
    ("sits_worker_oom_halvings", "Runs that ran out of device memory and were halved and run again (since the "
     "worker started).", ("oom", "halved")),
    ("sits_worker_oom_offloads", "Runs that did not fit the device at one row and ran on a CPU session "
     "(cpu-offload-on-oom; since the worker started).", ("oom", "offloaded")),
)


class SitsCollector:
    """Yields the metric families of one reading of Redis per scrape."""

    def __init__(self, store: Store, settings: Settings, http_counts: HttpCounts | None = None) -> None:
        self._store = store
        self._settings = settings
        self._http_counts = http_counts

    def collect(self) -> Iterator[Metric]:
        """The metric families, read now (`broker.monitoring.stats.read_stats`), after this process's HTTP
        answers not yet added to Redis are (the other processes add theirs every second or so)."""
        if self._http_counts is not None:
            self._http_counts.flush()
        stats = read_stats(self._store, now=time.time(),
                           heartbeat_timeout=self._settings.scheduler.worker_heartbeat_timeout)
        yield from _queue_metrics(stats)
        yield _rescore_metric(stats)
        batching = {ref: _queue_batching(self._store, self._settings, ref) for ref in _newest_queues(stats)}
        yield from _queue_policy_metrics(stats, batching)
        yield from _level_limit_metrics(self._store, batching)
        yield from _worker_metrics(stats)
        shown = shown_versions(self._store, stats)
        yield from _job_and_request_metrics(stats, shown)
        yield from _latency_histograms(stats, shown)
        yield from _batch_size_histograms(stats, shown)
        yield from _http_metrics(stats)
        yield from _deadline_metrics(stats)
        yield from _tenant_metrics(self._store, stats, self._settings, now=time.time())
        yield _breaker_metric(breaker.read_breakers(self._store), stats, now=time.time())
        yield from _schedule_metrics(self._store)
        yield from _batching_control_metrics(self._store, stats, now=time.time())


def _batching_control_metrics(store: Store, stats: SystemStats, *, now: float) -> Iterator[Metric]:
    """The live overrides of models' batching (a tuning sweep's trial, the batching controller's) and the
    controller's changes (`broker/tuning/`)."""
    labels = [*MODEL, "device_kind", "source"]
    ceiling = GaugeMetricFamily("sits_batching_live_max_batch_size", "The batch ceiling a live override sets on "
                                "a kind of device now: the batching controller's, or a tuning sweep's trial.",
                                labels=labels)
    delay = GaugeMetricFamily("sits_batching_live_max_queue_delay_seconds", "The max_queue_delay a live override "
                              "sets on a kind of device now.", labels=labels)
    for model_ref, override in sorted(live.read_all(store).items()):
        for kind, knobs in sorted(override.by_kind.items()):
            if override.knobs_for(kind, now=now) is None:
                continue
            if knobs.max_batch_size is not None:
                ceiling.add_metric([*model_labels(model_ref), kind, override.source], knobs.max_batch_size)
            if knobs.max_queue_delay is not None:
                delay.add_metric([*model_labels(model_ref), kind, override.source], knobs.max_queue_delay)
    changes = CounterMetricFamily("sits_batching_changes", "Moves of a model's batch ceiling or queue delay the "
                                  "batching controller made, by direction: up (more batching) or down.",
                                  labels=[*MODEL, "direction"])
    for key, total in sorted(stats.counters.get("batching_changes", {}).items()):
        model_ref, _, direction = key.rpartition("|")
        changes.add_metric([*model_labels(model_ref), direction], total)
    yield from (ceiling, delay, changes)


def _tenant_metrics(store: Store, stats: SystemStats, settings: Settings, *, now: float) -> Iterator[Metric]:
    """Each tenant's device time and rows billed (`broker/tenants/usage.py`), its guaranteed share and the
    most it may use (share x limit), and its share of the fleet's recent device time (decayed usage
    over every tenant's). The tenants are read at each scrape: two Redis calls, however many tenants."""
    half_life = settings.fair_share.usage_half_life
    seconds = CounterMetricFamily("sits_tenant_device_seconds", "Device-seconds of runs billed to the tenant (a "
                                  "merged run split by rows).", labels=["tenant"])
    for tenant, total in sorted(stats.counters.get("tenant_device_us", {}).items()):
        seconds.add_metric([tenant], total / 1e6)
    yield seconds
    rows = CounterMetricFamily("sits_tenant_rows", "Rows of the tenant's work run.", labels=["tenant"])
    for tenant, total in sorted(stats.counters.get("tenant_rows", {}).items()):
        rows.add_metric([tenant], total)
    yield rows
    guaranteed = GaugeMetricFamily("sits_tenant_guaranteed_share", "The tenant's guaranteed share of the fleet's "
                                   "device time (tenants.<name>.guaranteed_share).", labels=["tenant"])
    ceiling = GaugeMetricFamily("sits_tenant_share_limit", "The most of the fleet the tenant may use when others "
                                "are idle: guaranteed_share x limit.", labels=["tenant"])
    info = GaugeMetricFamily("sits_tenant_info", "1 for each tenant with a record, labelled with its tier "
                             "(tenants.<name>.tier), to join onto the other sits_tenant_* series.",
                             labels=["tenant", "tier"])
    for tenant_name, record in tenants.effective(tenants.load_tenants(store), settings.tenants).items():
        guaranteed.add_metric([tenant_name], record.guaranteed_share)
        ceiling.add_metric([tenant_name], min(1.0, record.guaranteed_share * record.limit))
        info.add_metric([tenant_name, record.tier], 1.0)
    yield guaranteed
    yield ceiling
    yield info
    used = {name: decayed(usage, now=now, half_life=half_life) for name, usage in read_usage(store).items()}
    whole = sum(used.values(), 0.0)
    recent = GaugeMetricFamily("sits_tenant_usage_share", "The tenant's share of the fleet's recent device time "
                               "(decayed by fair_share.usage_half_life), what fair share weighs against its "
                               "guaranteed share.", labels=["tenant"])
    for name, value in sorted(used.items()):
        recent.add_metric([name], value / whole if whole > 0 else 0.0)
    yield recent


def exposition(collector: SitsCollector, accept: str) -> tuple[bytes, str]:
    """(Body, content type) of a scrape, in the format the `Accept` header asks for (text or OpenMetrics)."""
    encode, content_type = choose_encoder(accept)
    return encode(collector), content_type


def _queue_metrics(stats: SystemStats) -> Iterator[Metric]:
    waiting = GaugeMetricFamily("sits_queue_waiting_items", "Items waiting in a model's queue, not yet leased: "
                                "online requests, job chunks and jobs' finalize steps.", labels=MODEL)
    inflight = GaugeMetricFamily("sits_queue_inflight_items", "Items of a model leased by a worker now (until "
                                 "acknowledged, or returned to the queue when the lease expires).", labels=MODEL)
    requests = GaugeMetricFamily("sits_queue_waiting_requests", "Online requests among a model's waiting items: "
                                 "what its max_queue_size counts.", labels=MODEL)
    for model_ref, depth in stats.queues.items():
        name, version = model_labels(model_ref)
        if not (depth["ready"] or depth["inflight"]) and stats.latest_versions.get(name) != version:
            continue  # an older version with nothing left: its series end (a queue is never forgotten)
        waiting.add_metric([name, version], depth["ready"])
        inflight.add_metric([name, version], depth["inflight"])
        requests.add_metric([name, version], depth["requests"])
    yield waiting
    yield inflight
    yield requests
    yield GaugeMetricFamily("sits_dead_items", "Items that used up their attempts (jobs.max_attempts leases) and "
                            "wait for the reaper to fail their job or request.", value=stats.dead_items)
    yield GaugeMetricFamily("sits_batch_tickets", "Batch tickets circulating: the drain tasks that lease batches "
                            "for the live workers' stream slots.", value=stats.tickets)


def _rescore_metric(stats: SystemStats) -> Metric:
    moved = CounterMetricFamily("sits_rescore_moved_items", "Waiting items the beat's re-scoring moved, by why: "
                                "latency (re-estimated after their model's profile changed) or psa (a PSA jump "
                                "made by the beat's pass; the drain loops' own are not counted).",
                                labels=[*MODEL, "reason"])
    for reason in (re_estimate.LATENCY, re_estimate.PSA):
        for model_ref, total in sorted(stats.counters.get(f"rescore_moved_{reason}", {}).items()):
            moved.add_metric([*model_labels(model_ref), reason], total)
    return moved


REJECTION_REASONS = ("queue_full", "level_full", "tenant_full", "tenant_bytes_full")
"""Why a request was refused with a 429 (`submit_request.lua` counts them): its model's queue, or its
priority level's, held `max_queue_size` waiting requests, or its tenant was at `max_queued` requests or
`max_queued_bytes` of inputs not answered yet."""


def _queue_batching(store: Store, settings: Settings, model_ref: str) -> ModelBatching:
    """The batching and queue policy a version's requests are queued under, as intake reads it: the `online`
    settings, with what a Triton repository config set on the version's record (`batching.configured`). Read
    once a scrape for each queue (one record read each), for both families of limits."""
    try:
        return configured(settings.online, registry.get_model(store, model_ref))
    except ModelNotFound:  # (a queue whose version is gone: the settings alone)
        return settings.online.batching_for(model_labels(model_ref)[0])


def _queue_policy_metrics(stats: SystemStats, batching: dict[str, ModelBatching]) -> Iterator[Metric]:
    limit = GaugeMetricFamily("sits_queue_max_requests", "The model's max_queue_size: most online requests "
                              "waiting in a version's queue before a 429 (0: no limit).", labels=MODEL)
    for model_ref, queue in batching.items():
        name, version = model_labels(model_ref)
        limit.add_metric([name, version], queue.max_queue_size)
    yield limit
    rejected = CounterMetricFamily("sits_requests_rejected", "Online requests refused with a 429 because their "
                                   "queue was full (reason queue_full: the model's max_queue_size; level_full: "
                                   "their priority level's; tenant_full: their tenant's max_queued; "
                                   "tenant_bytes_full: their tenant's max_queued_bytes); nothing of "
                                   "them was queued.", labels=[*MODEL, "reason"])
    for reason in REJECTION_REASONS:
        for model_ref, total in sorted(stats.counters.get(f"requests_rejected_{reason}", {}).items()):
            rejected.add_metric([*model_labels(model_ref), reason], total)
    yield rejected


def _level_limit_metrics(store: Store, batching: dict[str, ModelBatching]) -> Iterator[Metric]:
    """Each priority level with a max_queue_size of its own (`priority_levels`): its limit, and the online
    requests waiting at it (one ZCOUNT each, in one round trip)."""
    limited = [(ref, level, entry.max_queue_size) for ref, queue in batching.items()
               for level, entry in sorted(queue.priority_levels.items()) if entry.max_queue_size]
    limit = GaugeMetricFamily("sits_queue_level_max_requests", "A priority level's own max_queue_size: most online "
                              "requests waiting at that level before a 429 (level_full).", labels=[*MODEL, "level"])
    waiting = GaugeMetricFamily("sits_queue_level_waiting_requests", "Online requests waiting at a priority level "
                                "that has a max_queue_size of its own.", labels=[*MODEL, "level"])
    if limited:
        with translate_redis_errors():
            pipe = store.client.pipeline(transaction=False)
            for ref, level, _ in limited:
                pipe.zcount(store.keys.waiting_requests(ref), level, level)
            counts = pipe.execute()
        for (ref, level, most), count in zip(limited, counts, strict=True):
            labels = [*model_labels(ref), str(level)]
            limit.add_metric(labels, most)
            waiting.add_metric(labels, count)
    yield limit
    yield waiting


def _newest_queues(stats: SystemStats) -> list[str]:
    """The model refs with a queue that are their model's newest version."""
    newest = []
    for model_ref in stats.queues:
        name, version = model_labels(model_ref)
        if stats.latest_versions.get(name) == version:
            newest.append(model_ref)
    return newest


def _heartbeat_value(worker: dict[str, Any], where: str | tuple[str, str]) -> float | None:
    value = worker.get(where) if isinstance(where, str) else (worker.get(where[0]) or {}).get(where[1])
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _worker_metrics(stats: SystemStats) -> Iterator[Metric]:
    up = GaugeMetricFamily("sits_worker_up", "1 for a worker whose last heartbeat is within "
                           "scheduler.worker_heartbeat_timeout, 0 for one late (workers silent for ten timeouts, or "
                           "stopped cleanly, are left out).", labels=WORKER)
    age = GaugeMetricFamily("sits_worker_heartbeat_age_seconds", "Seconds since the worker's last heartbeat.",
                            labels=WORKER)
    families: list[tuple[GaugeMetricFamily | CounterMetricFamily, str | tuple[str, str]]] = [
        *((GaugeMetricFamily(name, text, labels=WORKER), where) for name, text, where in _WORKER_GAUGES),
        *((CounterMetricFamily(name, text, labels=WORKER), where) for name, text, where in _WORKER_COUNTERS)]
    for worker in stats.workers:
        labels = [worker["name"], str(worker.get("device", ""))]
        up.add_metric(labels, 1 if worker["alive"] else 0)
        age.add_metric(labels, worker["heartbeat_age_seconds"])
        for family, where in families:
            value = _heartbeat_value(worker, where)
            if value is not None:
                family.add_metric(labels, value)
    yield up
    yield age
    for family, _ in families:
        yield family


def _job_and_request_metrics(stats: SystemStats, shown: Mapping[str, str]) -> Iterator[Metric]:
    jobs = GaugeMetricFamily("sits_jobs", "Jobs in each status (no samples until reaper passes have counted the "
                             "jobs stored before these counts existed).", labels=["status"])
    if stats.job_counts is not None:
        for status in ACTIVE_STATUSES + FINAL_STATUSES:
            jobs.add_metric([status], stats.job_counts.get(status, 0))
    yield jobs
    completed = CounterMetricFamily("sits_requests_completed", "Online requests completed, by model and by how "
                                    "they ended (failed: their error is in the request; expired: the request's "
                                    "record had expired when its result came, so the result was dropped).",
                                    labels=[*MODEL, "status"])
    for status in REQUEST_STATUSES:
        for model_ref, total in sorted(stats.counters.get(f"requests_{status}", {}).items()):
            completed.add_metric([*model_labels(model_ref), status], total)
    yield completed
    rows = CounterMetricFamily("sits_job_rows_done", "Rows of offline jobs computed and checkpointed (a chunk "
                               "run again after a lost acknowledgement counts once; rows run again after a "
                               "resume, where their outputs were deleted, count again).", labels=MODEL)
    for model_ref, total in sorted(stats.counters.get("job_rows", {}).items()):
        rows.add_metric(model_labels(model_ref), total)
    yield rows
    yield _failure_metric(stats)
    yield from _request_time_metrics(stats, shown)


def _failure_metric(stats: SystemStats) -> Metric:
    """`sits_failures`: failed runs of job items and requests, by failure class and whether they were retried."""
    failures = CounterMetricFamily("sits_failures", "Failures of job items and online requests, by model, failure "
                                   "class (docs/failures.md) and outcome: retried after its backoff, or final (its "
                                   "class's attempts used up, or never retried).",
                                   labels=[*MODEL, "class", "outcome"])
    for failure_class in FAILURE_CLASSES:
        for outcome in ("retried", "final"):
            for model_ref, total in sorted(stats.counters.get(f"failures_{outcome}_{failure_class}", {}).items()):
                failures.add_metric([*model_labels(model_ref), failure_class, outcome], total)
    return failures


def _request_time_metrics(stats: SystemStats, shown: Mapping[str, str]) -> Iterator[Metric]:
    """Online request times and runs per model version, from the running totals the v2 statistics keep
    (`broker.monitoring.model_stats`): a summary's count and sum, so that a dashboard divides their rates.
    A name's older versions add up under `metric_versions.OTHER_VERSION`; the summaries have no quantiles to merge."""
    latency = SummaryMetricFamily("sits_request_seconds", "Online requests answered, succeeded or failed, and "
                                  "their time from submit to result.", labels=MODEL)
    phases = SummaryMetricFamily("sits_request_phase_seconds", "The requests that ran, and their time by phase: "
                                 "queue (submit to the start of the run) and compute (the run).",
                                 labels=[*MODEL, "phase"])
    runs = CounterMetricFamily("sits_request_runs", "Runs of online requests (a run may merge several, and "
                               "rows of a job).", labels=MODEL)
    grouped: dict[tuple[str, str], Counter[str]] = {}
    for model_ref, own in stats.model_stats.items():
        grouped.setdefault((model_labels(model_ref)[0], shown[model_ref]), Counter()).update(own)
    for (name, version), totals in sorted(grouped.items()):
        labels = [name, version]
        answered = totals.get("success_count", 0) + totals.get("fail_count", 0)
        latency.add_metric(labels, answered, (totals.get("success_ns", 0) + totals.get("fail_ns", 0)) / 1e9)
        phases.add_metric([*labels, "queue"], totals.get("queue_count", 0), totals.get("queue_ns", 0) / 1e9)
        phases.add_metric([*labels, "compute"], totals.get("infer_count", 0), totals.get("infer_ns", 0) / 1e9)
        runs.add_metric(labels, totals.get("execution_count", 0))
    yield latency
    yield phases
    yield runs


CLASS = [*MODEL, "priority_class"]
_HISTOGRAMS = (
    # (what, metric, help) of each latency histogram; what is as `keys.latency_buckets` names it
    ("request", "sits_request_end_to_end_seconds", "Online requests answered, succeeded or failed, by the "
     "priority class they were submitted at, and their time from submit to result."),
    ("queue", "sits_request_queue_wait_seconds", "Online requests that ran, by the priority class they were "
     "submitted at, and their time from submit to the start of their run."),
    ("run", "sits_request_run_seconds", "Online requests that ran, by the priority class they were submitted "
     "at, and the time of the run they were in (a merged batch, or a job's mini-batch they rode in), from its "
     "start to their results stored."),
    ("chunk", "sits_job_chunk_seconds", "Job chunks computed and acknowledged, by the priority class of their "
     "job, and the time their stream slot spent running them (their mini-batches, the riders' runs among "
     "them; not the writing of their part files)."),
    ("job", "sits_job_end_to_end_seconds", "Offline jobs that succeeded, by the priority class of their "
     "priority, and their time from submit to the publishing of their outputs."),
)
_BOUNDS = [floatToGoString(bound) for bound in LATENCY_BUCKETS] + ["+Inf"]


def _latency_histograms(stats: SystemStats, shown: Mapping[str, str]) -> Iterator[Metric]:
    """The latency histograms (`broker.monitoring.sla_metrics`): cumulative buckets, sum and count, by model version
    (`shown_versions`) and priority class (express, high, normal, low)."""
    families = {what: HistogramMetricFamily(name, text, labels=CLASS) for what, name, text in _HISTOGRAMS}
    for (model, version, what, klass), histogram in summed_by_shown_version(stats.histograms.items(), shown):
        if what in families:
            families[what].add_metric([model, version, klass], _buckets(histogram), sum_value=histogram.total)
    yield from families.values()


def _buckets(histogram: Histogram, bounds: list[str] = _BOUNDS) -> list[tuple[str, float]]:
    return list(zip(bounds, histogram.cumulative, strict=True))


_SIZE_HISTOGRAMS = (
    # (what, metric, help, bounds) of each batch size histogram (`broker.monitoring.batch_sizes`)
    ("rows", "sits_batch_rows", "Model runs of the workers, and their rows: a merged batch of requests, a job's "
     "mini-batch with the requests riding in it, or a piece of a batch split to find its bad rows.", ROW_BUCKETS),
    ("tokens", "sits_batch_tokens", "Runs of token models, and their tokens: rows times the padded sequence "
     "length, what max_batch_tokens bounds.", TOKEN_BUCKETS),
)


def _batch_size_histograms(stats: SystemStats, shown: Mapping[str, str]) -> Iterator[Metric]:
    """The workers' runs by rows and by tokens, by model version (`shown_versions`; no priority class: a run
    merges several)."""
    by_version = summed_by_shown_version(stats.batch_sizes.items(), shown)
    for what, name, text, bounds in _SIZE_HISTOGRAMS:
        family = HistogramMetricFamily(name, text, labels=MODEL)
        edges = [floatToGoString(bound) for bound in bounds] + ["+Inf"]
        for (model, version, kind), histogram in by_version:
            if kind == what:
                family.add_metric([model, version], _buckets(histogram, edges), sum_value=histogram.total)
        yield family


def _http_metrics(stats: SystemStats) -> Iterator[Metric]:
    """The API's answers by route template, method and status, and their time by route and method, from
    every API process (`broker.monitoring.http_stats`)."""
    answers = CounterMetricFamily("sits_http_requests", "HTTP requests the API answered, by route (the URL "
                                  "rule's template; 'unmatched' for a path no rule matches), method ('other' "
                                  "outside the usual ones) and status code.", labels=["route", "method", "status"])
    for labels, total in sorted(stats.http.answers.items()):
        answers.add_metric(list(labels), total)
    yield answers
    seconds = HistogramMetricFamily("sits_http_request_duration_seconds", "HTTP requests the API answered, by "
                                    "route and method, and their time in the API process (from its first "
                                    "request hook to its last; a call that waits for its result includes the "
                                    "wait).", labels=["route", "method"])
    for (route, method), histogram in sorted(stats.http.seconds.items()):
        seconds.add_metric([route, method], _buckets(histogram), sum_value=histogram.total)
    yield seconds


def _from_zero(stats: SystemStats, what: str) -> list[tuple[str, int]]:
    """(Model ref, running total) of a counter in `keys.counters`, with 0 for each newest version that has
    none yet: its first increase is then one an alert sees (`increase` ignores a series' first sample)."""
    totals = stats.counters.get(what, {})
    return sorted({**dict.fromkeys(_newest_queues(stats), 0), **totals}.items())


DEADLINE_OUTCOMES = ("met", "missed")
"""How a job with a deadline ended (`lib.lua` `count_job_end`): met (succeeded by it) or missed (failed, or
succeeded late); a cancelled job counts neither way."""


def _deadline_metrics(stats: SystemStats) -> Iterator[Metric]:
    outcomes = CounterMetricFamily("sits_job_deadlines", "Jobs with a deadline that ended, by whether they met "
                                   "it (succeeded by then) or missed it (failed, or succeeded late).",
                                   labels=[*MODEL, "outcome"])
    for outcome in DEADLINE_OUTCOMES:
        for model_ref, total in _from_zero(stats, f"job_deadline_{outcome}"):
            outcomes.add_metric([*model_labels(model_ref), outcome], total)
    yield outcomes
    requests = CounterMetricFamily("sits_request_deadlines", "Online requests with a deadline (deadline_ms) that "
                                   "ended, by whether they met it (answered by then) or missed it (failed, or "
                                   "answered late).", labels=[*MODEL, "outcome"])
    for outcome in DEADLINE_OUTCOMES:
        for model_ref, total in _from_zero(stats, f"request_deadline_{outcome}"):
            requests.add_metric([*model_labels(model_ref), outcome], total)
    yield requests
    rejected = CounterMetricFamily("sits_jobs_rejected", "Jobs refused at submit by deadline admission (422 "
                                   "deadline_infeasible): their deadline could not be met, or had passed.",
                                   labels=MODEL)
    for model_ref, total in _from_zero(stats, "admission_rejected"):
        rejected.add_metric(model_labels(model_ref), total)
    yield rejected
    due = GaugeMetricFamily("sits_jobs_with_deadline", f"Active jobs with a deadline (of the {RISK_JOBS} with "
                            "the soonest deadlines).", labels=MODEL)
    at_risk = GaugeMetricFamily("sits_jobs_at_risk", "Of the active jobs with a deadline, those predicted to miss "
                                "it: sla_risk at least 0.5, as GET /v1/jobs/<id> reports it.", labels=MODEL)
    highest = GaugeMetricFamily("sits_sla_risk", "The highest sla_risk (0 to 1) of the model's active "
                                "jobs with a deadline.", labels=MODEL)
    for model_ref, risk in sorted(stats.job_risks.items()):
        labels = model_labels(model_ref)
        due.add_metric(labels, risk.jobs)
        at_risk.add_metric(labels, risk.at_risk)
        highest.add_metric(labels, risk.highest)
    yield due
    yield at_risk
    yield highest


def _breaker_metric(breakers: dict[tuple[str, str], breaker.Breaker], stats: SystemStats, *, now: float) -> Metric:
    """`sits_breaker_state`: each known worker's circuit breaker of each model version it ran."""
    family = GaugeMetricFamily("sits_breaker_state", "The circuit breaker of a model version on a worker: 0 closed "
                               "(it takes the model's batches), 1 half-open (one probe batch may run), 2 open (it "
                               "takes none: its runs of the model failed).", labels=[*MODEL, "worker"])
    known = {worker["name"] for worker in stats.workers}
    for (model_ref, worker), record in sorted(breakers.items()):
        if worker in known:
            state = breaker.state_at(record, now=now)
            family.add_metric([*model_labels(model_ref), worker], breaker.STATE_VALUES.get(state, 0))
    return family


SCHEDULE = ["tenant", "schedule"]
SCHEDULE_OUTCOMES = (schedule_stats.RELEASED, schedule_stats.REFUSED, schedule_stats.MISSED)
"""What became of a schedule's slot (docs/schedules.md): a job released, its release refused (admission, caps,
paths: the reason is on the run), or missed (while no beat ran under catch_up: skip, or past its window)."""


def _schedule_metrics(store: Store) -> Iterator[Metric]:
    """Each schedule's releases by outcome (from 0, so that an alert sees its first refusal), refusals by
    reason, late releases, release lateness and runs held by their chain; and whether a beat runs."""
    totals = schedule_stats.read_schedule_stats(store)
    held = schedule_runs.held_runs(store)
    releases = CounterMetricFamily("sits_schedule_releases", "Slots of the schedule decided, by outcome: released "
                                   "(a job made), refused (the release was refused: admission, caps, paths; "
                                   "the reason is on its run) or missed (no beat ran when it was due under "
                                   "catch_up: skip, or its window closed first).", labels=[*SCHEDULE, "outcome"])
    refusals = CounterMetricFamily("sits_schedule_refusals", "Refused releases of the schedule, by the error code "
                                   "of the refusal (deadline_infeasible, queue_full, forbidden, ...).",
                                   labels=[*SCHEDULE, "reason"])
    late = CounterMetricFamily("sits_schedule_late_releases", "Releases of the schedule made more than "
                               "beat.late_after after they were due.", labels=SCHEDULE)
    lateness = SummaryMetricFamily("sits_schedule_release_lateness_seconds", "Releases of the schedule, and their "
                                   "time from when each was due (its slot; for a chain step, when the step "
                                   "before it succeeded) to its job made.", labels=SCHEDULE)
    last = GaugeMetricFamily("sits_schedule_last_release_lateness_seconds", "The lateness of the schedule's "
                             "last release.", labels=SCHEDULE)
    waiting = GaugeMetricFamily("sits_schedule_held_runs", "Runs of the schedule held now by the steps they come "
                                "after (waiting for them, or held by one that failed).", labels=SCHEDULE)
    for schedule in schedule_book.list_schedules(store, None):
        labels = [schedule.tenant, schedule.name]
        found = totals.get((schedule.tenant, schedule.name), schedule_stats.ScheduleTotals())
        for outcome in SCHEDULE_OUTCOMES:
            releases.add_metric([*labels, outcome], found.get(outcome))
        for reason, count in sorted(found.refusals.items()):
            refusals.add_metric([*labels, reason], count)
        late.add_metric(labels, found.get(schedule_stats.LATE))
        lateness.add_metric(labels, int(found.get(schedule_stats.LATENESS_COUNT)),
                            found.get(schedule_stats.LATENESS_SUM))
        if schedule_stats.LAST_LATENESS in found.totals:
            last.add_metric(labels, found.get(schedule_stats.LAST_LATENESS))
        waiting.add_metric(labels, held.get((schedule.tenant, schedule.name), 0))
    yield releases
    yield refusals
    yield late
    yield lateness
    yield last
    yield waiting
    yield GaugeMetricFamily("sits_beat_up", "1 while a beat holds its turn (it renews it at every pass), 0 when none "
                            "has passed within beat.turn_timeout.",
                            value=1 if schedule_stats.beat_running(store) else 0)
