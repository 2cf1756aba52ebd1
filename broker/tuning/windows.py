"""What the tuning loops read: each answered request's latency, class and deadline, kept a while per model.

A worker notes the requests of a batch it completed, for the models whose batching the controller steers
(`closed_loop`) and for every model while the weight learner runs, in one pipelined call after the
completion: when it answered, how long the request took from submit to answer ('-' for one that failed),
its batch's rows, the priority class it was submitted at (`sla_metrics.priority_class`) and whether it met
its deadline ('m'), missed it ('x') or had none ('-'). The list is capped (`KEPT`), so a model's entries
cost a bounded amount of Redis whatever its rate. A loop reads the entries of its last window.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from broker.state.store import Store, translate_redis_errors

KEPT = 20_000
"""The most entries kept per model version: about 10 s at 2,000 requests a second."""
MET, MISSED, NO_DEADLINE = "m", "x", "-"


@dataclass(frozen=True)
class Note:
    """One request a worker completed."""

    latency: float | None
    """Seconds from submit to answer; None for one that failed."""
    priority_class: str = "normal"
    deadline: str = NO_DEADLINE
    """`MET`, `MISSED` or `NO_DEADLINE`."""


@dataclass
class ClassTally:
    """One priority class's requests in a window."""

    latencies: list[float] = field(default_factory=list)
    failed: int = 0
    met: int = 0
    missed: int = 0

    def p99(self) -> float | None:
        """The 99th percentile latency of those answered, None without any."""
        return float(np.percentile(self.latencies, 99)) if self.latencies else None


@dataclass(frozen=True)
class Answered:
    """A model's requests answered in a window."""

    latencies: tuple[float, ...]
    """Seconds from submit to answer, of those answered with outputs."""
    batches: float
    """How many batches they ran in (each request counts 1 / its batch's rows)."""
    by_class: dict[str, ClassTally] = field(default_factory=dict)

    def p99(self) -> float | None:
        """The 99th percentile latency, None without an answer."""
        return float(np.percentile(self.latencies, 99)) if self.latencies else None

    @property
    def mean_batch_rows(self) -> float:
        """The mean rows of the batches they ran in (0 when none)."""
        return len(self.latencies) / self.batches if self.batches else 0.0


def note_answers(store: Store, model_ref: str, latencies: Sequence[float | Note], batch_rows: int, *,
                 now: float) -> None:
    """Keep one batch's completed requests (at `now`) for the tuning loops: a latency alone is an answered
    request of the normal class without a deadline."""
    if not latencies:
        return
    notes = [note if isinstance(note, Note) else Note(float(note)) for note in latencies]
    key = store.keys.answered_latencies(model_ref)
    entries = [f"{now:.4f} {'-' if n.latency is None else f'{n.latency:.5f}'} {batch_rows} {n.priority_class} "
               f"{n.deadline}" for n in notes]
    with translate_redis_errors():
        pipe = store.client.pipeline(transaction=False)
        pipe.lpush(key, *entries)
        pipe.ltrim(key, 0, KEPT - 1)
        pipe.execute()


def read_window(store: Store, model_ref: str, *, since: float, until: float) -> Answered:
    """The requests of `model_ref` completed in (`since`, `until`]."""
    with translate_redis_errors():
        raw = store.client.lrange(store.keys.answered_latencies(model_ref), 0, KEPT - 1)
    return _tally(raw, since=since, until=until)


def read_windows(store: Store, model_refs: Iterable[str], *, since: float, until: float) -> Answered:
    """The requests of all `model_refs` completed in (`since`, `until`], together (one round trip)."""
    refs = list(model_refs)
    with translate_redis_errors():
        pipe = store.client.pipeline(transaction=False)
        for ref in refs:
            pipe.lrange(store.keys.answered_latencies(ref), 0, KEPT - 1)
        lists = pipe.execute() if refs else []
    parts = [_tally(raw, since=since, until=until) for raw in lists]
    by_class: dict[str, ClassTally] = {}
    for part in parts:
        for name, tally in part.by_class.items():
            into = by_class.setdefault(name, ClassTally())
            into.latencies += tally.latencies
            into.failed, into.met, into.missed = into.failed + tally.failed, into.met + tally.met, \
                into.missed + tally.missed
    return Answered(tuple(lat for part in parts for lat in part.latencies), sum(p.batches for p in parts), by_class)


def _tally(raw: Sequence[str], *, since: float, until: float) -> Answered:
    latencies: list[float] = []
    batches = 0.0
    by_class: dict[str, ClassTally] = {}
    for entry in raw:  # (newest first: stop at the first one before the window)
        fields = entry.split()
        try:
            answered_at = float(fields[0])
            rows = max(int(fields[2]), 1)
        except (ValueError, IndexError):
            continue
        if answered_at <= since:
            break
        if answered_at > until:
            continue
        klass = by_class.setdefault(fields[3] if len(fields) > 3 else "normal", ClassTally())
        deadline = fields[4] if len(fields) > 4 else NO_DEADLINE
        klass.met += deadline == MET
        klass.missed += deadline == MISSED
        if fields[1] == "-":
            klass.failed += 1
            continue
        latency = float(fields[1])
        latencies.append(latency)
        klass.latencies.append(latency)
        batches += 1 / rows
    return Answered(tuple(latencies), batches, by_class)
