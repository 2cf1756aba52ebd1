"""What ran beside each job chunk on this worker's other stream slots.

Streams of one worker share its cores (or its device), and a chunk runs slower beside a heavy
neighbour than beside a light one or alone: on the 2-core reference machine an mlp chunk beside a
convnet chunk takes about 70 % longer than beside another mlp chunk. Deadline admission learns that
per pair of models (`broker/sla/figures.py`, `slot_mix`), so each chunk's ack says how many of its
seconds it spent beside which model version. This tracker keeps the intervals of the chunks running
now and of the last few that ended, and answers that split when a chunk ends.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

ALONE = "alone"
"""The neighbour label of time a chunk ran with no other chunk on this worker."""

ENDED_KEPT = 64
"""Ended chunks' intervals kept: far more than run beside one chunk on a worker of a few streams."""


@dataclass(frozen=True)
class Interval:
    """One chunk's run on a stream slot: its model version, from `start` to `end` (monotonic seconds)."""

    version: str
    start: float
    end: float = float("inf")


def beside(own: Interval, others: list[Interval]) -> dict[str, float]:
    """Seconds of `own` spent beside each model version of `others` (chunks that overlapped it), and
    `ALONE` for the rest. Where several others overlap at once (three or more streams) each version's
    overlap is scaled down so that the split adds up to `own`'s length."""
    length = max(0.0, own.end - own.start)
    overlaps: dict[str, float] = {}
    for other in others:
        shared = min(own.end, other.end) - max(own.start, other.start)
        if shared > 0:
            overlaps[other.version] = overlaps.get(other.version, 0.0) + shared
    covered = _union(own, others)
    total = sum(overlaps.values())
    scale = covered / total if total > 0 else 0.0
    split = {version: seconds * scale for version, seconds in overlaps.items()}
    if length - covered > 0:
        split[ALONE] = length - covered
    return split


def _union(own: Interval, others: list[Interval]) -> float:
    """How much of `own` at least one of `others` covers."""
    spans = sorted((max(own.start, o.start), min(own.end, o.end)) for o in others
                   if min(own.end, o.end) > max(own.start, o.start))
    covered, reach = 0.0, own.start
    for start, end in spans:
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered


class SlotOverlap:
    """The running and recently ended chunks of one worker process, shared by its stream threads."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._running: dict[int, Interval] = {}
        self._ended: deque[Interval] = deque(maxlen=ENDED_KEPT)
        self._tokens = itertools.count()

    def begin(self, version: str) -> int:
        """A chunk of model `version` starts on a slot; returns the token its `end` takes."""
        with self._lock:
            token = next(self._tokens)
            self._running[token] = Interval(version, self._clock())
            return token

    def end(self, token: int) -> dict[str, float]:
        """The chunk of `token` ended: its seconds beside each neighbour version (`beside`)."""
        with self._lock:
            started = self._running.pop(token)
            own = Interval(started.version, started.start, self._clock())
            others = [*self._running.values(), *self._ended]
            self._ended.append(own)
        clipped = [Interval(o.version, o.start, min(o.end, own.end)) for o in others]
        return beside(own, clipped)
