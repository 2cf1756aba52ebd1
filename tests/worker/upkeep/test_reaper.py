"""The reaper thread of a worker process: one pass per interval among workers, never dead of an error,
prompt to stop (real Redis; the real `reaper.reap` pass where the pass matters)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from broker.config.settings import Settings
from broker.online import requests
from broker.online.requests import RequestSpec
from broker.state.embedded import EmbeddedRedis
from broker.state.store import Store
from sits_worker.device.pinning import Device
from sits_worker.device.runtime import SessionCache
from sits_worker.serving.context import WorkerContext
from sits_worker.upkeep.reaper import FIRST_PASS_WITHIN_SECONDS, TURN_INTERVALS, Reaper, worker_reaper
from tests.leasing import lease_items
from tests.waiting import eventually

INTERVAL = 0.2


class Passes:
    """A pass that records when it ran (`time.monotonic()`) and under which holder."""

    def __init__(self) -> None:
        self.runs: list[tuple[float, str]] = []
        self._lock = threading.Lock()

    def of(self, holder: str) -> Callable[[float], None]:
        def run_pass(now: float) -> None:
            with self._lock:
                self.runs.append((time.monotonic(), holder))
        return run_pass

    def count(self) -> int:
        with self._lock:
            return len(self.runs)


@pytest.fixture
def reapers() -> Iterator[list[Reaper]]:
    """Reapers a test starts; every one is stopped afterwards."""
    started: list[Reaper] = []
    yield started
    for reaper in started:
        reaper.stop(timeout=2.0)



def test_the_holder_keeps_the_turn_and_another_worker_takes_it_once_the_holder_stops_ticking(store: Store) -> None:
    passes = Passes()
    first = Reaper(store, "w1", INTERVAL, passes.of("w1"))
    second = Reaper(store, "w2", INTERVAL, passes.of("w2"))

    assert first.run_once(time.time()) is True
    assert second.run_once(time.time()) is False
    assert first.run_once(time.time()) is True  # a tick that came early does not cost its holder a pass
    time.sleep(TURN_INTERVALS * INTERVAL + 0.05)  # the holder stopped ticking: its turn runs out
    assert second.run_once(time.time()) is True
    assert first.run_once(time.time()) is False
    assert [holder for _, holder in passes.runs] == ["w1", "w1", "w2"]


def test_two_reaper_threads_pass_once_per_interval_between_them(store: Store, reapers: list[Reaper]) -> None:
    passes = Passes()
    for holder in ("w1", "w2"):
        reaper = Reaper(store, holder, INTERVAL, passes.of(holder))
        reapers.append(reaper)
        reaper.start(first_delay=0.0)  # both at once: the worst case the start-up jitter avoids
    time.sleep(6 * INTERVAL + INTERVAL / 2)
    for reaper in reapers:
        reaper.stop()

    # Both threads tick at the same instants: two passes a tick would come as 12-14 passes, pairs of them
    # milliseconds apart. A tick late by a loaded machine (the GIL, two busy cores) comes closer to the
    # next one, so the gaps are checked against half an interval, and one tick may be lost.
    times = [at for at, _ in passes.runs]
    assert 5 <= len(times) <= 7, passes.runs  # one a tick (there were 7), not two
    assert len({holder for _, holder in passes.runs}) == 1, passes.runs  # the holder kept its turn
    assert np.diff(times).min() > INTERVAL / 2, passes.runs


def test_a_pass_that_raises_does_not_end_the_thread(store: Store, reapers: list[Reaper]) -> None:
    passes = Passes()
    failures = []

    def run_pass(now: float) -> None:
        if len(failures) < 3:
            failures.append(now)
            raise RuntimeError("a bug in the pass")
        passes.of("w1")(now)

    reaper = Reaper(store, "w1", 0.05, run_pass)
    reapers.append(reaper)
    reaper.start(first_delay=0.0)

    assert eventually(lambda: passes.count() >= 2), "no pass after the failing ones"
    assert len(failures) == 3 and reaper.running


def test_a_reaper_keeps_trying_while_redis_is_away_and_passes_again_once_it_is_back(
        tmp_path: Path, reapers: list[Reaper]) -> None:
    server = EmbeddedRedis(tmp_path / "redis", appendonly=False).start()
    try:
        passes = Passes()
        reaper = Reaper(Store.connect(server.url, "treaper"), "w1", 0.05, passes.of("w1"))
        reapers.append(reaper)
        reaper.start(first_delay=0.0)
        assert eventually(lambda: passes.count() >= 1)

        server.stop()
        time.sleep(0.3)  # several ticks whose turn fails with ConnectionLost
        away = passes.count()
        assert reaper.running
        server.start()

        assert eventually(lambda: passes.count() > away, timeout=5.0), "no pass once Redis was back"
    finally:
        server.stop(kill=True)


def test_stop_ends_the_thread_promptly_between_passes_and_before_the_first(
        store: Store, reapers: list[Reaper]) -> None:
    passes = Passes()
    waiting = Reaper(store, "w1", 60.0, passes.of("w1"))
    reapers.append(waiting)
    waiting.start(first_delay=0.0)
    assert eventually(lambda: passes.count() == 1)
    not_yet = Reaper(store, "w2", 60.0, passes.of("w2"))
    reapers.append(not_yet)
    not_yet.start(first_delay=30.0)

    started = time.monotonic()
    assert waiting.stop(timeout=2.0) and not_yet.stop(timeout=2.0)
    assert time.monotonic() - started < 0.5
    assert passes.count() == 1


def test_a_starting_worker_passes_within_its_first_second_whatever_its_interval(
        store: Store, reapers: list[Reaper]) -> None:
    passes = Passes()
    reaper = Reaper(store, "w1", 60.0, passes.of("w1"))
    reapers.append(reaper)
    started = time.monotonic()
    reaper.start()  # a random first delay

    assert eventually(lambda: passes.count() == 1, timeout=FIRST_PASS_WITHIN_SECONDS + 1.0)
    assert passes.runs[0][0] - started <= FIRST_PASS_WITHIN_SECONDS + 0.1


def test_a_worker_s_reaper_thread_returns_an_expired_lease_and_replaces_the_lost_ticket(
        store: Store, zoo_dir: Path, reapers: list[Reaper]) -> None:
    """The real pass (`reaper.reap`) on the thread: a dead worker's lease comes back to its queue."""
    settings = Settings().with_overrides(scheduler={"reap_interval": "100ms", "ticket_timeout": "2s",
                                                    "ticket_linger": "1s"})
    ctx = WorkerContext(settings=settings, store=store, device=Device("cpu"), streams=1,
                        sessions=SessionCache(Device("cpu"), 1))
    spec = RequestSpec(request_id="r1", model_name="mlp", model_version="v1",
                       inputs={"features": np.zeros((1, 64), dtype=np.float32)}, rows=1, tokens=None, bucket="",
                       factors={"level": 0})
    requests.submit_request(store, spec, score=0.0, now=time.time(), max_age_seconds=60)
    store.client.zadd(store.keys.tickets, {"ticket-of-a-dead-worker": time.time() - 10})
    [leased] = lease_items(store, "mlp@v1", now=time.time(), lease_seconds=0.2, max_items=1)
    sent: list[str] = []
    reaper = worker_reaper(ctx, sent.append, holder="w1")
    reapers.append(reaper)
    reaper.start(first_delay=0.0)

    assert eventually(lambda: store.client.zscore(store.keys.ready("mlp@v1"), leased.item_id) is not None)
    assert eventually(lambda: len(sent) == 1)  # the lost ticket's replacement, sent to wake a worker
    assert store.client.zrange(store.keys.tickets, 0, -1) == sent
