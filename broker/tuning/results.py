"""A model version's tuning sweeps: one record per kind of device, kept in Redis as the sweep goes.

The record is the sweep's progress while it runs (the API and `sitsctl model tune` read it) and its
cache when it is done: a new sweep of the same version on the same kind of device is not measured again
within `scheduler.model_profile_cache_ttl` unless asked (`fresh`); a new bound is picked from the points
already measured.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from broker.errors import BadInput, Conflict, QueueFull
from broker.state.store import Store, translate_redis_errors
from broker.tuning.front import Point, Space, choose, pareto_front

QUEUED, RUNNING, DONE, FAILED = "queued", "running", "done", "failed"
"""A sweep's record is queued from its ask's answer (`claim`) until a releaser begins it (`begin`)."""

STALE_AFTER_SECONDS = 60.0
"""A queued or running sweep none of whose records (one per kind of device) was written for this long is
taken for dead (its process stopped, or no releaser took it): another may start. A sweep writes its record
after each point, a few seconds apart."""


@dataclass(frozen=True)
class Tuning:
    """One sweep of one model version on one kind of device."""

    model_ref: str
    device_kind: str
    method: str
    """'brute' or 'quick' (`broker/tuning/front.py`)."""
    p99_bound_ms: float
    status: str = RUNNING
    headroom: float = 0.0
    """The pick's P99 stays this share under the bound (`pick_bound_ms`), so that it holds measured again."""
    started_at: float = 0.0
    updated_at: float = 0.0
    finished_at: float | None = None
    space: dict[str, Any] = field(default_factory=dict)
    points: tuple[Point, ...] = ()
    settings_total: int = 0
    """Settings the sweep will measure at most (the brute sweep's all; the quick one's at most)."""
    chosen: Point | None = None
    verified: Point | None = None
    """The chosen setting measured again at its concurrency, after the sweep: whether its P99 held."""
    applied: bool = False
    error: str = ""
    tenant: str = ""
    """Whose key asked for it."""
    ask_id: str = ""
    """The ask it answers (`POST /v1/models/<name>/tune` names it)."""

    @property
    def pick_bound_ms(self) -> float:
        """The P99 the pick must meet: the bound less its headroom."""
        return self.p99_bound_ms * (1 - self.headroom)

    @property
    def front(self) -> list[Point]:
        """The points' latency/throughput front."""
        return pareto_front(self.points)

    def fresh(self, *, now: float, ttl: float) -> bool:
        """Whether its points may be used again at `now` instead of a new sweep."""
        return self.status == DONE and self.finished_at is not None and now - self.finished_at < ttl

    def repicked(self, p99_bound_ms: float, headroom: float) -> Tuning:
        """The same points with the pick under another bound (not verified at it)."""
        chosen = choose(self.points, p99_bound_ms * (1 - headroom))
        return replace(self, p99_bound_ms=p99_bound_ms, headroom=headroom, chosen=chosen,
                       verified=self.verified if chosen == self.chosen else None, applied=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON form, as stored and as the API shows it (with the front)."""
        return {"model_ref": self.model_ref, "device_kind": self.device_kind, "method": self.method,
                "p99_bound_ms": self.p99_bound_ms, "headroom": self.headroom, "status": self.status,
                "started_at": self.started_at,
                "updated_at": self.updated_at, "finished_at": self.finished_at, "space": self.space,
                "settings_total": self.settings_total, "points": [p.to_dict() for p in self.points],
                "front": [p.to_dict() for p in self.front],
                "chosen": self.chosen.to_dict() if self.chosen else None,
                "verified": self.verified.to_dict() if self.verified else None,
                "applied": self.applied, "error": self.error, "tenant": self.tenant, "ask_id": self.ask_id}

    @classmethod
    def of(cls, data: dict[str, Any]) -> Tuning:
        """The inverse of `to_dict`."""
        return cls(model_ref=data["model_ref"], device_kind=data["device_kind"], method=data["method"],
                   p99_bound_ms=float(data["p99_bound_ms"]), status=data.get("status", RUNNING),
                   headroom=float(data.get("headroom") or 0.0),
                   started_at=float(data.get("started_at") or 0), updated_at=float(data.get("updated_at") or 0),
                   finished_at=data.get("finished_at"), space=dict(data.get("space") or {}),
                   settings_total=int(data.get("settings_total") or 0),
                   points=tuple(Point.of(p) for p in data.get("points") or []),
                   chosen=Point.of(data["chosen"]) if data.get("chosen") else None,
                   verified=Point.of(data["verified"]) if data.get("verified") else None,
                   applied=bool(data.get("applied")), error=str(data.get("error") or ""),
                   tenant=str(data.get("tenant") or ""), ask_id=str(data.get("ask_id") or ""))

    @property
    def space_of(self) -> Space:
        """Its space as a `Space`."""
        return Space(tuple(self.space.get("batch_sizes") or ()), tuple(self.space.get("delays") or ()),
                     tuple(self.space.get("streams") or ()))


def _field(model_ref: str, device_kind: str) -> str:
    return f"{model_ref}|{device_kind}"


def save(store: Store, tuning: Tuning) -> None:
    """Write the sweep's record (its progress, or its end)."""
    with translate_redis_errors():
        store.client.hset(store.keys.tunings, _field(tuning.model_ref, tuning.device_kind),
                          json.dumps(tuning.to_dict()))


def read(store: Store, model_ref: str, device_kind: str) -> Tuning | None:
    """The last sweep of `model_ref` on `device_kind`, if any."""
    with translate_redis_errors():
        raw = store.client.hget(store.keys.tunings, _field(model_ref, device_kind))
    return _parsed(raw)


def read_model(store: Store, model_ref: str) -> list[Tuning]:
    """The last sweep of `model_ref` on each kind of device."""
    with translate_redis_errors():
        fields = [name for name in store.client.hkeys(store.keys.tunings) if name.rpartition("|")[0] == model_ref]
        raws = store.client.hmget(store.keys.tunings, fields) if fields else []
    return [t for t in map(_parsed, raws) if t is not None]


def _parsed(raw: str | None) -> Tuning | None:
    try:
        return Tuning.of(json.loads(raw)) if raw else None
    except (ValueError, KeyError, TypeError):
        return None


def _alive(tunings: list[Tuning], *, now: float) -> list[Tuning]:
    """Those of `tunings` queued or running and not taken for dead: some record of their ask was written
    within `STALE_AFTER_SECONDS` (a sweep on its second kind of device keeps the first kind's ask alive)."""
    written: dict[tuple[str, str], float] = {}
    for tuning in tunings:
        ask = (tuning.model_ref, tuning.ask_id)
        written[ask] = max(written.get(ask, 0.0), tuning.updated_at)
    return [t for t in tunings if t.status in (QUEUED, RUNNING)
            and now - written[(t.model_ref, t.ask_id)] < STALE_AFTER_SECONDS]


def running(store: Store, model_ref: str, *, now: float) -> Tuning | None:
    """A sweep of `model_ref` queued or running now on any kind of device (not taken for dead), if any."""
    return next(iter(_alive(read_model(store, model_ref), now=now)), None)


def busy(tuning: Tuning) -> Conflict:
    """The Conflict of a model that `tuning` tunes now."""
    return Conflict(f"model {tuning.model_ref} is being tuned on {tuning.device_kind} since {tuning.started_at:.0f}; "
                    f"wait for that sweep to end (GET /v1/models/{tuning.model_ref}/tune)")


def spend_sweep_seconds(store: Store, tenant: str, seconds: float, *, most: float, now: float) -> None:
    """Count `seconds` of sweeps planned by `tenant` today (UTC); QueueFull (429, until the day's end) when
    that would take the day's past `most` (0: no limit): the count goes up and, past it, back down, each
    step atomic, so asks at once cannot both pass the last of a day's seconds."""
    if most <= 0:
        return
    if seconds > most:  # (no day would take it: no retry ends that)
        raise BadInput(f"this sweep would take up to {seconds:.0f} s, more than tenant '{tenant}' may plan in a day "
                       f"({most:.0f} s, tuning.tenant_sweep_seconds): try fewer values, fewer concurrencies or "
                       "shorter cell_seconds")
    day = datetime.fromtimestamp(now, UTC)
    key = store.keys.sweep_seconds(tenant, day.strftime("%Y-%m-%d"))
    with translate_redis_errors():
        with store.client.pipeline(transaction=True) as pipe:
            pipe.incrbyfloat(key, seconds)
            pipe.expire(key, 2 * 86_400)
            spent = float(pipe.execute()[0])
        if spent <= most:
            return
        store.client.incrbyfloat(key, -seconds)
    midnight = datetime.combine(day.date() + timedelta(days=1), datetime.min.time(), UTC).timestamp()
    raise QueueFull(f"tenant '{tenant}' has planned {spent - seconds:.0f} s of tuning sweeps today (UTC); this one's "
                    f"{seconds:.0f} s would pass the {most:.0f} s a tenant may (tuning.tenant_sweep_seconds), as "
                    "every tenant's sweeps share the releasers: ask for a shorter sweep, or tomorrow",
                    retry_after=max(1, math.ceil(midnight - now)))


def refund_sweep_seconds(store: Store, tenant: str, seconds: float, *, now: float) -> None:
    """Give back `seconds` counted by `spend_sweep_seconds` for a sweep that was not queued after all."""
    with translate_redis_errors():
        store.client.incrbyfloat(store.keys.sweep_seconds(tenant, datetime.fromtimestamp(now, UTC).strftime(
            "%Y-%m-%d")), -seconds)


def claim(store: Store, tunings: list[Tuning], *, now: float, most: int) -> None:
    """Store `tunings` (one ask's records, one per kind of device) as queued when the ask is answered, so
    that the ask holds its model from then on. Conflict (409) when a sweep of the model is queued or runs
    already; QueueFull (429) when `most` asks of any models are: each holds a releaser thread while it
    runs. Atomic."""
    model_ref = tunings[0].model_ref

    def put(pipe: Any) -> None:
        alive = _alive([t for t in map(_parsed, pipe.hvals(store.keys.tunings)) if t is not None], now=now)
        mine = next((t for t in alive if t.model_ref == model_ref), None)
        if mine is not None:
            raise busy(mine)
        asks = {(t.model_ref, t.ask_id) for t in alive}
        if len(asks) >= most:
            raise QueueFull(f"{len(asks)} tuning sweeps are queued or running, the most at once (one less than "
                            "beat.release_threads, so that releases keep a releaser thread): ask again when "
                            "one has ended", retry_after=int(STALE_AFTER_SECONDS))
        pipe.multi()
        for tuning in tunings:
            pipe.hset(store.keys.tunings, _field(model_ref, tuning.device_kind),
                      json.dumps(replace(tuning, status=QUEUED, updated_at=now).to_dict()))
    with translate_redis_errors():
        store.client.transaction(put, store.keys.tunings)


def begin(store: Store, tuning: Tuning, *, now: float) -> None:
    """Store `tuning` as running, unless another sweep of the model version is queued or runs on any kind
    of device (Conflict, 409): two sweeps at once would each measure the other's load. Its own ask's
    queued records (`claim`) are its to take. Atomic."""
    def take(pipe: Any) -> None:
        fields = [name for name in pipe.hkeys(store.keys.tunings) if name.rpartition("|")[0] == tuning.model_ref]
        found = [t for t in map(_parsed, pipe.hmget(store.keys.tunings, fields) if fields else []) if t is not None]
        for current in _alive(found, now=now):
            if current.status == RUNNING or current.ask_id != tuning.ask_id:
                raise busy(current)
        pipe.multi()
        pipe.hset(store.keys.tunings, _field(tuning.model_ref, tuning.device_kind), json.dumps(tuning.to_dict()))
    with translate_redis_errors():
        store.client.transaction(take, store.keys.tunings)
