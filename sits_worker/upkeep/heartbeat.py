"""The worker's heartbeat: every two seconds, what this process is and holds, into Redis.

`sitsctl status`, `/v1/status`, `/metrics` and the v2 readiness read the heartbeats
(`broker/queueing/workers.py`); the same loop writes the latency profiles this process observed
(`sits_worker/device/observed_profiles.py`) and the sizes of the runs it made since the last beat
(`broker/monitoring/batch_sizes.py`). It runs on a thread of its own beside the pool, so a busy
stream slot never delays it, and a Redis that is away only costs a logged warning per beat.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from broker.queueing import workers
from sits_worker.device.pinning import gpu_reading
from sits_worker.serving.context import WorkerContext

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_SECONDS = 2.0
"""Well inside `scheduler.worker_heartbeat_timeout` (15 s by default), so a missed beat or two is no death."""


class Heartbeat:
    """The heartbeat thread of one worker process, named `worker_name` (the Celery name Flower shows)."""

    def __init__(self, ctx: WorkerContext, worker_name: str, interval: float = HEARTBEAT_INTERVAL_SECONDS) -> None:
        self.ctx = ctx
        self.worker_name = worker_name
        self.interval = interval
        self._stop = threading.Event()
        self._info: dict[str, Any] = {"device": str(ctx.device), "streams": ctx.streams, "pid": os.getpid(),
                                      "celery_name": worker_name}

    def beat_once(self, now: float) -> None:
        """Record one heartbeat and flush the observed profiles, the runs' sizes and the tenants' bills; log,
        never raise, when Redis is away."""
        ctx = self.ctx
        try:
            self._info["models_loaded"] = ctx.sessions.loaded()
            self._info["memory"] = ctx.ledger.stats()
            self._info["commits_pending"] = ctx.commits.pending()
            self._info["degrade"] = ctx.memory_watch.info()
            self._info["oom"] = ctx.oom_info()
            gpu = gpu_reading(ctx.device)
            if gpu is not None:  # (a CPU worker's heartbeat has none: its sits_gpu_* series are absent, not 0)
                self._info["gpu"] = gpu
            workers.record_heartbeat(ctx.store, self.worker_name, self._info, now=now)
        except Exception as err:  # Redis down: keep trying, the worker itself stays up
            log.warning("heartbeat failed: %s", err)
        try:
            ctx.observed.flush(ctx.store, worker=self.worker_name, device=str(ctx.device))
        except Exception as err:
            log.warning("could not write the observed profiles: %s", err)
        flush_batch_sizes(ctx)
        ctx.usage.flush()  # (bills an idle worker's last runs; logs, never raises)

    def start(self) -> None:
        """Beat on a daemon thread until `stop`."""
        def loop() -> None:
            while not self._stop.is_set():
                self.beat_once(time.time())
                self._stop.wait(self.interval)

        threading.Thread(target=loop, name="sits-heartbeat", daemon=True).start()

    def stop(self) -> None:
        """End the loop after its current beat."""
        self._stop.set()


def flush_batch_sizes(ctx: WorkerContext) -> None:
    """Add the sizes of the runs counted since the last flush to Redis (kept for the next one, and logged,
    when Redis cannot take them)."""
    try:
        ctx.batch_sizes.flush(ctx.store, ctx.store.keys.batch_sizes)
    except Exception as err:
        log.warning("could not add the runs' sizes to Redis (kept for the next beat): %s", err)
