"""A model version's tuning sweeps: one record per kind of device, kept in Redis as the sweep goes.

The record is the sweep's progress while it runs (the API and `sitsctl model tune` read it) and its
cache when it is done: a new sweep of the same version on the same kind of device is not measured again
within `scheduler.model_profile_cache_ttl` unless asked (`fresh`); a new bound is picked from the points
already measured.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from broker.errors import Conflict
from broker.state.store import Store, translate_redis_errors
from broker.tuning.front import Point, Space, choose, pareto_front

RUNNING, DONE, FAILED = "running", "done", "failed"

STALE_AFTER_SECONDS = 60.0
"""A running sweep whose record was not written for this long is taken for dead (its process stopped):
another may start. A sweep writes its record after each point, a few seconds apart."""


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


def running(store: Store, model_ref: str, *, now: float) -> Tuning | None:
    """A sweep of `model_ref` that runs now on any kind of device (not taken for dead), if any."""
    return next((t for t in read_model(store, model_ref)
                 if t.status == RUNNING and now - t.updated_at < STALE_AFTER_SECONDS), None)


def busy(tuning: Tuning) -> Conflict:
    """The Conflict of a model that `tuning` tunes now."""
    return Conflict(f"model {tuning.model_ref} is being tuned on {tuning.device_kind} since {tuning.started_at:.0f}; "
                    f"wait for that sweep to end (GET /v1/models/{tuning.model_ref}/tune)")


def begin(store: Store, tuning: Tuning, *, now: float) -> None:
    """Store `tuning` as running, unless a sweep of the model version runs already on any kind of device
    (Conflict, 409): two sweeps at once would each measure the other's load. Atomic."""
    def claim(pipe: Any) -> None:
        fields = [name for name in pipe.hkeys(store.keys.tunings) if name.rpartition("|")[0] == tuning.model_ref]
        for current in map(_parsed, pipe.hmget(store.keys.tunings, fields) if fields else []):
            if current is not None and current.status == RUNNING and now - current.updated_at < STALE_AFTER_SECONDS:
                raise busy(current)
        pipe.multi()
        pipe.hset(store.keys.tunings, _field(tuning.model_ref, tuning.device_kind), json.dumps(tuning.to_dict()))
    with translate_redis_errors():
        store.client.transaction(claim, store.keys.tunings)
