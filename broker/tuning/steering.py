"""The batching controller's pass: one step for every model version whose batching is `closed_loop`.

Every `tuning.controller.every` the beat sends `sits.steer_batching`; a releaser runs this pass. For each
such model version and each kind of device the live workers have, it reads the window (the answers since
the last pass, `windows.read_window`, and the requests waiting), takes one step of the controller
(`controller.step`: the pure decision), and writes the knobs as a *live override* of source 'controller'
that runs out a few windows later, so a controller that stops (no beat, no releaser) leaves the model's
own batching in force. A model a tuning sweep measures now is left alone. Each change is logged, kept in
a capped list (`keys.batching_changes`) and counted for `/metrics`.

The safe range is what the model's last sweep on that kind found within its bound (the ceilings and
delays of its points whose P99 met it); without a sweep, the default space of its profile under the
model's `target_p99` (`front.default_space`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from broker.models import registry
from broker.models.model_record import ModelRecord
from broker.online.batching import configured, resolve
from broker.online.settings import ModelBatching, OnlineSettings
from broker.state.store import Store, translate_redis_errors
from broker.tuning import live, results, windows
from broker.tuning.controller import ControllerSettings, ControllerState, SafeRange, Window, step
from broker.tuning.front import default_space
from broker.tuning.settings import BatchingControl

log = logging.getLogger(__name__)

STEER_TASK = "sits.steer_batching"
"""The Celery task the beat sends every `tuning.controller.every` and a releaser runs: one pass; no arguments."""
CHANGES_KEPT = 1000
"""The most changes `keys.batching_changes` keeps."""


@dataclass(frozen=True)
class Change:
    """One move of a model's knobs on one kind of device."""

    model_ref: str
    device_kind: str
    at: float
    before: dict[str, float]
    after: dict[str, float]
    reason: str

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"model_ref": self.model_ref, "device_kind": self.device_kind, "at": self.at, "before": self.before,
                "after": self.after, "reason": self.reason}


@dataclass
class SteerReport:
    """What one pass did: the models steered, those left alone and why, the changes made."""

    steered: list[str] = field(default_factory=list)
    left: dict[str, str] = field(default_factory=dict)
    changes: list[Change] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """As the task's result (Flower shows it)."""
        return {"steered": self.steered, "left": self.left, "changes": [c.to_dict() for c in self.changes]}


def control_settings(control: BatchingControl, batching: ModelBatching) -> ControllerSettings:
    """The controller's settings for one model: the section's hysteresis, the model's target."""
    return ControllerSettings(target_p99=batching.target_p99, low_water=control.low_water, cooldown=control.cooldown,
                              patience=control.patience, min_answered=control.min_answered, memory=control.memory)


def safe_range(store: Store, record: ModelRecord, device_kind: str, batching: ModelBatching) -> SafeRange:
    """The ceilings and delays the controller may use for `record` on `device_kind` (see the module)."""
    tuning = results.read(store, record.ref, device_kind)
    if tuning is not None and tuning.status == results.DONE:
        within = [p.setting for p in tuning.points if p.meets(tuning.pick_bound_ms)]
        if within:
            return SafeRange(tuple(sorted({s.max_batch_size for s in within})),
                             tuple(sorted({s.max_queue_delay for s in within})))
    space = default_space(record.profile_points, p99_bound_ms=batching.target_p99 * 1000, max_streams=1)
    return SafeRange(space.batch_sizes, space.delays)


def steer_batching(store: Store, online: OnlineSettings, control: BatchingControl, *, now: float,
                   device_kinds: list[str]) -> SteerReport:
    """One pass of the controller at `now` over the models `online` says are `closed_loop` (see the module)."""
    report = SteerReport()
    overrides = live.read_all(store)
    for record in registry.list_model_versions(store):
        batching = configured(online, record)
        if not batching.closed_loop:
            continue
        current = overrides.get(record.ref)
        if current is not None and current.source == "trial" and now < current.until:
            report.left[record.ref] = "a tuning sweep measures it"
            continue
        answered = windows.read_window(store, record.ref, since=now - control.every, until=now)
        with translate_redis_errors():
            waiting = int(store.client.zcard(store.keys.waiting_requests(record.ref)))
        knobs: dict[str, live.Knobs] = {}
        reasons = []
        for kind in device_kinds:
            knobs[kind], change = _step_kind(store, control, record, batching, kind, answered, waiting, now=now)
            if change is not None:
                report.changes.append(change)
                reasons.append(f"{kind}: {change.reason}")
        if not knobs:
            continue
        if live.write_unless_trial(store, record.ref, live.LiveBatching(
                "controller", until=live.renew_until(now, control.every), by_kind=knobs,
                note="; ".join(reasons) or (current.note if current is not None else "")), now=now):
            report.steered.append(record.ref)
        else:  # (a sweep began since the overrides were read)
            report.left[record.ref] = "a tuning sweep measures it"
    if report.changes:
        _record_changes(store, report.changes)
    return report


def _step_kind(store: Store, control: BatchingControl, record: ModelRecord, batching: ModelBatching, kind: str,
               answered: windows.Answered, waiting: int, *, now: float) -> tuple[live.Knobs, Change | None]:
    """One controller step for `record` on `kind`: the knobs to apply, and the change if one was made."""
    safe = safe_range(store, record, kind, batching)
    field_name = f"{record.ref}|{kind}"
    with translate_redis_errors():
        raw = store.client.hget(store.keys.controllers, field_name)
    stored = _parsed(raw)
    if stored is None or stored.get("safe") != [list(safe.batch_sizes), list(safe.delays)]:
        own = resolve(batching, record, kind)  # (where it stands: its own batching, a tuned pick included)
        state = ControllerState.start(safe, own.max_batch_size, own.max_queue_delay)
        waiting_before = waiting
    else:
        state = ControllerState.from_dict(stored["state"])
        waiting_before = int(stored.get("waiting", waiting))
    count = len(answered.latencies)
    window = Window(seconds=control.every, answered=count,
                    p99_seconds=answered.p99() if count >= control.min_answered else None, waiting=waiting,
                    waiting_before=waiting_before, mean_batch_rows=answered.mean_batch_rows)
    decision = step(state, window, control_settings(control, batching), safe, now=now)
    with translate_redis_errors():
        store.client.hset(store.keys.controllers, field_name, json.dumps({
            "state": decision.state.to_dict(), "waiting": waiting, "at": now, "reason": decision.reason,
            "safe": [list(safe.batch_sizes), list(safe.delays)], "batch_size": decision.batch_size,
            "delay": decision.delay, "p99": window.p99_seconds, "answered": count}))
    knobs = live.Knobs(decision.batch_size, decision.delay)
    if not decision.changed:
        return knobs, None
    before = {"max_batch_size": safe.batch_sizes[min(state.batch_index, len(safe.batch_sizes) - 1)],
              "max_queue_delay": safe.delays[min(state.delay_index, len(safe.delays) - 1)]}
    change = Change(record.ref, kind, now, before, {"max_batch_size": decision.batch_size,
                                                    "max_queue_delay": decision.delay}, decision.reason)
    log.info("batching of %s on %s: %s -> %s (%s)", record.ref, kind, before, change.after, decision.reason)
    return knobs, change


def _parsed(raw: str | None) -> dict[str, Any] | None:
    try:
        found = json.loads(raw) if raw else None
    except ValueError:
        return None
    return found if isinstance(found, dict) and isinstance(found.get("state"), dict) else None


def _record_changes(store: Store, changes: list[Change]) -> None:
    """Keep the changes (newest first, capped) and count them per model and direction for `/metrics`."""
    with translate_redis_errors():
        pipe = store.client.pipeline(transaction=False)
        pipe.lpush(store.keys.batching_changes, *(json.dumps(c.to_dict()) for c in changes))
        pipe.ltrim(store.keys.batching_changes, 0, CHANGES_KEPT - 1)
        for change in changes:
            pipe.hincrby(store.keys.counters, f"batching_changes:{change.model_ref}|{_direction(change)}", 1)
        pipe.execute()


def _direction(change: Change) -> str:
    """'up' when the change batches more (a larger ceiling or a longer delay), else 'down'."""
    grew = (change.after["max_batch_size"] > change.before["max_batch_size"]
            or change.after["max_queue_delay"] > change.before["max_queue_delay"])
    return "up" if grew else "down"


def recent_changes(store: Store, model_ref: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
    """The newest changes (of one model version, when named), newest first."""
    with translate_redis_errors():
        raw = store.client.lrange(store.keys.batching_changes, 0, CHANGES_KEPT - 1)
    found = [json.loads(entry) for entry in raw]
    return [c for c in found if model_ref is None or c["model_ref"] == model_ref][:limit]
