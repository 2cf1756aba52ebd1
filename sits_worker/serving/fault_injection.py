"""The faults a worker injects into its own work when `faults.enabled` (tests and benchmarks).

Each fault raises the error its real counterpart becomes, where that would arise: an injected
out-of-memory is the `DeviceOutOfMemory` that ONNX Runtime's allocation failure is translated to,
raised in `WorkerContext.run` on the device session only (so halving and `cpu-offload-on-oom`
apply as to a real one); a failing row is the `BadInput` of a run ONNX Runtime refused; a Redis
drop closes the thread's real connection and makes its next calls fail to connect
(`Store.drop_connection`). The decisions are `broker/failures/faults.py`'s, drawn from one random generator
seeded by `faults.seed`. A worker whose name `faults.workers` does not match injects none.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from broker.errors import BadInput, DeviceOutOfMemory, InferenceTimeout, InvalidModel, SitsError, StorageUnavailable
from broker.failures import faults as decide
from broker.failures.settings import FaultSettings
from broker.state.store import Store

log = logging.getLogger(__name__)

INJECTED_ERRORS: dict[str, type[SitsError]] = {
    "transient": StorageUnavailable,
    "device_oom": DeviceOutOfMemory,
    "run_timeout": InferenceTimeout,
    "bad_input": BadInput,
    "invalid_model": InvalidModel,
}
"""The error each injectable failure class raises (the one a real failure of that class becomes)."""


class FaultInjector:
    """One worker process's injected faults; shared by its threads."""

    def __init__(self, faults: FaultSettings, store: Store, rng: random.Random | None = None,
                 worker: Callable[[], str] = lambda: "") -> None:
        self.faults = faults
        self._store = store
        self._rng = rng or random.Random(faults.seed)
        self._lock = threading.Lock()
        self._worker = worker
        """This worker's name (the Celery name it takes once ready), matched against `faults.workers`."""
        self._first_model_failure: float | None = None
        self._first_memory_reading: float | None = None
        self._memory_readings = 0
        log.warning("fault injection is on: %s", faults.model_dump(exclude_defaults=True))

    def _draw(self) -> float:
        with self._lock:
            return self._rng.random()

    def before_run(self, model_ref: str, feed: Mapping[str, np.ndarray]) -> None:
        """Called just before a run of `model_ref`: wait the injected latency, then raise the run's
        injected failure, if any (a failing model's, an out-of-memory, a failing input value)."""
        if not decide.applies_to(self.faults, self._worker()):
            return
        if latency := decide.run_latency(self.faults):
            time.sleep(latency)
        rows = next((int(array.shape[0]) for array in feed.values() if array.ndim), 0)
        now = time.monotonic()
        failure_class = decide.model_fault(self.faults, model_ref, first_failure_at=self._first_model_failure, now=now,
                                           draw=self._draw)
        if failure_class is not None:
            with self._lock:
                self._first_model_failure = self._first_model_failure or now
            which = (f"{self.faults.fail_models_share:g} of the runs of {model_ref} fail"
                     if self.faults.fail_models_share else f"every run of {model_ref} fails")
            raise INJECTED_ERRORS[failure_class](f"injected fault: {which} ({failure_class}, faults.fail_models)")
        why = decide.oom_fault(self.faults, rows, self._draw)
        if why is not None:
            raise DeviceOutOfMemory(f"device out of memory running a batch of {rows} rows (injected fault: {why})")
        value = decide.failing_value(self.faults, feed)
        if value is not None:
            raise BadInput(f"ONNX Runtime rejected the batch: injected fault: an input holds {value:g} "
                           "(faults.fail_values)")

    def check_rows(self, row_indices: Iterable[int]) -> None:
        """Called before a job's mini-batch of `row_indices` runs: BadInput naming its failing rows."""
        if not decide.applies_to(self.faults, self._worker()):
            return
        failing = decide.failing_rows(self.faults, row_indices)
        if failing:
            raise BadInput(f"ONNX Runtime rejected the batch: injected fault: rows {failing} fail (faults.fail_rows)")

    def after_run(self) -> None:
        """Called after a run: drop this thread's Redis connection when one is due."""
        if decide.applies_to(self.faults, self._worker()) and decide.redis_drop_due(self.faults, self._draw):
            self._store.drop_connection(self.faults.redis_drop_calls)

    def memory_reading(self, real: Callable[[], int]) -> int:
        """The worker's memory reading in bytes: `real()`, or the injected `memory_reading` instead, plus
        the injected jitter of this reading."""
        if not decide.applies_to(self.faults, self._worker()):
            return real()
        now = time.monotonic()
        with self._lock:
            self._first_memory_reading = self._first_memory_reading if self._first_memory_reading is not None else now
            reading, self._memory_readings = self._memory_readings, self._memory_readings + 1
        base = self.faults.memory_reading or real()
        return base + decide.memory_jitter_offset(self.faults, reading=reading,
                                                  since_first=now - self._first_memory_reading)
