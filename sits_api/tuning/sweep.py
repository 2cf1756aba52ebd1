"""A tuning sweep: measure a model version's batching settings under closed-loop load, pick, verify, apply.

For each kind of device the live workers have (or the one asked), the sweep sets each setting it tries
as a trial override (`broker/tuning/live.py`) on that kind, with the other kinds barred from the model,
runs the closed-loop load at each concurrency through the intake (`load.closed_loop`), and writes each
point into the model's tuning record as it goes (`broker/tuning/results.py`). Then it picks the
highest-throughput point within the P99 bound (`front.choose`), measures that setting again at its
concurrency, and with `apply` stores it on the model version (`tuned_batching`: workers then batch by
it, `source: tuned`). The trial override is removed whatever happens.

The requests go over HTTP to the API (`sweep_api_url`; `clients.HttpSender`), so their
latency is all a client sees, under a key made for the sweep in the asking key's tenant and deleted at its
end: billed to that tenant, within its caps and priority (`Caller`).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from broker.config.settings import Settings
from broker.errors import ConfigError, SitsError
from broker.models import registry
from broker.models.model_record import ModelRecord
from broker.queueing import workers
from broker.state.store import Store
from broker.tenants.apikeys import create_api_key, revoke_api_keys
from broker.tuning import live, results
from broker.tuning.front import Point, Setting, Space, choose, default_space, quick_neighbours, worth
from broker.tuning.results import DONE, FAILED, Tuning
from sits_api.tuning.clients import HttpSender
from sits_api.tuning.load import Measured, closed_loop
from sits_worker.model.samples import sample_feed

log = logging.getLogger(__name__)

TUNE_TASK = "sits.tune_model"
"""The releaser task that runs a sweep (`sits_api/schedules/runner.py`)."""
METHODS = ("quick", "brute")
IMPROVEMENT = 0.02
"""The quick search moves only to a neighbour worth this share more than where it stands (noise)."""


@dataclass(frozen=True)
class TuneAsk:
    """What a sweep was asked (`POST /v1/models/<name>/tune`)."""

    model_ref: str
    p99_bound_ms: float
    method: str = "quick"
    headroom: float = 0.2
    """The pick's P99 stays this share under the bound (`Tuning.pick_bound_ms`)."""
    concurrencies: tuple[int, ...] = (1, 8, 32)
    cell_seconds: float = 2.0
    settle_seconds: float = 1.0
    apply: bool = False
    refresh: bool = False
    space: Space | None = None
    device_kinds: tuple[str, ...] = ()
    """The kinds of device to tune on, one after the other (the API names the live workers' kinds)."""
    ask_id: str = ""
    """Names the ask in the records it ends with, so its caller knows when they are all done."""
    api_url: str = ""
    """Where the sweep's clients send their requests; empty: `sweep_api_url` (never from a request's Host)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON form (a task's argument)."""
        return {"model_ref": self.model_ref, "p99_bound_ms": self.p99_bound_ms, "method": self.method,
                "headroom": self.headroom,
                "concurrencies": list(self.concurrencies), "cell_seconds": self.cell_seconds,
                "settle_seconds": self.settle_seconds, "apply": self.apply, "refresh": self.refresh,
                "space": self.space.to_dict() if self.space else None, "device_kinds": list(self.device_kinds),
                "ask_id": self.ask_id, "api_url": self.api_url}

    @classmethod
    def of(cls, data: dict[str, Any]) -> TuneAsk:
        """The inverse of `to_dict`."""
        space = data.get("space")
        return cls(**{**data, "concurrencies": tuple(data["concurrencies"]),
                      "device_kinds": tuple(data["device_kinds"]),
                      "space": Space(tuple(space["batch_sizes"]), tuple(space["delays"]), tuple(space["streams"]))
                      if space else None})


@dataclass(frozen=True)
class Caller:
    """Who asked for a sweep: its requests are made under a key of the same tenant (and role, for an admin),
    within that tenant's caps and priority, and billed to it."""

    tenant: str
    owner: str
    role: str = "user"

    def to_dict(self) -> dict[str, Any]:
        """JSON form (a task's argument)."""
        return dict(self.__dict__)


def sweep_api_url(settings: Settings) -> str:
    """The API's URL the sweep's clients send to: `tuning.api_url`, else the one `sitsctl up` recorded in
    `paths.home`, else `api.host`:`api.port` (loopback for a wildcard host). ConfigError when none is known."""
    if settings.tuning.api_url:
        return settings.tuning.api_url
    try:
        recorded = (Path(settings.paths.home) / "api-url").read_text().strip()
    except OSError:
        recorded = ""
    if recorded:
        return recorded
    if settings.api.port:
        host = "127.0.0.1" if settings.api.host in ("", "0.0.0.0") else settings.api.host
        host = "[::1]" if host == "::" else (f"[{host}]" if ":" in host else host)
        return f"http://{host}:{settings.api.port}"
    raise ConfigError("a tuning sweep does not know the API's URL: set tuning.api_url to the URL this releaser's "
                      "host reaches the API at")


def max_sweeps(settings: Settings) -> int:
    """How many sweeps may be queued or running at once: one less than a releaser's threads (at least one),
    as each holds a thread for up to `bodies.MAX_SWEEP_SECONDS` and the releasers also release every
    tenant's schedules."""
    return max(1, settings.beat.release_threads - 1)


def device_kinds(settings: Settings, store: Store, *, now: float) -> list[str]:
    """The kinds of device the live workers have, in a stable order."""
    found = {str(w.get("device", "")).partition(":")[0]
             for w in workers.list_workers(store, now=now, timeout=settings.scheduler.worker_heartbeat_timeout)
             if w.get("alive")}
    return sorted(kind for kind in found if kind)


def fleet_streams(settings: Settings, store: Store, *, kind: str, now: float) -> int:
    """The most stream slots a live worker of `kind` has."""
    return max((int(w.get("streams", 1)) for w in workers.list_workers(
        store, now=now, timeout=settings.scheduler.worker_heartbeat_timeout)
        if w.get("alive") and str(w.get("device", "")).partition(":")[0] == kind), default=1)


class Sweep:
    """One sweep's measuring: the trial override, the load, the record written point by point."""

    def __init__(self, settings: Settings, store: Store, ask: TuneAsk, caller: Caller, record: ModelRecord,
                 sender: HttpSender, *, clock: Callable[[], float] = time.time) -> None:
        self.settings, self.store, self.ask, self.caller, self.record = settings, store, ask, caller, record
        self.sender = sender
        self.clock = clock

    def measure(self, kind: str, setting: Setting, concurrency: int, seconds: float) -> Point:
        """`setting` on `kind` (the other kinds barred) under `concurrency` clients for `seconds`."""
        now = self.clock()
        knobs = live.Knobs(setting.max_batch_size, setting.max_queue_delay, setting.streams)
        live.write(self.store, self.record.ref, live.LiveBatching(
            source="trial", until=live.renew_until(now, self.ask.settle_seconds + seconds), by_kind={kind: knobs},
            others=live.BARRED, note=f"tuning sweep: {setting.to_dict()} at {concurrency} clients"))
        seen = closed_loop(self.sender.send, concurrency=concurrency, settle=self.ask.settle_seconds,
                           seconds=seconds)
        return point_of(setting, seen)


def point_of(setting: Setting, seen: Measured) -> Point:
    """The `Point` of what the clients saw."""
    return Point(setting=setting, concurrency=seen.concurrency, answered=seen.answered, seconds=seen.seconds,
                 throughput=round(seen.throughput, 2), p50_ms=round(seen.percentile_ms(50), 3),
                 p99_ms=round(seen.percentile_ms(99), 3), refused=seen.refused)


def run_tuning(settings: Settings, store: Store, ask: TuneAsk, caller: Caller, *,
               clock: Callable[[], float] = time.time) -> list[Tuning]:
    """Tune `ask.model_ref` on each kind of device asked or alive; the records it ends with. The load goes to
    the API at `ask.api_url` under a key made for the sweep in the caller's tenant (an admin's: an admin key),
    deleted when the sweep ends."""
    kinds = list(ask.device_kinds) or device_kinds(settings, store, now=clock())
    key_name = f"sits-tune-{uuid.uuid4().hex[:16]}"  # (not the ask's id, which any tenant may read first)
    key_tenant = key_name if caller.role == "admin" else caller.tenant  # (an admin key acts as its name's tenant)
    sender: HttpSender | None = None
    setup_error: Exception | None = None
    try:
        record = registry.get_model(store, ask.model_ref)
        api_url = ask.api_url or sweep_api_url(settings)
        sender = HttpSender(api_url, create_api_key(store, key_name, "admin" if caller.role == "admin" else "user",
                                                    tenant="" if caller.role == "admin" else caller.tenant),
                            record.ref, [sample_feed(record.signature, 1, seed=s) for s in range(8)])
    except (SitsError, ValueError) as err:  # (the records of the kinds it would measure say why: its poller stops)
        revoke_api_keys(store, key_name, key_tenant, tries=None)
        setup_error = err
    ended = []
    try:
        for kind in kinds:
            tuning = cached_tuning(settings, store, ask, kind, now=clock())
            if tuning is not None:
                tuning = replace(tuning, tenant=caller.tenant, ask_id=ask.ask_id)
            elif sender is None:
                tuning = _unstarted(ask, caller, kind, setup_error, now=clock())
            else:
                tuning = _sweep_kind(Sweep(settings, store, ask, caller, record, sender, clock=clock), kind)
            if ask.apply and tuning.status == DONE and tuning.chosen is not None:
                apply_choice(store, ask.model_ref, tuning)
                tuning = replace(tuning, applied=True)
            results.save(store, tuning)
            ended.append(tuning)
    finally:
        if sender is not None:
            sender.close()
            revoke_api_keys(store, key_name, key_tenant, tries=None)
    return ended


def cached_tuning(settings: Settings, store: Store, ask: TuneAsk, kind: str, *, now: float) -> Tuning | None:
    """The last sweep of the ask's model on `kind`, picked again under the ask's bound, when it answers the ask
    without measuring (the same method, done within `scheduler.model_profile_cache_ttl`, no `refresh`)."""
    cached = results.read(store, ask.model_ref, kind)
    if (cached is None or ask.refresh or cached.method != ask.method
            or not cached.fresh(now=now, ttl=settings.scheduler.model_profile_cache_ttl)):
        return None
    return cached.repicked(ask.p99_bound_ms, ask.headroom)


def _unstarted(ask: TuneAsk, caller: Caller, kind: str, err: Exception | None, *, now: float) -> Tuning:
    """The failed record of an ask on `kind` whose sweep could not start, for `err`."""
    message = err.message if isinstance(err, SitsError) else str(err)
    log.warning("tuning %s on %s could not start: %s", ask.model_ref, kind, message)
    return Tuning(model_ref=ask.model_ref, device_kind=kind, method=ask.method, p99_bound_ms=ask.p99_bound_ms,
                  status=FAILED, headroom=ask.headroom, started_at=now, updated_at=now, finished_at=now,
                  error=f"the sweep could not start: {message}", tenant=caller.tenant, ask_id=ask.ask_id)


def _sweep_kind(sweep: Sweep, kind: str) -> Tuning:
    ask, store, clock = sweep.ask, sweep.store, sweep.clock
    space = ask.space or default_space((sweep.record.profile or {}).get("points") or [],
                                       p99_bound_ms=ask.p99_bound_ms,
                                       max_streams=fleet_streams(sweep.settings, store, kind=kind, now=clock()))
    total = len(space.settings())
    tuning = Tuning(model_ref=sweep.record.ref, device_kind=kind, method=ask.method, p99_bound_ms=ask.p99_bound_ms,
                    headroom=ask.headroom,
                    started_at=clock(), updated_at=clock(), space=space.to_dict(), settings_total=total,
                    tenant=sweep.caller.tenant, ask_id=ask.ask_id)
    results.begin(store, tuning, now=clock())
    try:
        def measured(setting: Setting) -> float:
            nonlocal tuning
            for concurrency in ask.concurrencies:
                point = sweep.measure(kind, setting, concurrency, ask.cell_seconds)
                tuning = replace(tuning, points=(*tuning.points, point), updated_at=clock())
                results.save(store, tuning)
            return worth(tuning.points, setting, tuning.pick_bound_ms)

        if ask.method == "brute":
            for setting in space.settings():
                measured(setting)
        else:
            _climb(space, measured)
        chosen = choose(tuning.points, tuning.pick_bound_ms)
        verified = None
        if chosen is not None:
            verified = sweep.measure(kind, chosen.setting, chosen.concurrency, 2 * ask.cell_seconds)
        return replace(tuning, status=DONE, chosen=chosen, verified=verified, finished_at=clock(), updated_at=clock())
    except SitsError as err:
        log.warning("tuning %s on %s failed: %s", sweep.record.ref, kind, err.message)
        failed = replace(tuning, status=FAILED, error=err.message, finished_at=clock(), updated_at=clock())
        results.save(store, failed)
        return failed
    finally:
        try:
            live.clear(store, sweep.record.ref, source="trial")
        except SitsError as err:  # (the override runs out by itself: `live.renew_until`)
            log.warning("could not remove the trial batching of %s: %s", sweep.record.ref, err.message)


def _climb(space: Space, measured: Callable[[Setting], float]) -> None:
    """The quick search (`broker/tuning/front.py`): from the smallest setting, move to the best neighbour
    while one is worth more by `IMPROVEMENT`; each setting is measured once."""
    seen: dict[Setting, float] = {}
    current = space.start()
    seen[current] = measured(current)
    while True:
        for neighbour in quick_neighbours(space, current):
            if neighbour not in seen:
                seen[neighbour] = measured(neighbour)
        best = max(quick_neighbours(space, current), key=lambda s: seen[s], default=current)
        if seen[best] <= seen[current] * (1 + IMPROVEMENT) or seen[best] == 0:
            return
        current = best


def apply_choice(store: Store, model_ref: str, tuning: Tuning) -> ModelRecord:
    """Store the chosen setting on the model version for its kind of device (`tuned_batching`)."""
    assert tuning.chosen is not None
    chosen = tuning.chosen
    entry = {**chosen.setting.to_dict(), "p99_bound_ms": tuning.p99_bound_ms, "headroom": tuning.headroom,
             "throughput": chosen.throughput,
             "p99_ms": chosen.p99_ms, "concurrency": chosen.concurrency, "tuned_at": tuning.finished_at}

    def merged(record: ModelRecord) -> dict[str, Any]:
        return {"tuned_batching": {**(record.tuned_batching or {}), tuning.device_kind: entry}}
    return registry.update_model_version(store, model_ref, merged)
