"""Live batching: settings that override a model version's own batching for a while.

Two writers use it, never at once for one model: a tuning sweep (`source` 'trial') sets each cell's
trial settings on the kind of device it measures and bars the other kinds from the model, so the
figures are that kind's alone; the batching controller (`source` 'controller') moves the batch ceiling
and the queue delay. An override lasts until `until`: a sweep whose process dies leaves no trial in
force for longer than that, and the writer renews it while it runs.

Workers read a model's override at most every `READ_EVERY_SECONDS` (one HGET), so a change takes
effect within that on every worker, without a restart.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from broker.errors import SitsError
from broker.online.batching import Batching
from broker.state.store import Store, translate_redis_errors

READ_EVERY_SECONDS = 0.5
"""How long a worker keeps a model's override before it reads it again."""

SOURCES = ("trial", "controller")


@dataclass(frozen=True)
class Knobs:
    """The batching knobs an override sets; None keeps the model's own value."""

    max_batch_size: int | None = None
    max_queue_delay: float | None = None
    """Seconds."""
    streams: int | None = None
    """0: workers of this kind lease none of the model's work."""

    def to_dict(self) -> dict[str, Any]:
        """JSON form, without the knobs left alone."""
        return {name: value for name, value in (("max_batch_size", self.max_batch_size),
                                                ("max_queue_delay", self.max_queue_delay),
                                                ("streams", self.streams)) if value is not None}

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> Knobs:
        """The knobs of a JSON object (unknown keys ignored)."""
        def number(name: str, kind: type) -> Any:
            value = data.get(name)
            return None if value is None else kind(value)
        return cls(max_batch_size=number("max_batch_size", int), max_queue_delay=number("max_queue_delay", float),
                   streams=number("streams", int))


BARRED = Knobs(streams=0)
"""The override of kinds of device a sweep does not measure: none of their slots leases the model."""


@dataclass(frozen=True)
class LiveBatching:
    """One model version's override: knobs per kind of device, and for the kinds not named."""

    source: str
    until: float
    by_kind: dict[str, Knobs] = field(default_factory=dict)
    others: Knobs | None = None
    note: str = ""
    """Why it is set (a sweep's cell, the controller's last reason)."""

    def knobs_for(self, device_kind: str, *, now: float) -> Knobs | None:
        """The knobs a `device_kind` worker applies at `now`, None when none (or the override ran out)."""
        if now >= self.until:
            return None
        return self.by_kind.get(device_kind, self.others)

    def to_json(self) -> str:
        """As stored."""
        return json.dumps({"source": self.source, "until": self.until, "note": self.note,
                           "by_kind": {kind: knobs.to_dict() for kind, knobs in self.by_kind.items()},
                           **({"others": self.others.to_dict()} if self.others is not None else {})})

    @classmethod
    def of_json(cls, text: str) -> LiveBatching | None:
        """The override stored as `text`; None for one that does not parse (a damaged field is no override)."""
        try:
            data = json.loads(text)
            return cls(source=str(data["source"]), until=float(data["until"]), note=str(data.get("note", "")),
                       by_kind={str(kind): Knobs.of(knobs) for kind, knobs in dict(data.get("by_kind") or {}).items()},
                       others=Knobs.of(data["others"]) if isinstance(data.get("others"), dict) else None)
        except (ValueError, KeyError, TypeError):
            return None


def apply(batching: Batching, live: LiveBatching | None, device_kind: str, *, now: float) -> Batching:
    """`batching` as a `device_kind` worker runs it at `now` under the override `live`."""
    knobs = live.knobs_for(device_kind, now=now) if live is not None else None
    if knobs is None or live is None:
        return batching
    return batching.with_knobs(max_batch_size=knobs.max_batch_size, max_queue_delay=knobs.max_queue_delay,
                               streams=knobs.streams, source=live.source)


def write(store: Store, model_ref: str, live: LiveBatching) -> None:
    """Set `model_ref`'s override (replacing any)."""
    with translate_redis_errors():
        store.client.hset(store.keys.live_batching, model_ref, live.to_json())


def write_unless_trial(store: Store, model_ref: str, live: LiveBatching, *, now: float) -> bool:
    """Set `model_ref`'s override unless a sweep's trial is in force at `now`; whether it was set. Atomic: a
    sweep that began since the writer last read the overrides keeps its trial."""
    def put(pipe: Any) -> bool:
        raw = pipe.hget(store.keys.live_batching, model_ref)
        current = LiveBatching.of_json(raw) if raw else None
        pipe.multi()
        if current is not None and current.source == "trial" and now < current.until:
            return False
        pipe.hset(store.keys.live_batching, model_ref, live.to_json())
        return True
    with translate_redis_errors():
        return bool(store.client.transaction(put, store.keys.live_batching, value_from_callable=True))


def read(store: Store, model_ref: str) -> LiveBatching | None:
    """`model_ref`'s override as stored (it may have run out: `LiveBatching.knobs_for` says)."""
    with translate_redis_errors():
        raw = store.client.hget(store.keys.live_batching, model_ref)
    return LiveBatching.of_json(raw) if raw else None


def read_all(store: Store) -> dict[str, LiveBatching]:
    """Every model version's override, by model ref."""
    with translate_redis_errors():
        raw = store.client.hgetall(store.keys.live_batching)
    found = {ref: LiveBatching.of_json(text) for ref, text in raw.items()}
    return {ref: live for ref, live in found.items() if live is not None}


def clear(store: Store, model_ref: str, *, source: str) -> bool:
    """Remove `model_ref`'s override if `source` set it (a sweep's end leaves a controller's alone); whether
    one was removed. Atomic: an override set by another source meanwhile stays."""
    def remove(pipe: Any) -> bool:
        raw = pipe.hget(store.keys.live_batching, model_ref)
        live = LiveBatching.of_json(raw) if raw else None
        pipe.multi()
        if live is not None and live.source == source:
            pipe.hdel(store.keys.live_batching, model_ref)
            return True
        return False
    with translate_redis_errors():
        return bool(store.client.transaction(remove, store.keys.live_batching, value_from_callable=True))


class LiveReader:
    """A worker's copy of the overrides of the models it serves, each read again after `READ_EVERY_SECONDS`."""

    def __init__(self, store: Store, *, every: float = READ_EVERY_SECONDS) -> None:
        self._store = store
        self._every = every
        self._read: dict[str, tuple[float, LiveBatching | None]] = {}

    def get(self, model_ref: str) -> LiveBatching | None:
        """`model_ref`'s override as last read; None while Redis cannot be read (the model's own settings hold)."""
        clock = time.monotonic()
        cached = self._read.get(model_ref)
        if cached is not None and clock - cached[0] < self._every:
            return cached[1]
        try:
            live = read(self._store, model_ref)
        except SitsError:  # (Redis away: the model's own batching, or the last override read, holds)
            live = cached[1] if cached is not None else None
        self._read[model_ref] = (clock, live)
        return live


def renew_until(now: float, seconds: float) -> float:
    """When an override written at `now` for a step of `seconds` should run out: a few steps later, so a
    writer that stops renewing (its process died) leaves it for a bounded time."""
    return now + max(3 * seconds, 10.0) if math.isfinite(seconds) else now + 10.0
