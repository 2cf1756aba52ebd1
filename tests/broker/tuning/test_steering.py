"""The batching controller's pass over Redis: windows read, knobs written as a live override, changes kept."""

from __future__ import annotations

import time
from typing import Any

from broker.models import registry
from broker.online.settings import OnlineSettings
from broker.state.store import Store
from broker.tuning import live, results, steering, windows
from broker.tuning.front import Point, Setting
from broker.tuning.results import Tuning
from broker.tuning.settings import BatchingControl

PROFILE = {"source": "measured", "device": "cpu", "points": [
    {"batch_size": b, "latency_ms": 0.2 * b + 1, "p99_ms": 0.3 * b + 1.5, "rows_per_second": b / (0.2 * b + 1) * 1000}
    for b in (1, 2, 4, 8, 16, 32, 64, 128)]}
CONTROL = BatchingControl(every=1.0, patience=2, cooldown=0.0, min_answered=20)


def register(store: Store, name: str = "mlp") -> str:
    return registry.save_model_version(store, {"name": name, "version": "v1", "path": "/nowhere.onnx",
                                               "signature": {}, "static_profile": {}, "profile": PROFILE}).ref


def online(**model: object) -> OnlineSettings:
    return OnlineSettings.model_validate({"models": {"mlp": {"closed_loop": True, "target_p99": 0.1, **model}}})


def answer(store: Store, ref: str, *, at: float, latency: float, count: int, rows: int) -> None:
    windows.note_answers(store, ref, [latency] * count, rows, now=at)


def wait(store: Store, ref: str, count: int) -> None:
    store.client.delete(store.keys.waiting_requests(ref))
    if count:
        store.client.zadd(store.keys.waiting_requests(ref), {f"r{i}": 0 for i in range(count)})


def test_a_growing_queue_raises_the_ceiling_after_patience_and_the_override_says_so(store: Store) -> None:
    ref = register(store)
    register(store, "other")  # (not closed_loop: never steered)
    now = time.time()
    report = None
    for step in range(4):
        at = now + step
        answer(store, ref, at=at - 0.5, latency=0.05, count=40, rows=4)
        wait(store, ref, 100 * (step + 1))  # 100 more waiting every second
        report = steering.steer_batching(store, online(max_batch_size=1), CONTROL, now=at, device_kinds=["cpu"])
    assert report is not None and report.steered == [ref]
    override = live.read(store, ref)
    assert override is not None and override.source == "controller"
    start = steering.safe_range(store, registry.get_model(store, ref), "cpu", online().batching_for("mlp"))
    knobs = override.knobs_for("cpu", now=now + 3)
    assert knobs is not None and knobs.max_batch_size is not None and knobs.max_batch_size > start.batch_sizes[0]
    changes = steering.recent_changes(store, ref)
    assert changes and all(c["after"]["max_batch_size"] > c["before"]["max_batch_size"] for c in changes)
    assert store.client.hget(store.keys.counters, f"batching_changes:{ref}|up") == str(len(changes))


def test_the_safe_range_is_the_last_sweeps_points_within_its_bound(store: Store) -> None:
    ref = register(store)
    points = tuple(Point(Setting(b, d, 1), 8, 100, 1.0, 100.0 * b, 5.0, p99, 0)
                   for b, d, p99 in ((1, 0.0, 5.0), (8, 0.002, 40.0), (32, 0.0, 90.0), (64, 0.002, 300.0)))
    results.save(store, Tuning(model_ref=ref, device_kind="cpu", method="brute", p99_bound_ms=100.0,
                               status=results.DONE, points=points, finished_at=time.time()))
    safe = steering.safe_range(store, registry.get_model(store, ref), "cpu", online().batching_for("mlp"))
    assert safe.batch_sizes == (1, 8, 32) and safe.delays == (0.0, 0.002)
    fallback = steering.safe_range(store, registry.get_model(store, ref), "gpu", online().batching_for("mlp"))
    assert fallback.batch_sizes[0] == 1 and max(fallback.batch_sizes) <= 128


def test_a_model_under_a_sweep_is_left_alone_and_an_override_runs_out(store: Store) -> None:
    ref = register(store)
    now = time.time()
    live.write(store, ref, live.LiveBatching("trial", until=now + 30, by_kind={"cpu": live.Knobs(4)}))
    report = steering.steer_batching(store, online(), CONTROL, now=now, device_kinds=["cpu"])
    assert report.steered == [] and "sweep" in report.left[ref]
    assert live.read(store, ref).source == "trial"  # type: ignore[union-attr]
    live.clear(store, ref, source="trial")
    steering.steer_batching(store, online(), CONTROL, now=now, device_kinds=["cpu"])
    override = live.read(store, ref)
    assert override is not None and override.knobs_for("cpu", now=now) is not None
    assert override.knobs_for("cpu", now=now + 60) is None  # a controller that stops leaves nothing behind


def test_a_quiet_model_walks_its_delay_down(store: Store) -> None:
    ref = register(store)
    now = time.time()
    wait(store, ref, 0)
    for step in range(6):
        answer(store, ref, at=now + step - 0.5, latency=0.004, count=30, rows=1)
        steering.steer_batching(store, online(max_queue_delay="10ms"), CONTROL, now=now + step, device_kinds=["cpu"])
    knobs = live.read(store, ref).knobs_for("cpu", now=now + 5)  # type: ignore[union-attr]
    assert knobs is not None and knobs.max_queue_delay == 0.0


class _SweepBeginsMidPass(Store):
    """The session's Redis, where a sweep writes its first trial just after the controller's pass has read the
    overrides: the interleaving of a releaser thread's pass and another's sweep, made to happen every time."""

    def __init__(self, store: Store, trial: tuple[str, live.LiveBatching]) -> None:
        super().__init__(store.pooled_client, store.keys)
        self.trial: tuple[str, live.LiveBatching] | None = trial

    @property
    def client(self) -> Any:
        return _WritesTheTrialAfterTheSnapshot(super().client, self)


class _WritesTheTrialAfterTheSnapshot:
    def __init__(self, client: Any, store: _SweepBeginsMidPass) -> None:
        self._client, self._store = client, store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def hgetall(self, key: str) -> Any:
        found = self._client.hgetall(key)
        if key == self._store.keys.live_batching and self._store.trial is not None:
            ref, trial = self._store.trial
            self._store.trial = None
            self._client.hset(key, ref, trial.to_json())
        return found


def test_a_trial_written_during_a_pass_is_not_replaced_by_the_controller(store: Store) -> None:
    """A sweep that begins while a pass runs: the pass's write must not replace the trial (the sweep would
    measure the controller's setting, the other kinds no longer barred)."""
    ref = register(store)
    now = time.time()
    trial = live.LiveBatching("trial", until=now + 30, by_kind={"cpu": live.Knobs(4, 0.0, 1)}, others=live.BARRED)
    report = steering.steer_batching(_SweepBeginsMidPass(store, (ref, trial)), online(), CONTROL, now=now,
                                     device_kinds=["cpu"])
    assert live.read(store, ref) == trial
    assert report.steered == [] and "sweep" in report.left[ref]
