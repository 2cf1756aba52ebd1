"""The Celery app of SITS and its configuration.

`celery -A sits_worker worker` works as well as `sitsctl worker`: the app is
configured lazily (on first use, not at import) from `load_settings()`, so
the same `SITS_*` variables and `sits-config.yaml` apply. Settings keep
every item once (a lost worker loses nothing): late acks, requeue on a lost worker, prefetch 1, cancel on
connection loss, events on for Flower; a threads pool of
`max_concurrent_streams` threads sharing one ONNX Runtime session per model.
A process without a Redis URL stops with an error instead of falling back to
Celery's default broker (amqp://localhost). The app includes the tasks
(`sits_worker/tasks.py`) and the worker's signal hooks (`sits_worker/worker_hooks.py`:
the device check, the heartbeat and reaper threads, shutdown); this module imports
neither, so nothing here imports back into it. Its beat runs SITS's own scheduler
(`celery -A sits_worker beat -S sits_worker.beat.scheduler:SlotScheduler`, `sits_worker/beat/`).
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from broker.config.loading import load_settings
from broker.config.settings import Settings
from broker.errors import ConfigError
from broker.state.sentinel import celery_broker


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


app = _SitsCelery("sits", include=["sits_worker.tasks", "sits_worker.worker_hooks"])


def celery_config(settings: Settings) -> dict[str, Any]:
    """Celery settings derived from SITS settings (a Sentinel `redis.url` as kombu takes it: `celery_broker`)."""
    broker_url, transport_options = celery_broker(settings.redis.url, settings.redis.sentinel_master,
                                                  sentinel_auth=settings.redis.sentinel_auth)
    return {
        "broker_url": broker_url,
        "broker_connection_retry_on_startup": True,
        # an error reply to the consumer (NOREPLICAS from a primary short of replicas, a script's READONLY
        # on a demoted one) reconnects it, as a lost connection does, instead of stopping the worker
        "broker_channel_error_retry": True,
        "broker_transport_options": {"visibility_timeout": 3600, **transport_options},
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
