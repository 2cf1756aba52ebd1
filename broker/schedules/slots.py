"""When a schedule's slots fall, and which of them a beat pass releases: pure, the clock passed in.

A slot is an instant (whole unix seconds) at which a schedule releases one job. A `cron` schedule's
slots are its expression's matches in its time zone's wall time; an `every` schedule's are the
multiples of its period since the Unix epoch (for a period that divides an hour, aligned on the
clock). A `window` keeps only the slots inside it and bounds how late a slot may still be released.

Wall times map to instants as cron daemons run them: a wall time skipped when clocks go forward runs
just after the jump (at most one slot per instant), and the hour repeated when they go back runs once.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import UTC, datetime, time, timedelta
from typing import Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterError, croniter

from broker.errors import BadInput
from broker.setting_types import parse_duration

CatchUp = Literal["once", "skip"]

MAX_EVERY_SECONDS = 86_400
"""The longest `every` period: a day (a daily run at a wall time is a `cron`)."""
_SEARCH_STEPS = 2_000
"""How many cron matches a search looks through before it gives up (a window no match falls in). A match
outside the window sends the search on to the window's next opening (back to its last closing), so a
minute's cron with a one-minute window costs a step or two a day, not 1,440: a search takes well under a
millisecond, where listing a tenant's windowed schedules once cost 50-100 ms each."""
_SEARCH_REACH = timedelta(days=4 * 366 + 1)
"""How far from its start a search looks at most: past a leap day (a cron of 29 February), and no
further, so that a cron matching rarely costs a search no more than a few years of its matches."""
_WINDOW = re.compile(r"^\s*(\d{1,2}):(\d{2})\s*-\s*(\d{1,2}):(\d{2})\s*$")


@dataclass(frozen=True)
class Window:
    """A span of local wall time each day, `start` included and `end` not, in minutes after midnight;
    one whose end is before its start spans midnight (22:00-02:00)."""

    start: int
    end: int

    @classmethod
    def parse(cls, text: str) -> Window:
        """'17:30-19:30'; BadInput says how to write it."""
        match = _WINDOW.match(text)
        if match is None:
            raise BadInput(f"window {text!r} must be two local times, as HH:MM-HH:MM (e.g. 17:30-19:30)")
        hours_a, minutes_a, hours_b, minutes_b = (int(part) for part in match.groups())
        if hours_a > 23 or hours_b > 24 or minutes_a > 59 or minutes_b > 59 or (hours_b == 24 and minutes_b):
            raise BadInput(f"window {text!r} holds a time that is not one of a day (00:00 to 24:00)")
        start, end = hours_a * 60 + minutes_a, hours_b * 60 + minutes_b
        if start % 1440 == end % 1440:
            raise BadInput(f"window {text!r} starts where it ends; leave window out for the whole day")
        return cls(start, end)

    def text(self) -> str:
        """The window as it is written."""
        return f"{self.start // 60:02d}:{self.start % 60:02d}-{self.end // 60:02d}:{self.end % 60:02d}"

    def holds(self, wall: datetime) -> bool:
        """Whether the local wall time `wall` is inside the window."""
        minute = wall.hour * 60 + wall.minute + wall.second / 60
        if self.start < self.end:
            return self.start <= minute < self.end
        return minute >= self.start or minute < self.end


def zone(name: str) -> ZoneInfo:
    """The IANA time zone `name`; BadInput for an unknown one."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise BadInput(f"timezone {name!r} is not an IANA time zone name; give one such as UTC or "
                       "Europe/Paris") from None


def parse_every(text: str | int | float) -> int:
    """Whole seconds of an `every` period ('10s', '5m', '1h', 30); BadInput outside 1 s to a day."""
    try:
        seconds = parse_duration(text)
    except ValueError as err:
        raise BadInput(f"every: {err}") from None
    if seconds != int(seconds) or not 1 <= seconds <= MAX_EVERY_SECONDS:
        raise BadInput(f"every {text!r} must be whole seconds from 1s to 1d; a run at a wall time is a cron")
    return int(seconds)


def check_cron(expression: object) -> str:
    """The cron expression, checked: five fields (minute hour day month weekday); BadInput otherwise
    (a body's null or number included: to change a cron schedule to a period, give `every`)."""
    if not isinstance(expression, str):
        raise BadInput(f"cron must be a text of five fields, e.g. '30 17 * * 1-5', got {expression!r}; "
                       "to run at a period instead, give every")
    fields = expression.split()
    if len(fields) != 5 or not croniter.is_valid(expression):
        raise BadInput(f"cron {expression!r} is not a cron expression of five fields (minute hour day-of-month "
                       "month day-of-week), e.g. '30 17 * * 1-5'")
    return " ".join(fields)


@dataclass(frozen=True)
class Cadence:
    """What decides a schedule's slots: a cron expression or a period, a time zone and a window."""

    timezone: str = "UTC"
    cron: str | None = None
    every: int | None = None
    window: Window | None = None
    release_offset: float = 0.0
    """How long after its slot a release is due (0: at the slot); the instant templates name stays the slot's."""

    def next_slot(self, after: float) -> int:
        """The first slot after the instant `after`; BadInput when none falls within a search's reach
        (a cron whose matches all miss the window, or a date no calendar has, such as 31 February)."""
        try:
            return self._every_after(after) if self.every else self._cron_after(after)
        except (CroniterError, ValueError, OverflowError) as err:  # (past year 9999: a ValueError)
            raise BadInput(f"cron {self.cron!r} has no slot to come ({err}); give one that matches a real "
                           "date") from None

    def latest_slot(self, at: float) -> int | None:
        """The last slot at or before the instant `at` (None when none lies within a search's reach)."""
        try:
            return self._every_at(at) if self.every else self._cron_at(at)
        except (CroniterError, ValueError, OverflowError):
            return None

    def due_at(self, slot: int) -> float:
        """When the release of `slot` is due."""
        return slot + self.release_offset

    def window_end(self, slot: int) -> float | None:
        """The end of the window that holds `slot` (None without a window): the last instant its
        release may start, late or held."""
        if self.window is None:
            return None
        wall = self._wall(slot)
        day = wall.date()
        if self.window.end <= self.window.start <= _minute(wall):  # spans midnight, and the slot is before it
            day += timedelta(days=1)
        return self._instant(datetime.combine(day, time()) + timedelta(minutes=self.window.end))

    def labels(self, slot: int) -> dict[str, str]:
        """What the templates `{date}`, `{time}` and `{slot}` stand for at `slot`: its local date
        (2026-05-01) and time (173000), and the slot in UTC (20260501T153000Z), unique to each slot."""
        wall = self._wall(slot)
        utc = datetime.fromtimestamp(slot, UTC)
        return {"date": wall.strftime("%Y-%m-%d"), "time": wall.strftime("%H%M%S"),
                "slot": utc.strftime("%Y%m%dT%H%M%SZ")}

    # --- every -----------------------------------------------------------------------------------
    def _every_after(self, after: float) -> int:
        period = int(self.every or 1)
        candidate = (math.floor(after / period) + 1) * period
        for _ in range(_SEARCH_STEPS):
            wall = self._wall(candidate)
            if self.window is None or self.window.holds(wall):
                return candidate
            opens = self._next_opening(wall)
            candidate = max(candidate + period, math.ceil(opens / period) * period)
        raise BadInput(f"every {period}s has no slot inside window {self.window.text() if self.window else ''}; "
                       "widen the window or shorten the period")

    def _every_at(self, at: float) -> int | None:
        period = int(self.every or 1)
        candidate = math.floor(at / period) * period
        for _ in range(_SEARCH_STEPS):
            wall = self._wall(candidate)
            if self.window is None or self.window.holds(wall):
                return candidate
            closed = self._last_closing(wall)
            candidate = min(candidate - period, math.ceil(closed / period) * period - period)
        return None

    def _next_opening(self, wall: datetime) -> float:
        """The instant the window next opens after the local wall time `wall` (outside it)."""
        return self._instant(self._next_opening_wall(wall))

    def _next_opening_wall(self, wall: datetime) -> datetime:
        """The naive local wall time the window next opens at after `wall` (which may fall in a jump forward)."""
        assert self.window is not None
        opening = datetime.combine(wall.date(), time()) + timedelta(minutes=self.window.start)
        if opening <= wall.replace(tzinfo=None):
            opening += timedelta(days=1)
        return opening

    def _last_closing(self, wall: datetime) -> float:
        """The instant the window last closed before the local wall time `wall` (outside it)."""
        return self._instant(self._last_closing_wall(wall))

    def _last_closing_wall(self, wall: datetime) -> datetime:
        """The naive local wall time the window last closed at before `wall`."""
        assert self.window is not None
        closing = datetime.combine(wall.date(), time()) + timedelta(minutes=self.window.end)
        if closing > wall.replace(tzinfo=None):
            closing -= timedelta(days=1)
        return closing

    # --- cron ------------------------------------------------------------------------------------
    def _cron_after(self, after: float) -> int:
        start = self._wall(after).replace(tzinfo=None, microsecond=0)
        matches = croniter(self.cron or "", start)
        for _ in range(_SEARCH_STEPS):
            wall = matches.get_next(datetime)
            if wall - start > _SEARCH_REACH:
                break
            slot = int(self._instant(wall))
            if slot > after and (self.window is None or self.window.holds(wall)):
                return slot
            if self.window is not None and not self.window.holds(wall):  # (on to the window's next opening)
                opens = self._next_opening_wall(wall) - timedelta(seconds=1)  # (naive: as croniter's matches)
                if opens > wall:
                    matches = croniter(self.cron or "", opens)
        if self.window is None:
            raise BadInput(f"cron {self.cron!r} has no slot within four years; give one that matches more often")
        raise BadInput(f"cron {self.cron!r} has no slot inside window {self.window.text()} soon enough; change the "
                       "window or the expression")

    def _cron_at(self, at: float) -> int | None:
        start = self._wall(at).replace(tzinfo=None, microsecond=0) + timedelta(seconds=1)
        matches = croniter(self.cron or "", start)
        for _ in range(_SEARCH_STEPS):
            wall = matches.get_prev(datetime)
            if start - wall > _SEARCH_REACH:
                return None
            slot = int(self._instant(wall))
            if slot <= at and (self.window is None or self.window.holds(wall)):
                return slot
            if self.window is not None and not self.window.holds(wall):  # (back to the window's last closing)
                closed = self._last_closing_wall(wall)
                if closed < wall:
                    matches = croniter(self.cron or "", closed)
        return None

    # --- wall time -------------------------------------------------------------------------------
    def _wall(self, instant: float) -> datetime:
        return datetime.fromtimestamp(instant, zone(self.timezone))

    def _instant(self, wall: datetime) -> float:
        """The instant of a naive local wall time: its first occurrence; one skipped by a jump forward,
        just after the jump (the wall time read with the offset before it)."""
        return wall.replace(tzinfo=zone(self.timezone), fold=0).timestamp()


def _minute(wall: datetime) -> float:
    return wall.hour * 60 + wall.minute + wall.second / 60


@dataclass(frozen=True)
class SlotDecision:
    """One slot a beat pass decides: released, or recorded as missed, and why."""

    slot: int
    release: bool
    catch_up: bool
    """Decided after `missed_after`: the beat was not running when it was due."""
    reason: str = ""


def plan_slots(cadence: Cadence, *, cursor: int, now: float, catch_up: CatchUp,
               missed_after: float) -> tuple[list[SlotDecision], int]:
    """The slots due at `now` after `cursor` (the last slot decided), in order, and the next slot to look at.

    Only the latest due slot and the one before it are decided: a slot due within `missed_after` is
    released on time; the ones before it were missed while the beat was down, and collapse into the
    most recent of them. A missed slot is released once under `catch_up: once` (while its window is
    open), and recorded as missed under `skip`, so a beat back after a day releases one run, not one
    per slot it missed.
    """
    latest = cadence.latest_slot(now - cadence.release_offset)
    if latest is None or latest <= cursor:
        return [], cadence.next_slot(max(cursor, latest or cursor))
    decisions = []
    on_time = now - cadence.due_at(latest) <= missed_after
    earlier = cadence.latest_slot(latest - 1) if on_time else None
    if earlier is not None and earlier > cursor:
        decisions.append(_missed(cadence, earlier, now=now, catch_up=catch_up))
    decisions.append(SlotDecision(latest, True, False) if on_time else _missed(cadence, latest, now=now,
                                                                                  catch_up=catch_up))
    return decisions, cadence.next_slot(latest)


def _missed(cadence: Cadence, slot: int, *, now: float, catch_up: CatchUp) -> SlotDecision:
    if catch_up == "skip":
        return SlotDecision(slot, False, True, "missed while no beat ran (catch_up: skip)")
    closes = cadence.window_end(slot)
    if closes is not None and now >= closes:
        return SlotDecision(slot, False, True, "missed while no beat ran, and its window closed before one came back")
    return SlotDecision(slot, True, True, "released late: no beat ran when it was due (catch_up: once)")

