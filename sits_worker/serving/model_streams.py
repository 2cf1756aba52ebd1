"""How many of this worker's stream slots run each model's batches now, for a model's `streams` cap.

A model whose batching sets `streams` (Triton's `instance_group` count, or what a tuning sweep tries)
is served by at most that many slots of a worker at once. A slot takes one of the model's streams before
it leases (`try_enter`) and gives it back when the batch ends, or at once when the lease found nothing;
the drain loop leaves a model at its cap out of a look (`drain_loop._without_capped_models`), so the slot
serves other models or waits, and the slots that run the model lease its next batches as they end.
"""

from __future__ import annotations

import collections
import threading


class ModelStreams:
    """Running batches per model version on this worker; safe to use from the stream slots' threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: collections.Counter[str] = collections.Counter()

    def try_enter(self, model_ref: str, streams: int | None) -> bool:
        """Count one more batch of `model_ref` as running, unless it runs on `streams` slots already (None: no
        cap; 0: none may run it); whether it was counted. The check and the count are one step, so two
        slots never both take the last stream."""
        with self._lock:
            if streams is not None and self._running[model_ref] >= streams:
                return False
            self._running[model_ref] += 1
            return True

    def leave(self, model_ref: str) -> None:
        """A batch counted by `try_enter` ended (or none was leased after all)."""
        with self._lock:
            self._running[model_ref] -= 1
            if self._running[model_ref] <= 0:
                del self._running[model_ref]

    def at_cap(self, model_ref: str, streams: int | None) -> bool:
        """Whether `model_ref` runs on `streams` slots already (None: no cap; 0: none may run it)."""
        if streams is None:
            return False
        with self._lock:
            return self._running[model_ref] >= streams
