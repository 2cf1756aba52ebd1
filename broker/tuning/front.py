"""The latency/throughput front of a model's batching, and the point picked from it under a P99 bound.

A tuning sweep measures settings (batch ceiling x `max_queue_delay` x streams) under closed-loop load at
several concurrencies; each (setting, concurrency) is one `Point`: the requests a second it served and
the P50/P99 its clients saw. The front is the points no other point beats on both throughput and P99;
the pick is the front's highest throughput whose P99 meets the bound (as Triton's Model Analyzer picks
under `perf_latency_p99`). The concurrency is the load a point was measured at, not a setting: the pick
stores its setting, and the concurrency says under what load its P99 held.

Two searches (`Space`, `quick_neighbours`):
- brute: every setting of the space, at every concurrency;
- quick: a coordinate climb from the smallest setting: measure the neighbours one step away on each
  knob, move to the best, stop when none is better. A setting's worth is its best throughput within
  the bound over the concurrencies. Throughput rises with the ceiling until a batch's run reaches the
  bound, and the delay and the streams each have one best value at a given load, so the surface has
  one hill along each knob and the climb ends where the brute sweep's best is, measuring a fraction of
  the settings (the benchmark compares both).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

POWERS_OF_TWO = tuple(2 ** n for n in range(0, 11))


@dataclass(frozen=True, order=True)
class Setting:
    """One batching setting a sweep tries."""

    max_batch_size: int
    max_queue_delay: float
    """Seconds."""
    streams: int

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the delay also in ms, as the API shows delays)."""
        return {"max_batch_size": self.max_batch_size, "max_queue_delay": self.max_queue_delay,
                "max_queue_delay_ms": round(self.max_queue_delay * 1000, 3), "streams": self.streams}

    @classmethod
    def of(cls, data: dict[str, Any]) -> Setting:
        """The inverse of `to_dict`."""
        return cls(int(data["max_batch_size"]), float(data["max_queue_delay"]), int(data["streams"]))


@dataclass(frozen=True)
class Point:
    """One setting under one closed-loop load: what its clients saw."""

    setting: Setting
    concurrency: int
    answered: int
    seconds: float
    throughput: float
    """Requests answered a second."""
    p50_ms: float
    p99_ms: float
    refused: int = 0
    """Requests refused (a full queue's 429) or failed in the window: a point with any is not a candidate."""

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {**asdict(self), "setting": self.setting.to_dict()}

    @classmethod
    def of(cls, data: dict[str, Any]) -> Point:
        """The inverse of `to_dict`."""
        return cls(**{**data, "setting": Setting.of(data["setting"])})

    def meets(self, p99_bound_ms: float) -> bool:
        """Whether this point may be picked under the bound: its P99 within it, nothing refused."""
        return self.answered > 0 and self.refused == 0 and self.p99_ms <= p99_bound_ms


def pareto_front(points: Iterable[Point]) -> list[Point]:
    """The points no other beats on both higher throughput and lower P99, by ascending P99."""
    front: list[Point] = []
    for point in sorted((p for p in points if p.answered > 0), key=lambda p: (p.p99_ms, -p.throughput)):
        if not front or point.throughput > front[-1].throughput:
            front.append(point)
    return front


def choose(points: Iterable[Point], p99_bound_ms: float) -> Point | None:
    """The highest-throughput point whose P99 meets the bound (the lower P99 between equals); None when none does."""
    within = [point for point in points if point.meets(p99_bound_ms)]
    return max(within, key=lambda p: (p.throughput, -p.p99_ms)) if within else None


def worth(points: Iterable[Point], setting: Setting, p99_bound_ms: float) -> float:
    """A setting's worth to the quick search: its best throughput within the bound (0 when none meets it)."""
    best = choose((p for p in points if p.setting == setting), p99_bound_ms)
    return best.throughput if best is not None else 0.0


@dataclass(frozen=True)
class Space:
    """The values a sweep tries of each knob, ascending."""

    batch_sizes: tuple[int, ...]
    delays: tuple[float, ...]
    streams: tuple[int, ...]

    def settings(self) -> list[Setting]:
        """Every setting of the space (the brute sweep's)."""
        return [Setting(b, d, s) for b in self.batch_sizes for d in self.delays for s in self.streams]

    def start(self) -> Setting:
        """Where the quick search starts: the smallest setting, the lowest latency at a low load."""
        return Setting(self.batch_sizes[0], self.delays[0], self.streams[0])

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"batch_sizes": list(self.batch_sizes), "delays": list(self.delays), "streams": list(self.streams)}


def quick_neighbours(space: Space, setting: Setting) -> list[Setting]:
    """The settings one step away from `setting` along one knob of `space`."""
    found: list[Setting] = []
    for values, index, build in (
            (space.batch_sizes, _index(space.batch_sizes, setting.max_batch_size),
             lambda v: Setting(v, setting.max_queue_delay, setting.streams)),
            (space.delays, _index(space.delays, setting.max_queue_delay),
             lambda v: Setting(setting.max_batch_size, v, setting.streams)),
            (space.streams, _index(space.streams, setting.streams),
             lambda v: Setting(setting.max_batch_size, setting.max_queue_delay, v))):
        for step in (-1, 1):
            if 0 <= index + step < len(values):
                found.append(build(values[index + step]))
    return found


def _index(values: Sequence[Any], value: Any) -> int:
    return min(range(len(values)), key=lambda i: abs(float(values[i]) - float(value)))


def default_space(profile_points: Sequence[Mapping[str, Any]], *, p99_bound_ms: float, max_streams: int,
                  max_sizes: int = 5) -> Space:
    """The space a sweep tries when the caller names none.

    Batch sizes: powers of two whose measured run (the profile's P99 of a batch, else its median)
    takes at most half the bound, since a request waits for the batch before its own and runs in its
    own; at most `max_sizes` of them, spread evenly from 1 to the largest. Without a profile: 1 to 64.
    Delays: none, and a tenth and a fortieth of the bound (capped at 5 ms and 20 ms): a wait for
    company pays only when it is short beside the bound. Streams: 1 and the fleet's most per worker.
    """
    runs = {int(p["batch_size"]): float(p.get("p99_ms") or p.get("latency_ms") or math.inf)
            for p in profile_points if int(p.get("batch_size") or 0) >= 1}
    if runs:
        sizes = [size for size in POWERS_OF_TWO if size in runs and runs[size] <= p99_bound_ms / 2] or [min(runs)]
    else:
        sizes = [1, 4, 16, 64]
    if len(sizes) > max_sizes:  # keep both ends, spread the rest
        step = (len(sizes) - 1) / (max_sizes - 1)
        sizes = sorted({sizes[round(i * step)] for i in range(max_sizes)})
    bound = p99_bound_ms / 1000
    delays = sorted({0.0, round(min(bound / 40, 0.005), 4), round(min(bound / 10, 0.02), 4)})
    streams = sorted({1, max(1, max_streams)})
    return Space(tuple(sizes), tuple(delays), tuple(streams))
