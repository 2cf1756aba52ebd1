"""Forgetting ended jobs once `jobs.retention` has passed: their records, done sets and index entries.

A job's hash, its set of done chunks and its entries in the job indexes stay after it ends, so that
its owner can read how it went and resume it. Kept for ever they would fill Redis a job at a time,
so the reaper forgets jobs that ended more than `jobs.retention` ago, a page a pass. The files a
job wrote are its owner's and stay. A forgotten job answers 404 as one that never was.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from broker.jobs.records import ACTIVE_STATUSES
from broker.state.hash_views import HashView
from broker.state.store import Store, translate_redis_errors
from broker.tenants.apikeys import record_tenant

PAGE = 100
"""The most jobs one pass looks at: the oldest created before the cutoff."""


@dataclass(frozen=True)
class _EndedJobView(HashView):
    """What forgetting a job needs of its hash."""

    status: str | None
    finished_at: str | None
    owner: str | None
    tenant: str | None
    output_dir: str | None
    counted: str | None


def forget_ended_jobs(store: Store, *, now: float, retention: float, limit: int = PAGE) -> list[str]:
    """Forget the jobs that ended before `now - retention` among the `limit` oldest created before
    then; returns their ids. `retention` 0 keeps every job. Each job goes in one transaction (WATCH on
    its hash): a job resumed meanwhile is not its old self, and is kept."""
    if retention <= 0:
        return []
    cutoff = now - retention
    with translate_redis_errors():
        candidates = store.client.zrangebyscore(store.keys.jobs, "-inf", cutoff, start=0, num=limit)
        return [job_id for job_id in candidates if _forget(store, job_id, cutoff)]


def _forget(store: Store, job_id: str, cutoff: float) -> bool:
    keys = store.keys
    with store.client.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(keys.job(job_id), keys.output_dirs)
                job = _EndedJobView.of(pipe.hmget(keys.job(job_id), _EndedJobView.names()))
                if job.status in ACTIVE_STATUSES or (job.status is not None and float(job.finished_at or 0) > cutoff):
                    pipe.unwatch()
                    return False
                held = job.output_dir and pipe.hget(keys.output_dirs, job.output_dir) == job_id
                pipe.multi()
                pipe.delete(keys.job(job_id), keys.job_done(job_id), keys.job_cuts(job_id))
                pipe.zrem(keys.jobs, job_id)
                if job.owner:
                    pipe.zrem(keys.owner_jobs(record_tenant(job.owner, job.tenant), job.owner), job_id)
                    pipe.zrem(keys.jobs_of_tenant(record_tenant(job.owner, job.tenant)), job_id)
                if job.counted and job.status:
                    pipe.hincrby(keys.job_counts, job.status, -1)
                if held:
                    pipe.hdel(keys.output_dirs, job.output_dir)
                pipe.execute()
                return True
            except redis.WatchError:
                continue
