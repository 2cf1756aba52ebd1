"""Listing and counting jobs: newest first, by status, by owner and by tenant, and the indexes behind it.

Jobs are kept until `jobs.retention`, so a list or a count must never cost a read per job kept: an
owner's jobs come from that owner's own index and a tenant's from its tenant's (both written by the job's
enqueue, `broker.jobs.fills.create_job`), a status filter looks through a bounded number of the newest
jobs of the index, and the jobs in each status are counted by the scripts that change a status
(`keys.job_counts`). Reaper passes add the jobs stored before those indexes and counts existed, a page
at a time (`index_job_owners`, `index_job_tenants`, `count_old_jobs`).
"""

from __future__ import annotations

from collections.abc import Callable

from broker.jobs.job_record import JobRecord
from broker.jobs.records import job_record
from broker.jobs.views import JobOwnerView
from broker.state.store import Store, translate_redis_errors
from broker.tenants.apikeys import record_tenant

LIST_SCAN_PAGE = 500
"""Job ids `list_jobs` reads from an index per round trip while it looks for matches."""
LIST_SCAN_JOBS = 20_000
"""The newest jobs a status-filtered `list_jobs` looks through at most (about 40 round trips)."""
INDEX_PAGE = 2_000
"""Jobs one `index_job_owners` (or `index_job_tenants`) pass adds to their indexes (about 30 ms of a reaper pass)."""


def list_jobs(store: Store, *, now: float, limit: int = 100, status: str | None = None,
              owner: str | None = None, tenant: str | None = None) -> list[JobRecord]:
    """The newest `limit` jobs, newest first, optionally only those with `status`, of `owner` and of
    `tenant` (a job stored before tenants: its owner's name).

    An owner's jobs within a tenant come from their own index (`keys.owner_jobs`), a tenant's from that
    tenant's (`keys.jobs_of_tenant`), however many other tenants' jobs are newer, and however many jobs
    another tenant's key of the same name holds, once reaper passes have indexed the jobs stored before those
    indexes existed (`index_job_owners`, `index_job_tenants`). Until then, and for a status filter, or an
    owner of whichever tenant (an admin's `?owner=`), an index is walked newest first in pages of
    `LIST_SCAN_PAGE`, reading only each job's status, owner and tenant, until `limit` jobs match or the
    newest `LIST_SCAN_JOBS` have been looked at, so one call never costs more than that many small reads,
    however many jobs the system has kept (`GET /v1/jobs/{id}` still finds older ones).
    """
    keys = store.keys
    with translate_redis_errors():
        if owner is not None and tenant is not None and store.client.exists(keys.owner_index_built):
            index, whole = keys.owner_jobs(tenant, owner), True
        elif tenant is not None and store.client.exists(keys.tenant_index_built):
            index, whole = keys.jobs_of_tenant(tenant), owner is None
        else:
            index, whole = keys.jobs, owner is None and tenant is None
        if status is None and whole:  # every job of the index
            ids = store.client.zrevrange(index, 0, limit - 1)
        else:
            ids = _matching_job_ids(store, index, limit=limit, status=status, owner=owner, tenant=tenant)
        pipe = store.client.pipeline(transaction=False)
        for job_id in ids:
            pipe.hgetall(keys.job(job_id))
        raws = pipe.execute()
    # filtered again: a job's status may have changed since its match was read
    return [job_record(raw, now=now) for raw in raws
            if raw and _matches(JobOwnerView(raw.get("status"), raw.get("owner"), raw.get("tenant")),
                                status, owner, tenant)]


def index_job_owners(store: Store, *, limit: int = INDEX_PAGE) -> bool:
    """Add up to `limit` jobs not indexed yet by this pass to their owners' indexes, each of its tenant; True once
    every job is (then `list_jobs` reads an owner's jobs from their index). Run by every reaper pass.

    A job's enqueue indexes it, but jobs stored before the indexes existed (or by an older API
    process during an upgrade) have none: the passes walk the `jobs` index oldest first after the
    last job indexed (`keys.owner_index_mark`, by rank as `count_old_jobs` does: a run of jobs
    created at the same instant may be longer than a page), a page per pass, so no request and no
    pass pays for a large backlog at once. Idempotent (ZADD NX with the creation time), so passes
    of several workers at once leave the same indexes. Each page also deletes its owners' indexes as releases
    kept them before key names were their tenant's (`keys.names_jobs`), read by nothing since.
    """
    keys = store.keys
    return _index_jobs(store, lambda job: keys.owner_jobs(record_tenant(job.owner, job.tenant), job.owner)
                       if job.owner else None, mark=keys.owner_index_mark, built=keys.owner_index_built,
                       limit=limit, dropped=lambda job: keys.names_jobs(job.owner) if job.owner else None)


def index_job_tenants(store: Store, *, limit: int = INDEX_PAGE) -> bool:
    """Add up to `limit` jobs not indexed yet by this pass to their tenants' indexes (a job stored before
    tenants: its owner's name's, the tenant it belongs to; one without an owner: none); True once every
    job is (then `list_jobs` reads a tenant's jobs from its index). Run by every reaper pass, as
    `index_job_owners` is, and so paged and idempotent alike."""
    keys = store.keys

    def index_of(job: JobOwnerView) -> str | None:  # (a job without an owner is the admins' alone)
        return keys.jobs_of_tenant(record_tenant(job.owner, job.tenant)) if job.owner else None

    return _index_jobs(store, index_of, mark=keys.tenant_index_mark, built=keys.tenant_index_built, limit=limit)


def _index_jobs(store: Store, index_of: Callable[[JobOwnerView], str | None], *, mark: str, built: str,
                limit: int, dropped: Callable[[JobOwnerView], str | None] = lambda job: None) -> bool:
    """One page of a backfill pass: each job after `mark` goes into the index `index_of` names (if any), and the
    key `dropped` names for it (if any) is deleted."""
    with translate_redis_errors():
        page = _page_after_mark(store, mark, limit)
        if page:
            pipe = store.client.pipeline(transaction=False)
            for job_id, _ in page:
                pipe.hmget(store.keys.job(job_id), JobOwnerView.names())
            views = [JobOwnerView.of(fields) for fields in pipe.execute()]
            for (job_id, created), job in zip(page, views, strict=True):
                index = index_of(job)
                if index is not None:
                    pipe.zadd(index, {job_id: created}, nx=True)
            for gone in {key for key in map(dropped, views) if key is not None}:
                pipe.unlink(gone)
            pipe.set(mark, page[-1][0])
            pipe.execute()
        caught_up = len(page) < limit
        if caught_up and not store.client.exists(built):
            store.client.set(built, "1")
    return caught_up


def count_old_jobs(store: Store, *, limit: int = INDEX_PAGE) -> bool:
    """Count up to `limit` jobs not looked at yet by these passes into the per-status job counts; True
    once every job is counted (then `job_status_counts` answers).

    Jobs created since the counts exist are counted by their enqueue; older ones (or ones an older API
    process stored during an upgrade) are added here, oldest first after the last job looked at
    (`_page_after_mark`), each at most once and atomically with any status change (`count_jobs.lua`),
    so the counts never miss or double a job.
    """
    keys = store.keys
    with translate_redis_errors():
        page = [job_id for job_id, _ in _page_after_mark(store, keys.job_counts_mark, limit)]
        if page:
            store.scripts.count_jobs(keys=[keys.job_counts, *(keys.job(job_id) for job_id in page)], args=[])
            store.client.set(keys.job_counts_mark, page[-1])
        caught_up = len(page) < limit
        if caught_up and not store.client.exists(keys.job_counts_built):
            store.client.set(keys.job_counts_built, "1")
    return caught_up


def _page_after_mark(store: Store, mark_key: str, limit: int) -> list[tuple[str, float]]:
    """Up to `limit` (job id, creation time) of the `jobs` index, oldest first, after the job that
    `mark_key` names: by its rank, not its time, so that a run of jobs created at the same instant
    longer than a page is never skipped. A mark that names no job in the index (none yet, or a
    creation time, as earlier releases kept, whose paging by time skipped such runs) starts from the
    oldest job; the passes are idempotent, so walking again costs time, never a wrong index or count."""
    mark = store.client.get(mark_key)
    rank = store.client.zrank(store.keys.jobs, mark) if mark else None
    start = 0 if rank is None else rank + 1
    return [(job_id, float(created)) for job_id, created in
            store.client.zrange(store.keys.jobs, start, start + limit - 1, withscores=True)]


def _matching_job_ids(store: Store, index: str, *, limit: int, status: str | None, owner: str | None,
                      tenant: str | None) -> list[str]:
    matched: list[str] = []
    seen: set[str] = set()  # jobs created meanwhile shift the ranks, so a page may repeat ids
    start = 0
    while len(matched) < limit and start < LIST_SCAN_JOBS:
        ids = store.client.zrevrange(index, start, min(start + LIST_SCAN_PAGE, LIST_SCAN_JOBS) - 1)
        if not ids:
            break
        start += len(ids)
        pipe = store.client.pipeline(transaction=False)
        for job_id in ids:
            pipe.hmget(store.keys.job(job_id), JobOwnerView.names())
        for job_id, job in zip(ids, map(JobOwnerView.of, pipe.execute()), strict=True):
            if job_id not in seen and _matches(job, status, owner, tenant):
                matched.append(job_id)
            seen.add(job_id)
    return matched[:limit]


def _matches(job: JobOwnerView, status: str | None, owner: str | None, tenant: str | None) -> bool:
    return (job.status is not None and (status is None or job.status == status)
            and (owner is None or job.owner == owner)
            and (tenant is None or (bool(job.owner) and record_tenant(job.owner, job.tenant) == tenant)))


def job_status_counts(store: Store) -> dict[str, int] | None:
    """How many jobs are in each status, from the counts the status changes keep (one round trip,
    however many jobs are kept); None until every job stored before those counts existed has been
    counted by reaper passes (`count_old_jobs`)."""
    with translate_redis_errors():
        pipe = store.client.pipeline(transaction=False)
        pipe.exists(store.keys.job_counts_built)
        pipe.hgetall(store.keys.job_counts)
        built, counts = pipe.execute()
    return decode_status_counts(counts) if built else None


def decode_status_counts(raw: dict[str, str]) -> dict[str, int]:
    """The `keys.job_counts` hash as status -> jobs, statuses no job has left out."""
    return {status: int(count) for status, count in sorted(raw.items()) if int(count)}


def count_tenant_jobs_by_status(store: Store, tenant: str, *, newest: int) -> dict[str, int]:
    """How many of the tenant's `newest` jobs (its index, `keys.jobs_of_tenant`) are in each status: their
    statuses alone, in one round trip, so a count costs no read of a whole job."""
    with translate_redis_errors():
        ids = store.client.zrevrange(store.keys.jobs_of_tenant(tenant), 0, newest - 1)
        pipe = store.client.pipeline(transaction=False)
        for job_id in ids:
            pipe.hget(store.keys.job(job_id), "status")
        statuses = pipe.execute() if ids else []
    counts: dict[str, int] = {}
    for status in statuses:
        if status:
            counts[status] = counts.get(status, 0) + 1
    return counts


def count_jobs_by_status(store: Store) -> dict[str, int]:
    """How many jobs are in each status: the kept counts (`job_status_counts`), or, until old jobs are
    all counted, a read of every job's status."""
    kept = job_status_counts(store)
    if kept is not None:
        return kept
    with translate_redis_errors():
        ids = store.client.zrange(store.keys.jobs, 0, -1)
        pipe = store.client.pipeline(transaction=False)
        for job_id in ids:
            pipe.hget(store.keys.job(job_id), "status")
        statuses = pipe.execute()
    counts: dict[str, int] = {}
    for status in statuses:
        if status:
            counts[status] = counts.get(status, 0) + 1
    return dict(sorted(counts.items()))
