"""Stopping ONNX Runtime runs that pass `scheduler.run_time_limit`.

A Python exception cannot interrupt a running `session.run`, but ONNX Runtime's `RunOptions` can:
setting `terminate` on the options a run was started with, from any thread, makes that run stop at
its next node and raise. So every run gets its own options (`watch`), and one thread per worker
process sets the flag on the runs past the limit. The run then fails as `run_timeout`, which the
retry matrix retries with its backoff (`runtime.run_session` translates the error). Registering a
run costs a lock and a dict entry; the thread starts with the first run and sleeps between checks.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import onnxruntime as ort

log = logging.getLogger(__name__)

CHECKS_PER_LIMIT = 10
"""How often, per limit, the thread looks: a run is stopped within a tenth of the limit past it."""
MAX_CHECK_SECONDS = 1.0


@dataclass
class RunWatch:
    """One run under a time limit: its options, and whether the limit stopped it."""

    limit_seconds: float
    started: float = field(default_factory=time.monotonic)
    options: ort.RunOptions = field(default_factory=ort.RunOptions)
    timed_out: bool = False
    """Set (with `options.terminate`) once the run passed its limit."""


class RunLimits:
    """The runs of one worker process under `limit_seconds` (0: no limit, and no thread)."""

    def __init__(self, limit_seconds: float) -> None:
        self.limit_seconds = limit_seconds
        self._runs: dict[int, RunWatch] = {}
        self._numbers = itertools.count()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watch(self) -> Iterator[RunWatch | None]:
        """A run's watch for the duration of the block (None without a limit): pass its `options` to
        `session.run`, and read `timed_out` when the run failed."""
        if not self.limit_seconds:
            yield None
            return
        run, number = RunWatch(self.limit_seconds), next(self._numbers)
        with self._lock:
            self._runs[number] = run
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="sits-run-limits", daemon=True)
                self._thread.start()
        try:
            yield run
        finally:
            with self._lock:
                del self._runs[number]

    def stop_overdue(self, now: float) -> int:
        """Set the terminate flag of every run past its limit at `now` (monotonic); how many were stopped."""
        with self._lock:
            overdue = [run for run in self._runs.values()
                       if not run.timed_out and now - run.started > run.limit_seconds]
            for run in overdue:
                run.timed_out = True
                run.options.terminate = True
        for run in overdue:
            log.warning("a run passed scheduler.run_time_limit (%gs): stopping it", run.limit_seconds)
        return len(overdue)

    def _loop(self) -> None:
        interval = min(self.limit_seconds / CHECKS_PER_LIMIT, MAX_CHECK_SECONDS)
        while True:
            time.sleep(interval)
            try:
                self.stop_overdue(time.monotonic())
            except Exception as err:  # (never let the thread die: later runs would go unwatched)
                log.warning("run limits: %s", err)
