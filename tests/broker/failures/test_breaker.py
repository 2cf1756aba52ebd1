"""Circuit breakers: the pure decision (closed, open, half-open from counts and the clock passed in), a
worker's board of its breakers over real Redis, and the API's fail-fast view of them."""

from __future__ import annotations

import pytest

from broker.failures import breaker
from broker.failures.breaker import CLOSED, HALF_OPEN, OPEN, Breaker, BreakerBoard, BreakerView, ModelUnavailable
from broker.failures.settings import BreakerSettings
from broker.queueing import workers
from broker.state.store import Store

NOW = 1_800_000_000.0
SETTINGS = BreakerSettings(failure_rate=0.1, window=60.0, min_runs=10, cool_down=30.0)
MODEL = "mlp@v1"


def _runs(state: Breaker, *outcomes: bool, at: float = NOW, settings: BreakerSettings = SETTINGS) -> Breaker:
    """`state` after one run per outcome (True: failed), all at `at`."""
    for failed in outcomes:
        state = breaker.note_runs(state, settings, runs=1, failures=int(failed), now=at,
                                  error="device_oom: out of memory" if failed else "")
    return state


def test_a_breaker_opens_only_once_the_window_holds_min_runs_and_too_many_failed() -> None:
    few = _runs(Breaker(), True, True, True)  # 100 % failed, but only 3 runs
    assert few.state == CLOSED and breaker.window_counts(few, SETTINGS, now=NOW) == (3, 3)

    healthy = _runs(Breaker(), *([False] * 9), True)  # 10 % failed: not more than the rate
    assert healthy.state == CLOSED

    tripped = _runs(healthy, True)  # 2 of 11: 18 %
    assert tripped.state == OPEN and tripped.retry_at == NOW + SETTINGS.cool_down and tripped.opened == 1
    assert tripped.last_error == "device_oom: out of memory"


def test_runs_older_than_the_window_no_longer_count() -> None:
    old_failures = _runs(Breaker(), *([True] * 9), at=NOW)

    later = _runs(old_failures, False, at=NOW + SETTINGS.window + 5)

    assert later.state == CLOSED and breaker.window_counts(later, SETTINGS, now=NOW + SETTINGS.window + 5) == (1, 0)


def test_the_default_rate_opens_at_one_failure_in_min_runs() -> None:
    defaults = BreakerSettings()
    state = _runs(Breaker(), *([False] * (defaults.min_runs - 1)), settings=defaults)
    assert state.state == CLOSED

    assert _runs(state, True, settings=defaults).state == OPEN  # 1 of 20 is above 0.3 %


def test_an_open_breaker_turns_half_open_by_the_clock_and_bars_leases_until_then() -> None:
    tripped = _runs(Breaker(), *([True] * 10))

    assert breaker.state_at(tripped, now=NOW + 29) == OPEN
    assert not breaker.may_lease(tripped, SETTINGS, now=NOW + 29)
    assert breaker.state_at(tripped, now=NOW + 30) == HALF_OPEN
    assert breaker.may_lease(tripped, SETTINGS, now=NOW + 30)
    # runs of batches leased before it opened change nothing while it is open
    assert _runs(tripped, False, False, at=NOW + 1) == tripped


def test_one_probe_at_a_time_closes_or_opens_the_breaker_again() -> None:
    tripped = _runs(Breaker(), *([True] * 10))
    probing = breaker.with_probe(tripped, now=NOW + 31)

    assert probing.state == HALF_OPEN and probing.since == NOW + 30
    assert not breaker.may_lease(probing, SETTINGS, now=NOW + 32)  # the probe is out
    assert breaker.may_lease(probing, SETTINGS, now=NOW + 31 + SETTINGS.cool_down)  # it never reported

    closed = _runs(probing, False, at=NOW + 33)
    assert closed.state == CLOSED and closed.since == NOW + 33 and closed.buckets == ()

    again = _runs(probing, True, at=NOW + 33)
    assert again.state == OPEN and again.retry_at == NOW + 33 + SETTINGS.cool_down and again.opened == 2


def test_a_model_is_unavailable_only_when_every_live_worker_s_breaker_is_open() -> None:
    tripped = _runs(Breaker(), *([True] * 10))
    later = _runs(Breaker(), *([True] * 10), at=NOW + 10)

    assert breaker.unavailable_until([tripped, later], now=NOW + 11) == NOW + 30  # the soonest half-open
    assert breaker.unavailable_until([tripped, None], now=NOW + 11) is None  # a worker that never failed
    assert breaker.unavailable_until([tripped, later], now=NOW + 30) is None  # one turned half-open
    assert breaker.unavailable_until([], now=NOW) is None  # no worker at all: not the breakers' doing


def test_only_device_and_run_failures_count() -> None:
    assert all(breaker.counts(name) for name in ("device_oom", "run_timeout", "transient", "invalid_model"))
    assert not any(breaker.counts(name) for name in ("bad_input", "cancelled", "worker_lost"))


def test_a_record_survives_its_json_and_a_broken_one_reads_closed() -> None:
    tripped = _runs(Breaker(), *([True] * 10))

    assert Breaker.from_json(tripped.to_json()) == tripped
    assert Breaker.from_json("{not json") == Breaker()


def test_a_worker_s_board_writes_its_breakers_for_the_api_and_reads_them_back_when_started_again(
        store: Store) -> None:
    clock = [NOW]
    board = BreakerBoard(store, SETTINGS, lambda: "w1@host", clock=lambda: clock[0])
    for _ in range(10):
        board.note_run(MODEL, failed=True, error="run_timeout: too slow", now=NOW)

    assert not board.may_lease(MODEL, now=NOW + 1) and board.claim(MODEL, now=NOW + 1) is None
    again = BreakerBoard(store, SETTINGS, lambda: "w1@host")  # the worker started again under its name
    assert again.breaker(MODEL).state == OPEN and again.breaker(MODEL).last_error == "run_timeout: too slow"

    assert board.claim(MODEL, now=NOW + 30) == "probe"
    assert board.claim(MODEL, now=NOW + 30.5) is None  # one probe at a time
    board.release_probe(MODEL)  # its lease got nothing
    assert board.claim(MODEL, now=NOW + 31) == "probe"
    board.note_run(MODEL, failed=False, now=NOW + 32)
    assert board.claim(MODEL, now=NOW + 32) == "lease"
    assert breaker.read_breakers(store)[(MODEL, "w1@host")].state == CLOSED


def test_status_lists_known_workers_breakers_and_forgets_those_of_workers_gone(store: Store) -> None:
    workers.record_heartbeat(store, "w1@host", {"device": "cpu", "streams": 1}, now=NOW)
    board = BreakerBoard(store, SETTINGS, lambda: "w1@host")
    gone = BreakerBoard(store, SETTINGS, lambda: "w9@host")
    for _ in range(10):
        board.note_run(MODEL, failed=True, error="device_oom: out of memory", now=NOW)
        gone.note_run(MODEL, failed=True, now=NOW)

    [entry] = breaker.list_breakers(store, SETTINGS, now=NOW + 1, heartbeat_timeout=15)

    assert entry["model"] == MODEL and entry["worker"] == "w1@host" and entry["state"] == OPEN
    assert entry["retry_at"] == NOW + 30 and entry["runs"] == 0 and entry["opened"] == 1
    assert set(breaker.read_breakers(store)) == {(MODEL, "w1@host")}


def test_the_api_view_fails_a_model_fast_only_while_its_breaker_is_open_on_every_live_worker(store: Store) -> None:
    for name in ("w1@host", "w2@host"):
        workers.record_heartbeat(store, name, {"device": "cpu", "streams": 1}, now=NOW)
    first = BreakerBoard(store, SETTINGS, lambda: "w1@host")
    for _ in range(10):
        first.note_run(MODEL, failed=True, now=NOW)
    view = BreakerView(store, SETTINGS, heartbeat_timeout=100, max_age=0)
    view.check(MODEL, now=NOW + 1)  # w2 still takes it

    second = BreakerBoard(store, SETTINGS, lambda: "w2@host")
    for _ in range(10):
        second.note_run(MODEL, failed=True, now=NOW + 5)
    with pytest.raises(ModelUnavailable) as refused:
        view.check(MODEL, now=NOW + 6)

    assert refused.value.http_status == 503 and refused.value.retry_after == 24  # w1 half-opens at NOW + 30
    view.check("other@v1", now=NOW + 6)
    view.check(MODEL, now=NOW + 30)
    off = BreakerView(store, BreakerSettings(enabled=False), heartbeat_timeout=100, max_age=0)
    off.check(MODEL, now=NOW + 6)
