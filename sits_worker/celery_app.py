"""The Celery app of SITS: configuration and the signal hooks of a worker process.

`celery -A sits_worker worker` works as well as `sitsctl worker`: the app is
configured lazily (on first use, not at import) from `load_settings()`, so
the same `SITS_*` variables and `sits-config.yaml` apply. Settings follow
CELERY-NOTES.md: late acks, requeue on a lost worker, prefetch 1, cancel on
connection loss, events on for Flower; a threads pool of
`max_concurrent_streams` threads sharing one ONNX Runtime session per model.
A process without a Redis URL stops with an error instead of falling back to
Celery's default broker (amqp://localhost), and a worker pinned to a GPU it
cannot use stops at start. A ready worker runs two threads beside the pool:
the heartbeat and the reaper (`sits_worker/reaper.py`); SITS runs no Celery beat.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from celery import Celery, signals

from broker import workers
from broker.config import Settings, load_settings
from broker.errors import ConfigError

if TYPE_CHECKING:
    from sits_worker.reaper import Reaper

log = logging.getLogger(__name__)

class _SitsCelery(Celery):
    """The Celery app, configured from SITS settings when its configuration is first read."""

    def on_configure(self) -> None:  # type: ignore[override]
        """Celery's pre-4.0 configure hook, kept as a method on purpose: an error raised here stops the
        process, where one raised by an `on_configure` signal receiver is only logged and Celery goes on
        with its defaults (a worker then retries amqp://guest@localhost:5672 for minutes)."""
        settings = load_settings()
        if not settings.redis.url:
            raise ConfigError("no Redis to use: set SITS_REDIS_URL (or redis.url in the config) to the Redis of "
                              "the SITS stack; `sitsctl worker` also finds the one `sitsctl up` runs")
        settings.paths.home.mkdir(parents=True, exist_ok=True)
        self.conf.update(celery_config(settings))


app = _SitsCelery("sits", include=["sits_worker.tasks"])


def celery_config(settings: Settings) -> dict[str, Any]:
    """Celery settings derived from SITS settings."""
    return {
        "broker_url": settings.redis.url,
        "broker_connection_retry_on_startup": True,
        "broker_transport_options": {"visibility_timeout": 3600},
        "task_default_queue": settings.redis.task_queue,
        "task_ignore_result": True,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "worker_cancel_long_running_tasks_on_connection_loss": True,
        "worker_pool": "threads",
        "worker_concurrency": settings.resources.max_concurrent_streams,
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "worker_hijack_root_logger": False,
    }


# --- the device, checked before the worker starts -------------------------------------


@signals.worker_init.connect
def _refuse_an_unusable_device(**_: Any) -> None:
    """Stop a worker pinned (SITS_WORKER_DEVICE) to a GPU it cannot use, before it takes any work: it
    would run on the CPU while its heartbeat reports the GPU. SystemExit passes through Celery's signal
    dispatch, which logs and swallows ordinary exceptions."""
    from sits_worker.devices import Device, gpu_problem

    text = os.environ.get("SITS_WORKER_DEVICE", "auto")
    try:
        problem = gpu_problem(Device.parse(text))
    except ValueError as err:
        problem = str(err)
    if problem:
        raise SystemExit(f"error: cannot pin this worker to {text}: {problem}; start it with `sitsctl worker --cpu` "
                         "(SITS_WORKER_DEVICE=cpu) or on a machine with that GPU")


# --- worker heartbeats -------------------------------------------------------------

_heartbeat_stop = threading.Event()


@signals.worker_ready.connect
def _start_heartbeat(sender: Any = None, **_: Any) -> None:
    from sits_worker.context import worker_context

    ctx = worker_context()
    worker_name = getattr(sender, "hostname", None) or ctx.name
    ctx.name = worker_name  # chunks acked by this process are counted under the Celery name Flower shows
    info = {"device": str(ctx.device), "streams": ctx.streams, "pid": os.getpid(), "celery_name": worker_name}

    def beat() -> None:
        while not _heartbeat_stop.is_set():
            try:
                info["models_loaded"] = ctx.sessions.loaded()
                info["memory"] = ctx.ledger.stats()
                info["commits_pending"] = ctx.commits.pending()
                workers.record_heartbeat(ctx.store, worker_name, info, now=time.time())
            except Exception as err:  # Redis down: keep trying, the worker itself stays up
                log.warning("heartbeat failed: %s", err)
            try:
                ctx.observed.flush(ctx.store, worker=worker_name, device=str(ctx.device))
            except Exception as err:
                log.warning("could not write the observed profiles: %s", err)
            _heartbeat_stop.wait(2.0)

    threading.Thread(target=beat, name="sits-heartbeat", daemon=True).start()


# --- the reaper pass ---------------------------------------------------------------

_reaper: Reaper | None = None
"""This process's reaper thread, once the worker is ready."""


@signals.worker_ready.connect
def _start_reaper(sender: Any = None, **_: Any) -> None:
    """Run reaper passes on a thread of this process, never on a stream slot (sits_worker/reaper.py)."""
    global _reaper
    from sits_worker.context import worker_context
    from sits_worker.reaper import worker_reaper
    from sits_worker.tasks import send_drain

    ctx = worker_context()
    _reaper = worker_reaper(ctx, send_drain, holder=getattr(sender, "hostname", None) or ctx.name)
    _reaper.start()


@signals.worker_shutdown.connect
def _stop_reaper(**_: Any) -> None:
    if _reaper is not None and not _reaper.stop(timeout=2.0):
        log.warning("the reaper thread was still in a pass at shutdown")


@signals.worker_shutdown.connect
def _stop_heartbeat(sender: Any = None, **_: Any) -> None:
    from sits_worker.context import worker_context

    _heartbeat_stop.set()
    try:
        _wait_for_commits()
        workers.remove_worker(worker_context().store, getattr(sender, "hostname", ""))
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


_COMMIT_WAIT_SECONDS = 10.0
"""How long shutdown waits for pending chunk commits: within `sitsctl`'s 15 s before SIGKILL."""


def _wait_for_commits() -> None:
    """Let this process's pending chunk commits finish (chunks computed, not yet acked)."""
    from sits_worker.context import existing_worker_context

    ctx = existing_worker_context()
    if ctx is not None and not ctx.commits.wait(timeout=_COMMIT_WAIT_SECONDS):
        log.warning("chunk commits still pending at shutdown; their chunks run again once their leases expire")
