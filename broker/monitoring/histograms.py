"""Histograms kept in Redis HASHes: one field per bucket that only ever grows, summed over processes.

A histogram's observations may be made anywhere: in a script that already runs for them (`lib.lua`
`observe_latency`), or in a process that makes many (a worker's batches, an API process's HTTP
requests). Such a process counts them in memory (`Tally`) and adds them to their HASH now and then in
one transaction (`Tally.flush`), so an observation costs no round trip of its own. Every API process
then reads the fleet's sums in one HGETALL, whichever processes, hosts or replicas made them.

Fields are '<series>|<bucket>', the bucket numbered from 1 as `bucket_of` numbers it (one past the
last bound for what is past it), and '<series>|<SUM_FIELD>' for the sum of what was observed, a whole
number in the histogram's unit (nanoseconds for times).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from broker.state.store import Store, translate_redis_errors


@dataclass(frozen=True)
class Histogram:
    """One series: cumulative counts at each bound and +Inf, and the sum of what was observed."""

    cumulative: list[int]
    total: float
    """The sum of the observations, in the histogram's unit (seconds, rows, tokens)."""

    @property
    def count(self) -> int:
        """Observations in all."""
        return self.cumulative[-1]


def summed(histograms: Iterable[Histogram]) -> Histogram:
    """One histogram of every observation of `histograms` (of the same bounds): counts and sums add."""
    found = list(histograms)
    cumulative = [sum(counts) for counts in zip(*(histogram.cumulative for histogram in found), strict=True)]
    return Histogram(cumulative, sum((histogram.total for histogram in found), 0.0))


def bucket_of(value: float, bounds: Sequence[float]) -> int:
    """The bucket, from 1, of `value` among the upper `bounds`; len(bounds) + 1 past the last.
    A bound holds the values equal to it, as Prometheus's `le` says (and `lib.lua` counts)."""
    return bisect.bisect_left(bounds, max(value, 0.0)) + 1


class Tally:
    """Increments of a HASH's fields counted in this process, until `flush` adds them to Redis.

    Safe to use from several threads. A flush that cannot reach Redis keeps its increments for the
    next one, so nothing is lost while Redis is away (only what a process counted in its last moments
    before it was killed). The fields are few (series times buckets), however many observations."""

    def __init__(self, sum_field: str = "ns") -> None:
        self.sum_field = sum_field
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}

    def observe(self, series: str, value: float, bounds: Sequence[float], scale: float = 1.0) -> None:
        """Count `value` into its bucket of `series`, and `value * scale` (rounded) into its sum."""
        bucket = f"{series}|{bucket_of(value, bounds)}"
        total = f"{series}|{self.sum_field}"
        with self._lock:
            self._pending[bucket] = self._pending.get(bucket, 0) + 1
            self._pending[total] = self._pending.get(total, 0) + round(max(value, 0.0) * scale)

    def add(self, field: str, count: int = 1) -> None:
        """Add `count` to a plain counter field."""
        with self._lock:
            self._pending[field] = self._pending.get(field, 0) + count

    def pending(self) -> dict[str, int]:
        """A copy of the increments not yet flushed."""
        with self._lock:
            return dict(self._pending)

    def flush(self, store: Store, hash_key: str) -> int:
        """Add the pending increments to `hash_key` in one MULTI (all of them or none); how many fields.
        When Redis cannot take them (`SitsError`), they stay pending and the error is raised."""
        with self._lock:
            taken, self._pending = self._pending, {}
        if not taken:
            return 0
        try:
            with translate_redis_errors():
                pipe = store.client.pipeline(transaction=True)
                for field, increment in taken.items():
                    pipe.hincrby(hash_key, field, increment)
                pipe.execute()
        except Exception:
            with self._lock:
                for field, increment in taken.items():
                    self._pending[field] = self._pending.get(field, 0) + increment
            raise
        return len(taken)


def decode(raw: Mapping[str, str], bucket_count: int, sum_field: str = "ns",
           sum_scale: float = 1.0) -> dict[str, Histogram]:
    """A HASH of bucket fields (`raw`, as HGETALL reads it) as series -> `Histogram`, with `bucket_count`
    buckets (bounds and +Inf) and its sum divided by `sum_scale`. Fields of other shapes are skipped."""
    per_bucket: dict[str, list[int]] = {}
    sums: dict[str, int] = {}
    for field, value in raw.items():
        series, _, bucket = field.rpartition("|")
        if bucket == sum_field:
            sums[series] = int(value)
        elif bucket.isdigit() and 1 <= int(bucket) <= bucket_count:
            per_bucket.setdefault(series, [0] * bucket_count)[int(bucket) - 1] += int(value)
    histograms = {}
    for series, counts in per_bucket.items():
        cumulative, running = [], 0
        for count in counts:
            running += count
            cumulative.append(running)
        histograms[series] = Histogram(cumulative, sums.get(series, 0) / sum_scale)
    return histograms
