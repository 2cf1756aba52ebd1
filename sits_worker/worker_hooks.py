"""The worker process's Celery signal hooks: refuse an unusable device, start and stop the threads.

Celery imports this module with the tasks (the app's `include`), before `worker_init` fires. A
ready worker runs three threads beside its pool: the heartbeat (`sits_worker/upkeep/heartbeat.py`), the
reaper (`sits_worker/upkeep/reaper.py`) and the memory watch (`sits_worker/device/memory_watch.py`). At shutdown
the pending chunk commits get a bounded wait, so their chunks are acked rather than run again.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from celery import signals

from broker.errors import ConfigError
from broker.queueing import workers
from broker.state.startup_heap import freeze_startup_heap
from broker.tracing.sdk import start_tracing
from sits_worker.device.pinning import gpu_problem
from sits_worker.device.worker_settings import DEVICE_VARIABLE, device_text, worker_device
from sits_worker.serving.context import existing_worker_context, worker_context
from sits_worker.tasks import send_drain
from sits_worker.upkeep.heartbeat import Heartbeat, flush_batch_sizes
from sits_worker.upkeep.reaper import Reaper, worker_reaper

log = logging.getLogger(__name__)

_COMMIT_WAIT_SECONDS = 10.0
"""How long shutdown waits for pending chunk commits: within `sitsctl`'s 15 s before SIGKILL."""

_heartbeat: Heartbeat | None = None
_reaper: Reaper | None = None
"""This process's threads, once the worker is ready."""


@signals.worker_init.connect
def _refuse_an_unusable_device(**_: Any) -> None:
    """Stop a worker pinned (SITS_WORKER_DEVICE) to a GPU it cannot use, before it takes any work: it
    would run on the CPU while its heartbeat reports the GPU. SystemExit passes through Celery's signal
    dispatch, which logs and swallows ordinary exceptions."""
    text = device_text()
    try:
        problem = gpu_problem(worker_device())
    except ConfigError as err:
        problem = str(err)
    if problem:
        raise SystemExit(f"error: cannot pin this worker to {text}: {problem}; start it with `sitsctl worker --cpu` "
                         f"({DEVICE_VARIABLE}=cpu) or on a machine with that GPU")


@signals.worker_init.connect
def _start_tracing(**_: Any) -> None:
    """Trace this worker when the OTEL_* variables ask for it (docs/tracing.md), Celery's task spans with
    SITS's own: a drain task's span is the parent of the batches it runs. A worker asked to trace that
    cannot (the extra or an exporter not installed) stops here, as for an unusable device."""
    try:
        if start_tracing("sits-worker", os.environ):
            from opentelemetry.instrumentation.celery import CeleryInstrumentor

            CeleryInstrumentor().instrument()
    except ConfigError as err:
        raise SystemExit(f"error: {err.message}") from None


def _celery_name(sender: Any) -> str | None:
    return getattr(sender, "hostname", None)


@signals.worker_ready.connect
def _start_heartbeat(sender: Any = None, **_: Any) -> None:
    global _heartbeat
    ctx = worker_context()
    ctx.name = _celery_name(sender) or ctx.name  # chunks acked here are counted under the name Flower shows
    _heartbeat = Heartbeat(ctx, ctx.name)
    _heartbeat.start()


@signals.worker_ready.connect
def _start_memory_watch(**_: Any) -> None:
    """Watch the device memory, stepping lower priority classes down while it jitters
    (`sits_worker/device/memory_watch.py`)."""
    worker_context().memory_watch.start()


@signals.worker_ready.connect
def _start_reaper(sender: Any = None, **_: Any) -> None:
    """Run reaper passes on a thread of this process, never on a stream slot (sits_worker/upkeep/reaper.py)."""
    global _reaper
    ctx = worker_context()
    _reaper = worker_reaper(ctx, send_drain, holder=_celery_name(sender) or ctx.name)
    _reaper.start()


@signals.worker_ready.connect
def _freeze_startup_heap(**_: Any) -> None:
    """Keep what the worker made while it started out of Python's full collections (`broker/state/startup_heap.py`).
    Connected after the threads' hooks, so it runs once they are up."""
    frozen = freeze_startup_heap()
    log.info("froze %d objects made at start-up (out of full garbage collections)", frozen)


@signals.worker_shutting_down.connect
def _stop_leasing(**_: Any) -> None:
    """Warm shutdown (SIGTERM) began: Celery takes no new task and waits for the running ones, so the
    drain loops must end soon. They lease nothing more, finish the batch they run and re-send their
    tickets to the fleet; the pending commits are waited for at `worker_shutdown`."""
    ctx = existing_worker_context()
    if ctx is not None:
        ctx.stopping.set()
        log.info("warm shutdown: leasing stopped; finishing the batches running")


@signals.worker_shutdown.connect
def _stop_reaper(**_: Any) -> None:
    if _reaper is not None and not _reaper.stop(timeout=2.0):
        log.warning("the reaper thread was still in a pass at shutdown")


@signals.worker_shutdown.connect
def _stop_memory_watch(**_: Any) -> None:
    ctx = existing_worker_context()
    if ctx is not None:
        ctx.memory_watch.stop()


@signals.worker_shutdown.connect
def _stop_heartbeat(sender: Any = None, **_: Any) -> None:
    if _heartbeat is not None:
        _heartbeat.stop()
    try:
        _wait_for_commits()
        flush_batch_sizes(worker_context())  # (the last runs' sizes, counted since the last beat)
        workers.remove_worker(worker_context().store, _celery_name(sender) or "")
    except Exception as err:
        log.warning("could not deregister the worker: %s", err)


@signals.worker_process_shutdown.connect
def _finish_commits(**_: Any) -> None:
    """A prefork child leaves through `os._exit`: its pending commits would be dropped (and their
    chunks run again) without this wait."""
    try:
        _wait_for_commits()
    except Exception as err:
        log.warning("could not finish the pending chunk commits: %s", err)


def _wait_for_commits() -> None:
    """Let this process's pending chunk commits finish (chunks computed, not yet acked)."""
    ctx = existing_worker_context()
    if ctx is not None and not ctx.commits.wait(timeout=_COMMIT_WAIT_SECONDS):
        log.warning("chunk commits still pending at shutdown; their chunks run again once their leases expire")
