"""A tenant's caps on active jobs (`max_inflight`) and on their chunks (`max_queued_chunks`): a place taken
before a job is queued, with its chunk count, given back when it is no longer active.

The tenant's places are a ZSET (`keys.tenant_jobs`) of job ids. Places are not handed back by every
path that ends a job (a cancel, a stop, a failure, a finalize); instead each check first drops the
places of jobs that are no longer active, so a place can never leak. A place whose job does not exist
yet (its submit is still writing it) is kept for `PLACE_GRACE_SECONDS`.
"""

from __future__ import annotations

from typing import Any

import redis

from broker.errors import RetryableError
from broker.jobs.records import ACTIVE_STATUSES
from broker.state.store import Store, translate_redis_errors

PLACE_GRACE_SECONDS = 60.0
"""How long a place is held for a job that has not been written yet."""


class TenantAtLimit(Exception):
    """The tenant has `active` jobs queued or running, its `max_inflight`: no place was taken.
    Internal control flow between `take_job_place` and the API, which answers 429."""

    def __init__(self, active: int) -> None:
        super().__init__(active)
        self.active = active


class TenantChunksAtLimit(Exception):
    """The tenant's active jobs hold `held` chunks, and the job's `asked` more would pass `most`
    (`max_queued_chunks`): no place was taken. Internal control flow, as `TenantAtLimit`."""

    def __init__(self, held: int, asked: int, most: int) -> None:
        super().__init__(held, asked, most)
        self.held, self.asked, self.most = held, asked, most


def take_job_place(store: Store, tenant: str, job_id: str, *, most: int, now: float, chunks: int = 0,
                   most_chunks: int = 0) -> None:
    """Take a place for `job_id` (of `chunks` chunks) among the tenant's active jobs: TenantAtLimit when
    `most` are taken, TenantChunksAtLimit when their chunks and its own would pass `most_chunks` (0: no
    cap; with neither, nothing is recorded). The count and the take are one transaction (WATCH), so two
    submits at once cannot both take the last place."""
    if most <= 0 and most_chunks <= 0:
        return
    key, chunks_key = store.keys.tenant_jobs(tenant), store.keys.tenant_job_chunks(tenant)
    with translate_redis_errors(), store.client.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(key, chunks_key)
                places, gone = _held_places(store, pipe, key, now=now)
                if 0 < most <= len(places) - len(gone):
                    pipe.unwatch()
                    raise TenantAtLimit(len(places) - len(gone))
                if most_chunks > 0:
                    counts = pipe.hgetall(chunks_key)
                    held = sum(int(counts.get(str(place), 0)) for place, _ in places if place not in gone)
                    if held + chunks > most_chunks:
                        pipe.unwatch()
                        raise TenantChunksAtLimit(held, chunks, most_chunks)
                pipe.multi()
                if gone:
                    pipe.zrem(key, *gone)
                    pipe.hdel(chunks_key, *gone)
                pipe.zadd(key, {job_id: now})
                pipe.hset(chunks_key, job_id, chunks)
                pipe.execute()
                return
            except redis.WatchError:
                continue


def give_back_job_place(store: Store, tenant: str, job_id: str) -> None:
    """Give back the place `take_job_place` took for a job whose submit then failed (its folder taken, Redis
    away): else the job, never written, would keep it, and its chunks, for `PLACE_GRACE_SECONDS`. Only
    while no job of that id exists: a submit refused because its id was taken (a schedule's second release
    of a slot) must not free the place of the job that holds it. Best effort: when Redis is away the grace
    still ends it."""
    job = store.keys.job(job_id)
    try:
        with translate_redis_errors(), store.client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(job)
                    if pipe.exists(job):  # (written after all, or a twin's under the same id: its place stays)
                        pipe.unwatch()
                        return
                    pipe.multi()
                    pipe.zrem(store.keys.tenant_jobs(tenant), job_id)
                    pipe.hdel(store.keys.tenant_job_chunks(tenant), job_id)
                    pipe.execute()
                    return
                except redis.WatchError:
                    continue
    except RetryableError:
        pass


def check_job_place(store: Store, tenant: str, *, most: int, now: float) -> None:
    """TenantAtLimit when the tenant's `most` places are all held now (0: no cap), taking nothing: the API
    asks before it reads a job's input, so that a tenant at its cap costs no parse of its file.
    `take_job_place` is still what holds the place."""
    if most <= 0:
        return
    with translate_redis_errors():
        places, gone = _held_places(store, store.client, store.keys.tenant_jobs(tenant), now=now)
    if len(places) - len(gone) >= most:
        raise TenantAtLimit(len(places) - len(gone))


def _held_places(store: Store, client: Any, key: str, *, now: float) -> tuple[list[tuple[str, float]], list[str]]:
    """The places in `key` (job id, when taken), and those of them whose job is no longer active (or was
    never written, past the grace)."""
    places = client.zrange(key, 0, -1, withscores=True)
    statuses = [client.hget(store.keys.job(str(held)), "status") for held, _ in places]
    gone = [held for (held, taken), status in zip(places, statuses, strict=True)
            if status not in ACTIVE_STATUSES and not (status is None and now - taken < PLACE_GRACE_SECONDS)]
    return places, gone
