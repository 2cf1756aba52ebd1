"""What the batching controller reads: each answered request's latency, kept a while per model version.

A worker notes the requests of a batch it completed, for the models whose batching the controller steers
(`closed_loop`), in one pipelined call after the completion: when it answered, how long the request took
from submit to answer, and its batch's rows. The list is capped (`KEPT`), so a model's entries cost a
bounded amount of Redis whatever its rate. The controller reads the entries of its last window, and from
them the P99 its clients saw, the answers a second and the mean batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from broker.state.store import Store, translate_redis_errors

KEPT = 20_000
"""The most entries kept per model version: about 10 s at 2,000 requests a second."""


@dataclass(frozen=True)
class Answered:
    """A model's requests answered in a window."""

    latencies: tuple[float, ...]
    """Seconds from submit to answer."""
    batches: float
    """How many batches they ran in (each request counts 1 / its batch's rows)."""

    def p99(self) -> float | None:
        """The 99th percentile latency, None without an answer."""
        return float(np.percentile(self.latencies, 99)) if self.latencies else None

    @property
    def mean_batch_rows(self) -> float:
        """The mean rows of the batches they ran in (0 when none)."""
        return len(self.latencies) / self.batches if self.batches else 0.0


def note_answers(store: Store, model_ref: str, latencies: Sequence[float], batch_rows: int, *, now: float) -> None:
    """Keep the latencies of one batch's answered requests (at `now`) for the controller."""
    if not latencies:
        return
    key = store.keys.answered_latencies(model_ref)
    entries = [f"{now:.4f} {latency:.5f} {batch_rows}" for latency in latencies]
    with translate_redis_errors():
        pipe = store.client.pipeline(transaction=False)
        pipe.lpush(key, *entries)
        pipe.ltrim(key, 0, KEPT - 1)
        pipe.execute()


def read_window(store: Store, model_ref: str, *, since: float, until: float) -> Answered:
    """The requests of `model_ref` answered in (`since`, `until`]."""
    with translate_redis_errors():
        raw = store.client.lrange(store.keys.answered_latencies(model_ref), 0, KEPT - 1)
    latencies: list[float] = []
    batches = 0.0
    for entry in raw:  # (newest first: stop at the first one before the window)
        try:
            at, latency, rows = entry.split()
            answered_at = float(at)
        except ValueError:
            continue
        if answered_at <= since:
            break
        if answered_at <= until:
            latencies.append(float(latency))
            batches += 1 / max(int(rows), 1)
    return Answered(tuple(latencies), batches)
