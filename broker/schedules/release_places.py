"""A tenant's places among the releases made at once (`beat.releases_per_tenant`), over all releasers.

A release makes its run's job as a submit would: it reads and checksums the input. Releases of one tenant
are each held to a place of that tenant's: a ZSET of the releases under way, each named by its run and its
releaser's hold token (so a releaser whose hold lapsed cannot free the place of the one that took the run
over), each until when its releaser holds it (renewed while it works, so a releaser that died frees its
place when the time passes). A run that finds its tenant's places taken is not made then: it goes back to
the beat, which sends it again a moment later, so that the releasers' threads turn to other tenants' runs
meanwhile.
"""

from __future__ import annotations

import redis

from broker.state.store import Store, translate_redis_errors


def release_id(run: str, token: str) -> str:
    """The place's name of the release of `run` by the releaser whose hold token is `token`."""
    return f"{run}#{token}"


def take_release_place(store: Store, tenant: str, release: str, *, most: int, hold_seconds: float,
                       now: float) -> bool:
    """Hold one of `tenant`'s `most` places for `release` (`release_id`) until `now` + `hold_seconds` (0: no
    cap, always True); False while the others are held. Counting and taking are one transaction (WATCH)."""
    if most <= 0:
        return True
    key = store.keys.tenant_releases(tenant)
    with translate_redis_errors(), store.client.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(key)
                holders = [held for held in pipe.zrangebyscore(key, f"({now}", "+inf") if held != release]
                if len(holders) >= most:
                    pipe.unwatch()
                    return False
                pipe.multi()
                pipe.zremrangebyscore(key, "-inf", now)
                pipe.zadd(key, {release: now + hold_seconds})
                pipe.expire(key, int(hold_seconds) + 60)
                pipe.execute()
                return True
            except redis.WatchError:
                continue


def renew_release_place(store: Store, tenant: str, release: str, *, hold_seconds: float, now: float) -> None:
    """Hold `release`'s place until `now` + `hold_seconds`, if it still holds one (and the tenant's places
    as long: the others may all be turned away meanwhile, and a long release outlast the key)."""
    key = store.keys.tenant_releases(tenant)
    with translate_redis_errors(), store.client.pipeline(transaction=True) as pipe:
        pipe.zadd(key, {release: now + hold_seconds}, xx=True)
        pipe.expire(key, int(hold_seconds) + 60)
        pipe.execute()


def give_back_release_place(store: Store, tenant: str, release: str) -> None:
    """Free `release`'s place: its release is done (another releaser's of the same run is left alone)."""
    with translate_redis_errors():
        store.client.zrem(store.keys.tenant_releases(tenant), release)
