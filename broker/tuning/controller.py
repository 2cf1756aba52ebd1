"""The batching controller: per model, move `max_batch_size` (the ceiling) and `max_queue_delay` from
the last window's figures. A pure decision, the clock passed in; the wiring reads and writes Redis.

How it decides, and why:

- Both knobs stay in the safe range (the ceilings and delays a tuning sweep found acceptable) and
  move one index per change, one knob at a time. A bounded step never jumps to an untried corner.
- A change needs `patience` windows in a row pointing the same way and `cooldown` seconds since the
  last change, so the fleet shows a change's effect before the next and one noisy window moves nothing.
- A P99 between `low_water * target_p99` and the target is the dead band: it resets the streak, so a
  steady load inside it never moves a knob (hysteresis).
- Overload (a full batch or more waits, and the queue grew, or stood there with P99 over target):
  capacity is short. Bigger batches amortise the per-batch cost, so the ceiling goes up, at its top
  the delay. Lowering either would only make the queue grow faster.
- P99 over target without overload: batches run too long or the head waits too long. The delay goes
  down first (a full batch never waits for it, so throughput keeps), then the ceiling.
- P99 under the band with a backlog or full batches: throughput left unused, one step more batching.
- Company (P99 under the band, no backlog): a wait for company pays when requests come fast enough that
  at least one more arrives within it; then each batch costs the device and Redis its fixed overhead once
  for more rows, which frees the CPU a busy host shares. The delay steps up to the shortest such wait.
- Quiet (no backlog, batches under half the ceiling, P99 under the band, no request expected within the
  delay): waiting gains nothing, a lone request would wait for company that never comes. The delay walks
  down to the shortest wait company is expected within, at a low rate the lowest value.
- Lowering a knob for P99 marks the index it left as too high for `memory` seconds. "Room to spare"
  does not raise the knob back there, which would cycle over and under the target for ever;
  an overload still may, as a growing queue costs more latency than a longer batch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from broker.errors import ConfigError

BATCH, DELAY = "ceiling", "delay"
"""The two knobs, as the reasons name them."""


@dataclass(frozen=True)
class SafeRange:
    """The values each knob may take, ascending: from the front of a tuning sweep."""

    batch_sizes: tuple[int, ...]
    delays: tuple[float, ...]
    """Seconds; may start at 0.0."""

    def __post_init__(self) -> None:
        for name, values, lowest in (("batch_sizes", self.batch_sizes, 1), ("delays", self.delays, 0)):
            if not values or values[0] < lowest or any(b <= a for a, b in zip(values, values[1:], strict=False)):
                raise ConfigError(f"safe range {name} must be non-empty, strictly ascending and at least "
                                  f"{lowest}, got {values!r}")


@dataclass(frozen=True)
class Window:
    """What the fleet showed over the last window (computed elsewhere from Redis counters)."""

    seconds: float
    answered: int
    """Requests answered in the window."""
    p99_seconds: float | None
    """Client-seen latency (submit to answer) P99 of those; None when too few."""
    waiting: int
    """Requests waiting in the queue at the window's end."""
    waiting_before: int
    """Requests waiting at the window's start."""
    mean_batch_rows: float
    """Mean rows per batch run in the window (0 when none ran)."""

    @property
    def growth(self) -> float:
        """How fast the queue grew, requests a second (negative: it shrank)."""
        return (self.waiting - self.waiting_before) / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class ControllerSettings:
    """The controller's target and its hysteresis."""

    target_p99: float
    """Seconds."""
    low_water: float = 0.6
    """P99 below `low_water * target_p99` is room to spare; between that and the target, hold."""
    cooldown: float = 30.0
    """Seconds between two changes."""
    patience: int = 3
    """Windows in a row that must point the same way before a change."""
    min_answered: int = 20
    """With fewer answered requests the window says nothing about P99. A model answering fewer a window
    is never found quiet either: pick a window long enough for it."""
    full_batch: float = 0.9
    """Batches whose mean rows reach this share of the ceiling fill it."""
    quiet_batch: float = 0.5
    """Batches whose mean rows stay at or under this share of the ceiling are far from it."""
    memory: float = 600.0
    """Seconds an index left for P99 over target stays barred to "room to spare" raises."""

    def __post_init__(self) -> None:
        if not (self.target_p99 > 0 and 0 < self.low_water < 1 and self.cooldown >= 0 and self.patience >= 1
                and self.min_answered >= 1 and 0 < self.quiet_batch < self.full_batch <= 1 and self.memory >= 0):
            raise ConfigError(f"controller settings out of range: {self!r} (need target_p99 > 0, 0 < low_water "
                              "< 1, cooldown >= 0, patience >= 1, min_answered >= 1, 0 < quiet_batch < full_batch "
                              "<= 1, memory >= 0)")


@dataclass(frozen=True)
class ControllerState:
    """One model's controller state between windows: small, and a JSON object as `to_dict` gives it."""

    batch_index: int
    """The ceiling's index in `SafeRange.batch_sizes`."""
    delay_index: int
    """The delay's index in `SafeRange.delays`."""
    changed_at: float = 0.0
    """When a knob last moved."""
    streak: int = 0
    """Windows in a row that pointed `streak_sign`'s way (at most `patience`)."""
    streak_sign: int = 0
    """+1: more batching, -1: less waiting, 0: none."""
    batch_cap: int | None = None
    """The ceiling index last left for P99 over target: "room to spare" raises stay under it."""
    delay_cap: int | None = None
    """The same for the delay."""
    caps_until: float = 0.0
    """When the caps lapse."""

    @classmethod
    def start(cls, safe: SafeRange, batch_size: int, delay: float, *, changed_at: float = 0.0) -> ControllerState:
        """A state at the allowed values nearest `batch_size` and `delay` (the lower on a tie)."""
        return cls(_nearest(safe.batch_sizes, batch_size), _nearest(safe.delays, delay), changed_at=changed_at)

    def to_dict(self) -> dict[str, Any]:
        """The state as a JSON object."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ControllerState:
        """A state from `to_dict`'s object."""
        def index(key: str) -> int | None:
            return None if data.get(key) is None else int(data[key])

        return cls(batch_index=int(data["batch_index"]), delay_index=int(data["delay_index"]),
                   changed_at=float(data.get("changed_at", 0.0)), streak=int(data.get("streak", 0)),
                   streak_sign=int(data.get("streak_sign", 0)), batch_cap=index("batch_cap"),
                   delay_cap=index("delay_cap"), caps_until=float(data.get("caps_until", 0.0)))


@dataclass(frozen=True)
class Decision:
    """What `step` decided: the new state and the values to apply."""

    state: ControllerState
    batch_size: int
    delay: float
    changed: bool
    reason: str
    """Short words: what the window pointed to, then what moved or why nothing did."""


@dataclass(frozen=True)
class _Pull:
    """Where one window points: `sign` +1 more batching, -1 less waiting, 0 hold; the knobs to try, in order."""

    sign: int
    knobs: tuple[str, ...]
    why: str
    capped: bool = False
    """Whether the over-target caps bound the move ("room to spare")."""
    marks: bool = False
    """Whether the index a move leaves is marked too high (P99 over target)."""


def _nearest(values: tuple[float, ...], wanted: float) -> int:
    return min(range(len(values)), key=lambda i: (abs(values[i] - wanted), i))


def _company_index(window: Window, delays: tuple[float, ...]) -> int:
    """The index of the shortest delay within which at least one more request arrives, at the window's rate
    (0, the shortest delay, when none does): the wait worth making for company."""
    rate = window.answered / window.seconds if window.seconds > 0 else 0.0
    return next((i for i, delay in enumerate(delays) if delay > 0 and rate * delay >= 1), 0)


def _pull(window: Window, settings: ControllerSettings, ceiling: int, delays: tuple[float, ...] = (0.0,),
          delay_index: int = 0) -> _Pull:
    """Where `window` points, under the ceiling `ceiling` and the delay `delays[delay_index]` (the rules of
    the module's docstring, in order)."""
    backlog = window.waiting >= ceiling  # the next batch is full and some requests still wait
    p99 = window.p99_seconds if window.answered >= settings.min_answered else None
    over = p99 is not None and p99 > settings.target_p99
    if backlog and (window.growth > 0 or (over and window.waiting_before >= ceiling)):
        return _Pull(1, (BATCH, DELAY), "overload")
    if p99 is None:
        return _Pull(0, (), "too few answers")
    if over:
        return _Pull(-1, (DELAY, BATCH), "p99 over target", marks=True)
    if p99 >= settings.low_water * settings.target_p99:
        return _Pull(0, (), "p99 within band")
    if backlog or window.mean_batch_rows >= settings.full_batch * ceiling:
        return _Pull(1, (BATCH, DELAY), "room to spare", capped=True)
    company = _company_index(window, delays)
    if delay_index < company:
        return _Pull(1, (DELAY,), "company within a longer delay", capped=True)
    if window.mean_batch_rows <= settings.quiet_batch * ceiling and (delay_index > company or company == 0):
        return _Pull(-1, (DELAY,), "quiet")
    return _Pull(0, (), "room to spare, batches part full")


def _movable(state: ControllerState, safe: SafeRange, pull: _Pull, knob: str, now: float) -> bool:
    """Whether `knob` may move one index `pull.sign`'s way."""
    index, size, cap = ((state.batch_index, len(safe.batch_sizes), state.batch_cap) if knob == BATCH
                        else (state.delay_index, len(safe.delays), state.delay_cap))
    wanted = index + pull.sign
    capped = pull.capped and cap is not None and now < state.caps_until and wanted >= cap
    return 0 <= wanted < size and not capped


def _decide(state: ControllerState, safe: SafeRange, changed: bool, reason: str) -> Decision:
    return Decision(state, safe.batch_sizes[state.batch_index], safe.delays[state.delay_index], changed, reason)


def _clamp(index: int, size: int) -> int:
    return min(max(index, 0), size - 1)


def step(state: ControllerState, window: Window, settings: ControllerSettings, safe: SafeRange, *,
         now: float) -> Decision:
    """The knobs after `window`, seen at `now`: at most one knob moved by one index (see the module)."""
    inside = replace(state, batch_index=_clamp(state.batch_index, len(safe.batch_sizes)),
                     delay_index=_clamp(state.delay_index, len(safe.delays)))
    if inside != state:  # the safe range shrank under the state: its edge is the nearest safe value
        return _decide(replace(inside, changed_at=now, streak=0, streak_sign=0), safe, True,
                       "safe range changed: clamped into it")
    pull = _pull(window, settings, safe.batch_sizes[state.batch_index], safe.delays, state.delay_index)
    knob = next((knob for knob in pull.knobs if _movable(state, safe, pull, knob, now)), None)
    if knob is None:
        uncapped = replace(pull, capped=False)
        barred = any(_movable(state, safe, uncapped, other, now) for other in pull.knobs)
        edge = "held under a level that went over target" if barred else "at the edge of the safe range"
        return _decide(replace(state, streak=0, streak_sign=0), safe, False,
                       pull.why if pull.sign == 0 else f"{pull.why}: {edge}")
    wanted = f"{pull.why}: {knob} {'up' if pull.sign > 0 else 'down'}"
    streak = min(state.streak + 1 if state.streak_sign == pull.sign else 1, settings.patience)
    counted = replace(state, streak=streak, streak_sign=pull.sign)
    if streak < settings.patience:
        return _decide(counted, safe, False, f"{wanted} after {settings.patience} windows ({streak} so far)")
    if now - state.changed_at < settings.cooldown:
        return _decide(counted, safe, False, f"{wanted} after the cooldown")
    moved = replace(state, changed_at=now, streak=0, streak_sign=0)
    until = now + settings.memory if pull.marks else state.caps_until
    if knob == BATCH:
        moved = replace(moved, batch_index=state.batch_index + pull.sign, caps_until=until,
                        batch_cap=state.batch_index if pull.marks else state.batch_cap)
    else:
        moved = replace(moved, delay_index=state.delay_index + pull.sign, caps_until=until,
                        delay_cap=state.delay_index if pull.marks else state.delay_cap)
    return _decide(moved, safe, True, wanted)
