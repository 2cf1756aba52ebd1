"""A worker's watch over its device memory, and the degrade step its leases follow.

A thread reads the memory every `degrade.sample_interval` (`WorkerContext.memory_reading`: NVML on
a GPU, the process's resident memory on a CPU, the injected faults on top), keeps the readings of
the last `degrade.window`, and moves the worker's step as `broker/failures/degrade.py` decides. The leases
read the step on every call (`lease_classes`, `lowest_level`); the heartbeat carries `info()` to
`/v1/status` and `/metrics`. Every change of step is logged.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from broker.config.settings import Settings
from broker.failures import degrade
from broker.queueing import policy
from broker.state.store import Store

log = logging.getLogger(__name__)

CHANGES_KEPT = 10
"""How many of the latest step changes `info()` lists."""

CLASSES_WINDOW = 1024
"""The most waiting items a degraded worker's lease weighs (`fair_share.window` when smaller): every lease
that finds nothing to serve reads them all, so a long paused queue must not cost a long scan each time.
The requests behind the window are weighed anyway (`lease_batch.lua`)."""


class MemoryWatch:
    """The memory readings and degrade step of one worker process; shared by its threads."""

    def __init__(self, settings: Settings, store: Store, read: Callable[[], int], capacity_bytes: int) -> None:
        self.settings = settings.degrade
        self._store = store
        self._default_ordering = policy.default_ordering(settings.scheduler.policy)
        self._window_items = min(settings.fair_share.window, CLASSES_WINDOW)
        self._ordering = self._default_ordering  # the last ordering read (kept when a read fails)
        self._read = read
        self.capacity_bytes = self.settings.memory_limit or capacity_bytes
        self._readings: collections.deque[degrade.Reading] = collections.deque()
        self._state = degrade.DegradeState()
        self._classes: dict[str, Any] | None = None
        self._changes: collections.deque[dict[str, Any]] = collections.deque(maxlen=CHANGES_KEPT)
        self._steps_taken = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()

    @property
    def step(self) -> int:
        """The worker's degrade step now (`broker.failures.degrade.NORMAL` when watching is off)."""
        return self._state.step

    def lease_classes(self) -> dict[str, Any] | None:
        """The `classes` option of this worker's leases (None: serve every class as usual)."""
        return self._classes

    def lowest_level(self) -> int:
        """The lowest priority level this worker leases now."""
        return degrade.lowest_leased_level(self._state.step, self.settings)

    def sample(self, now: float) -> degrade.DegradeState:
        """Read the memory once at `now` and move the step as the readings of the window say."""
        reading = degrade.Reading(now, self._read())
        with self._lock:
            self._readings.append(reading)
            while self._readings and now - self._readings[0].at > self.settings.window:
                self._readings.popleft()
            jitter = degrade.memory_jitter(self._readings, self.capacity_bytes)
            before = self._state
            self._state = degrade.next_state(before, jitter, now=now, settings=self.settings)
            changed = self._state.step != before.step
            if changed:
                self._steps_taken += 1
                self._changes.append({"at": now, "step": self._state.step, "name": self._state.name,
                                      "jitter": round(jitter, 4)})
            state = self._state
        if changed:
            self._log_change(before.step, jitter)
        if state.step > degrade.NORMAL:
            try:  # (read each time: PUT /v1/policy may change the ordering)
                _, self._ordering = policy.get_policy(self._store, default=self._default_ordering)
            except Exception as err:  # (a Redis blip: the step must still reach the leases)
                log.warning("memory watch: could not read the ordering, keeping %s: %s", self._ordering, err)
        with self._lock:
            if self._state is state:  # (not moved by another sample meanwhile)
                self._classes = degrade.lease_classes(state.step, self.settings, self._ordering, self._window_items)
        return state

    def _log_change(self, before: int, jitter: float) -> None:
        state, threshold = self._state, self.settings.jitter_threshold
        what = {degrade.NORMAL: "every class served as usual", degrade.P1_AS_P2: "P1 work served as P2",
                degrade.P2_PAUSED: "P1 work served as P2, P2 work paused"}[state.step]
        if state.step > before:
            log.warning("device memory jitters by %.1f%% of %d MiB over %gs (degrade.jitter_threshold %.1f%%): "
                        "step %d, %s", 100 * jitter, self.capacity_bytes >> 20, self.settings.window,
                        100 * threshold, state.step, what)
        else:
            log.warning("device memory calm for %gs (jitter %.1f%%): back to step %d, %s",
                        self.settings.calm_for, 100 * jitter, state.step, what)

    def info(self) -> dict[str, Any]:
        """The step, the last jitter and the latest changes, for the heartbeat."""
        with self._lock:
            state = self._state
            return {"step": state.step, "name": state.name, "jitter": round(state.jitter, 4),
                    "jitter_threshold": self.settings.jitter_threshold, "capacity_bytes": self.capacity_bytes,
                    "since": None if state.changed_at == float("-inf") else state.changed_at,
                    "lowest_level": degrade.lowest_leased_level(state.step, self.settings),
                    "steps_taken": self._steps_taken, "changes": list(self._changes)}

    def start(self) -> None:
        """Sample on a daemon thread until `stop` (nothing when `degrade.enabled` is false)."""
        if not self.settings.enabled:
            return

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.sample(time.time())
                except Exception as err:  # a reading or the policy read failed: keep the step, try again
                    log.warning("memory watch: %s", err)
                self._stop.wait(self.settings.sample_interval)

        threading.Thread(target=loop, name="sits-memory-watch", daemon=True).start()

    def stop(self) -> None:
        """End the loop after its current reading."""
        self._stop.set()
