"""Slots and the beat's decisions over them: pure functions, the clock passed in."""

from __future__ import annotations

import time
from datetime import datetime

import pytest

from broker.errors import BadInput
from broker.schedules.slots import Cadence, Window, check_cron, parse_every, plan_slots, zone
from broker.schedules.templates import check_templates, render

PARIS = "Europe/Paris"


def at(text: str, tz: str = PARIS) -> float:
    """The instant of a local wall time '2026-05-01 17:30'."""
    return datetime.fromisoformat(text).replace(tzinfo=zone(tz)).timestamp()


def wall(instant: float, tz: str = PARIS) -> str:
    return datetime.fromtimestamp(instant, zone(tz)).strftime("%Y-%m-%d %H:%M:%S%z")


def test_a_weekday_cron_falls_on_weekdays_at_its_local_time() -> None:
    nightly = Cadence(timezone=PARIS, cron="30 17 * * 1-5")

    friday = nightly.next_slot(at("2026-05-01 12:00"))
    monday = nightly.next_slot(friday)

    assert wall(friday) == "2026-05-01 17:30:00+0200" and wall(monday) == "2026-05-04 17:30:00+0200"
    assert nightly.latest_slot(monday - 1) == friday and nightly.latest_slot(monday) == monday


def test_an_every_schedule_falls_on_multiples_of_its_period() -> None:
    tens = Cadence(every=10)

    assert tens.next_slot(1_000.0) == 1_010 and tens.next_slot(1_003.5) == 1_010
    assert tens.latest_slot(1_009.9) == 1_000 and tens.latest_slot(1_010) == 1_010


def test_a_window_keeps_only_its_slots_and_ends_where_it_says_even_across_midnight() -> None:
    late = Cadence(timezone=PARIS, every=600, window=Window.parse("22:00-01:00"))

    assert wall(late.next_slot(at("2026-05-01 12:00"))) == "2026-05-01 22:00:00+0200"
    assert wall(late.latest_slot(at("2026-05-01 12:00"))) == "2026-05-01 00:50:00+0200"
    assert wall(late.window_end(int(at("2026-05-01 23:10")))) == "2026-05-02 01:00:00+0200"
    assert wall(late.window_end(int(at("2026-05-02 00:30")))) == "2026-05-02 01:00:00+0200"


def test_clocks_going_forward_or_back_give_one_slot_per_wall_time() -> None:
    hourly = Cadence(timezone=PARIS, cron="30 * * * *")
    spring, autumn = [], []
    slot = at("2026-03-29 00:00")
    for _ in range(4):
        slot = hourly.next_slot(slot)
        spring.append(wall(slot))
    slot = at("2026-10-25 00:00")
    for _ in range(4):
        slot = hourly.next_slot(slot)
        autumn.append(wall(slot))

    # 02:30 does not exist on the spring day: it runs after the jump, once
    assert spring == ["2026-03-29 00:30:00+0100", "2026-03-29 01:30:00+0100", "2026-03-29 03:30:00+0200",
                      "2026-03-29 04:30:00+0200"]
    # 02:30 happens twice on the autumn day: it runs the first time only
    assert autumn == ["2026-10-25 00:30:00+0200", "2026-10-25 01:30:00+0200", "2026-10-25 02:30:00+0200",
                      "2026-10-25 03:30:00+0100"]


def test_a_slot_due_now_is_released_on_time() -> None:
    decisions, next_slot = plan_slots(Cadence(every=10), cursor=100, now=110.2, catch_up="skip", missed_after=60)

    assert [(d.slot, d.release, d.catch_up) for d in decisions] == [(110, True, False)] and next_slot == 120


def test_slots_missed_while_no_beat_ran_collapse_into_one_release_under_catch_up_once() -> None:
    back_soon, _ = plan_slots(Cadence(every=10), cursor=100, now=135.2, catch_up="once", missed_after=60)
    back_late, next_slot = plan_slots(Cadence(every=10), cursor=100, now=10_000.5, catch_up="once", missed_after=60)

    # 110 and 120 were missed: the latest of them once, then 130 on time
    assert [(d.slot, d.release, d.catch_up) for d in back_soon] == [(120, True, True), (130, True, False)]
    assert [(d.slot, d.release, d.catch_up) for d in back_late] == [(9_990, True, True), (10_000, True, False)]
    assert next_slot == 10_010


def test_a_missed_slot_is_not_released_under_catch_up_skip() -> None:
    nightly = Cadence(timezone=PARIS, cron="30 17 * * *")
    slot = int(at("2026-05-01 17:30"))

    decisions, _ = plan_slots(nightly, cursor=slot - 86_400, now=slot + 3_600, catch_up="skip", missed_after=60)

    assert [(d.slot, d.release) for d in decisions] == [(slot, False)] and "catch_up: skip" in decisions[0].reason


def test_a_missed_slot_is_released_late_under_catch_up_once_only_while_its_window_is_open() -> None:
    nightly = Cadence(timezone=PARIS, cron="30 17 * * *", window=Window.parse("17:30-19:30"))
    slot = int(at("2026-05-01 17:30"))

    within, _ = plan_slots(nightly, cursor=slot - 86_400, now=slot + 3_600, catch_up="once", missed_after=60)
    after, _ = plan_slots(nightly, cursor=slot - 86_400, now=slot + 3 * 3_600, catch_up="once", missed_after=60)

    assert [(d.slot, d.release, d.catch_up) for d in within] == [(slot, True, True)]
    assert [(d.slot, d.release) for d in after] == [(slot, False)] and "window closed" in after[0].reason


def test_nothing_is_decided_twice() -> None:
    decisions, next_slot = plan_slots(Cadence(every=10), cursor=110, now=115, catch_up="once", missed_after=60)

    assert decisions == [] and next_slot == 120


def test_a_release_offset_moves_the_due_time_not_the_slot() -> None:
    decisions, _ = plan_slots(Cadence(every=60, release_offset=5), cursor=0, now=63, catch_up="once",
                              missed_after=60)

    assert decisions == []  # 60 is due only at 65
    later, _ = plan_slots(Cadence(every=60, release_offset=5), cursor=0, now=65.1, catch_up="once", missed_after=60)
    assert [d.slot for d in later] == [60]


@pytest.mark.parametrize(("text", "problem"), [("25:00-26:00", "not one of a day"), ("9-10", "HH:MM-HH:MM"),
                                               ("10:00-10:00", "starts where it ends")])
def test_a_bad_window_says_how_to_write_one(text: str, problem: str) -> None:
    with pytest.raises(BadInput, match=problem):
        Window.parse(text)


def test_bad_cadences_are_refused_with_what_to_write() -> None:
    with pytest.raises(BadInput, match="five fields"):
        check_cron("30 17 * *")
    with pytest.raises(BadInput, match="five fields"):
        check_cron("61 17 * * *")
    with pytest.raises(BadInput, match="from 1s to 1d"):
        parse_every("0.5s")
    with pytest.raises(BadInput, match="IANA"):
        zone("Mars/Olympus")
    assert parse_every("10s") == 10 and parse_every("5m") == 300


def test_templates_name_the_slot_in_local_and_utc_time_and_refuse_other_braces() -> None:
    slot = int(at("2026-05-01 17:30"))
    labels = Cadence(timezone=PARIS, cron="30 17 * * *").labels(slot)

    job = render({"input_batch": "/in/{date}.npy", "output_dir": "/out/{date}/{time}/{slot}", "model": "m"}, labels)

    assert job == {"input_batch": "/in/2026-05-01.npy", "output_dir": "/out/2026-05-01/173000/20260501T153000Z",
                   "model": "m"}
    with pytest.raises(BadInput, match=r"\{dat\}"):
        check_templates({"output_dir": "/out/{dat}"})
    with pytest.raises(BadInput, match="unmatched brace"):
        check_templates({"output_dir": "/out/{date"})


@pytest.mark.parametrize(("cron", "window"), [
    ("0 0 29 2 *", "00:01-00:02"),  # leap days only, never in the window: past year 9999 was a 500
    ("0 0 29 2 1", "00:01-00:02"),  # 29 February or any February Monday, never in the window
    ("* 0 * * *", "12:00-12:01"),  # every minute of an hour the window never holds
])
def test_a_cron_whose_matches_never_fall_in_its_window_is_refused_quickly(cron: str, window: str) -> None:
    cadence = Cadence(cron=cron, timezone="UTC", window=Window.parse(window))
    began = time.process_time()
    with pytest.raises(BadInput, match="no slot inside window"):
        cadence.next_slot(at("2026-12-07 10:00", "UTC"))
    assert cadence.latest_slot(at("2026-12-07 10:00", "UTC")) is None
    assert time.process_time() - began < 0.5, "a search is bounded by its reach, not by thousands of rare matches"


def test_a_cron_that_is_not_text_is_refused_with_what_to_write() -> None:
    for value in (None, 5, ["* * * * *"]):
        with pytest.raises(BadInput, match="give every"):
            check_cron(value)


def _scanned(cadence: Cadence, instant: float, *, forward: bool) -> int | None:
    """The slot found by looking at every cron match in turn (what the search skips past a closed window to)."""
    from datetime import timedelta

    from croniter import croniter
    start = cadence._wall(instant).replace(tzinfo=None, microsecond=0) + timedelta(seconds=0 if forward else 1)
    matches = croniter(cadence.cron or "", start)
    for _ in range(20_000):
        match = matches.get_next(datetime) if forward else matches.get_prev(datetime)
        slot = int(cadence._instant(match))
        assert cadence.window is not None
        if (slot > instant if forward else slot <= instant) and cadence.window.holds(match):
            return slot
    return None


@pytest.mark.parametrize("seed", range(3))
def test_a_windowed_cron_skips_to_its_window_and_finds_the_slot_every_match_would(seed: int) -> None:
    """A minute's cron with a one-minute window looked at each of its matches (1,400 a day); the search skips
    from a match outside the window to the window's opening (or, looking back, its closing), and finds the
    same slots, jumps of the clock included (a window opening in the hour a spring night skips)."""
    import random
    rng = random.Random(seed)
    jumps = {PARIS: at("2026-03-29 02:00"), "America/New_York": at("2026-03-08 02:00", "America/New_York"),
             "Australia/Lord_Howe": at("2026-10-04 02:00", "Australia/Lord_Howe")}
    for _ in range(12):
        tz = rng.choice(sorted(jumps))
        cron, shortest = rng.choice([("* * * * *", 1), ("*/7 * * * *", 30), ("0,30 * * * *", 31),
                                     ("15 */3 * * 1-5", 181)])  # (a window that holds a match of its cron)
        opens = rng.choice([0, 90, 120, 150, 1430, rng.randrange(1440)])
        closes = (opens + max(shortest, rng.choice([1, 30, 61, 600]))) % 1440
        window = f"{opens // 60:02d}:{opens % 60:02d}-{closes // 60:02d}:{closes % 60:02d}"
        cadence = Cadence(timezone=tz, cron=cron, window=Window.parse(window))
        instant = jumps[tz] + rng.uniform(-8 * 3600, 8 * 3600)

        assert cadence.next_slot(instant) == _scanned(cadence, instant, forward=True), cadence
        assert cadence.latest_slot(instant) == _scanned(cadence, instant, forward=False), cadence
