"""The system's figures for monitoring (`GET /metrics`), read from Redis in a fixed number of round trips.

Every API process answers a scrape from Redis, so the figures are the same whichever process (or
replica) a scrape reaches; counters kept per process would not be. No read here grows with the jobs
or requests kept: queue sizes are one ZCARD per model queue, jobs by status come from the counts the
status changes keep (`keys.job_counts`), running totals from one hash (`keys.counters`) that the
ack scripts bump, worker figures from their heartbeats, histograms from one hash each
(`broker.monitoring.histograms`). The one read per job is of the active jobs with
a deadline, at most `sla_metrics.RISK_JOBS` of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from broker.jobs.lists import decode_status_counts
from broker.monitoring import sla_metrics
from broker.monitoring.batch_sizes import decode_batch_sizes
from broker.monitoring.http_stats import HttpStats, decode_http
from broker.monitoring.model_stats import decode_model_stats
from broker.monitoring.sla_metrics import Histogram, ModelRisk
from broker.queueing import queues
from broker.queueing.workers import decode_workers
from broker.state.store import Store, translate_redis_errors


@dataclass(frozen=True)
class SystemStats:
    """One reading of everything `/metrics` exposes."""

    queues: dict[str, dict[str, int]]
    """Model ref -> {"ready": items waiting, "inflight": items leased, "requests": online requests waiting},
    for every known queue."""
    dead_items: int
    tickets: int
    workers: list[dict[str, Any]]
    """Heartbeats (device, streams, memory ledger stats, commits pending) with `alive` and age."""
    job_counts: dict[str, int] | None
    """Status -> jobs in it; None until reaper passes have counted the jobs stored before the counts
    existed (`broker.jobs.lists.count_old_jobs`)."""
    counters: dict[str, dict[str, int]]
    """What ('requests_succeeded', 'requests_failed', 'requests_expired', 'job_rows', 'job_deadline_met', ...:
    `keys.counters`) -> model ref -> running total."""
    latest_versions: dict[str, str]
    """Model name -> its newest registered version."""
    model_stats: dict[str, dict[str, int]]
    """Model ref -> the v2 statistics' running totals of its online requests (`broker.monitoring.model_stats`:
    'success_count', 'success_ns', 'queue_ns', 'infer_ns', 'execution_count', ...)."""
    histograms: dict[tuple[str, str, str], Histogram]
    """(Model ref, what, priority class) -> a latency histogram (`broker.monitoring.sla_metrics`)."""
    job_risks: dict[str, ModelRisk]
    """Model ref -> the risk of its active jobs with a deadline (`sla_metrics.read_job_risks`)."""
    batch_sizes: dict[tuple[str, str], Histogram]
    """(Model ref, 'rows' or 'tokens') -> the sizes of the model's runs (`broker.monitoring.batch_sizes`)."""
    http: HttpStats
    """The API's HTTP answers and their times (`broker.monitoring.http_stats`)."""


def read_stats(store: Store, *, now: float, heartbeat_timeout: float) -> SystemStats:
    """Read `SystemStats`: one pipeline, then the queue sizes (`queues.queue_depths`, two round trips), then
    the risk of the jobs with a deadline (`sla_metrics.read_job_risks`, one or two).
    Read only: workers silent for long are left out, not pruned (`workers.list_workers` prunes)."""
    keys = store.keys
    with translate_redis_errors():
        pipe = store.client.pipeline(transaction=False)
        pipe.zcard(keys.dead)
        pipe.zcard(keys.tickets)
        pipe.hgetall(keys.workers)
        pipe.exists(keys.job_counts_built)
        pipe.hgetall(keys.job_counts)
        pipe.hgetall(keys.counters)
        pipe.hgetall(keys.model_latest)
        pipe.hgetall(keys.model_stats)
        pipe.hgetall(keys.latency_buckets)
        pipe.hgetall(keys.batch_sizes)
        pipe.hgetall(keys.http_requests)
        (dead, tickets, raw_workers, counts_built, raw_counts, raw_counters, latest, raw_model_stats,
         raw_buckets, raw_batch_sizes, raw_http) = pipe.execute()
    depths = queues.queue_depths(store, with_requests=True)
    workers, _ = decode_workers(raw_workers, now=now, timeout=heartbeat_timeout)
    counters: dict[str, dict[str, int]] = {}
    for field, total in raw_counters.items():
        what, _, model_ref = field.partition(":")
        counters.setdefault(what, {})[model_ref] = int(total)
    return SystemStats(queues=depths, dead_items=int(dead), tickets=int(tickets), workers=workers,
                       job_counts=decode_status_counts(raw_counts) if counts_built else None, counters=counters,
                       latest_versions=latest, model_stats=decode_model_stats(raw_model_stats),
                       histograms=sla_metrics.decode_histograms(raw_buckets),
                       job_risks=sla_metrics.read_job_risks(store, now=now),
                       batch_sizes=decode_batch_sizes(raw_batch_sizes), http=decode_http(raw_http))
