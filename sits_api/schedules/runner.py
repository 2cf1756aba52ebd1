"""The releasers: `celery -A sits_api.schedules.runner worker` takes the beat's `sits.release_schedule` tasks.

A release is a job's submit, which the API's intake does (`sits_api/intake/services.py`), so its task
runs in a Celery app of the API package, on a queue of its own (`beat.release_queue`): a worker of the
inference fleet never imports the API, and a release never waits behind inference batches. Configured
lazily from `load_settings()`, as the worker's app is; task events on, so Flower shows each release.
The beat's `sits.rescore_queues` runs here too: a pass over the queues (`broker/queueing/re_estimate.py`),
whose report is its result. So does a model's tuning sweep (`sits.tune_model`, `sits_api/tuning/sweep.py`):
its load goes through the intake, as a release's job does. And the batching controller's steps
(`sits.steer_batching`, `broker/tuning/steering.py`) and the weight learner's (`sits.learn_weights`,
`broker/tuning/learning.py`), which the beat sends every `tuning.controller.every` and `tuning.weights.every`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from celery import Celery

from broker.config.loading import load_settings
from broker.config.settings import Settings
from broker.errors import ConfigError
from broker.queueing import policy, re_estimate
from broker.schedules.passes import RELEASE_TASK, RESCORE_TASK
from broker.state.sentinel import celery_broker
from broker.state.store import Store
from broker.tenants.records import TenantTable
from broker.tuning import learning, steering
from broker.tuning.learning import LEARN_TASK
from broker.tuning.steering import STEER_TASK
from sits_api.intake.task_sender import Dispatcher
from sits_api.schedules.release import release_run
from sits_api.tuning.sweep import TUNE_TASK, Caller, TuneAsk, device_kinds, run_tuning


class _ReleaseCelery(Celery):
    """The releasers' Celery app, configured from SITS settings when its configuration is first read."""

    def on_configure(self) -> None:  # type: ignore[override]
        """Stop with an error for a process without a Redis URL (`sits_worker/celery_app.py` says why here)."""
        settings = load_settings()
        if not settings.redis.url:
            raise ConfigError("no Redis to use: set SITS_REDIS_URL (or redis.url in the config) to the Redis of "
                              "the SITS stack")
        broker_url, transport_options = celery_broker(settings.redis.url, settings.redis.sentinel_master,
                                                      sentinel_auth=settings.redis.sentinel_auth)
        self.conf.update({
            "broker_url": broker_url,
            "broker_connection_retry_on_startup": True,
            "broker_channel_error_retry": True,
            "broker_transport_options": {"visibility_timeout": 3600, **transport_options},
            "task_default_queue": settings.beat.queue(settings.redis.key_prefix),
            "task_ignore_result": True,
            "task_acks_late": True,
            "task_reject_on_worker_lost": True,
            "worker_prefetch_multiplier": 1,
            "worker_pool": "threads",
            "worker_concurrency": settings.beat.release_threads,
            "worker_send_task_events": True,
            "task_send_sent_event": True,
            "worker_hijack_root_logger": False,
        })


app = _ReleaseCelery("sits-releases")


@dataclass
class _Releaser:
    settings: Settings
    store: Store
    dispatcher: Dispatcher
    tenants: TenantTable


_made: list[_Releaser] = []
_making = threading.Lock()


def _releaser() -> _Releaser:
    """This process's settings, store and dispatcher, made once and shared by its threads."""
    with _making:
        if not _made:
            settings = load_settings()
            store = Store.of(settings.redis)
            _made.append(_Releaser(settings, store, Dispatcher(settings, store), TenantTable(settings.tenants)))
        return _made[0]


@app.task(name=RELEASE_TASK)
def release_schedule(member: str, slot: int) -> dict[str, Any]:
    """Make the job of one claimed run of a schedule (`release.release_run`); Flower shows what it did."""
    releaser = _releaser()
    return release_run(releaser.settings, releaser.store, releaser.dispatcher, releaser.tenants, member,
                       int(slot)).to_json()


@app.task(name=RESCORE_TASK)
def rescore_queues() -> dict[str, Any]:
    """One re-scoring pass over the queues (`re_estimate.rescore_queues`); Flower shows what it moved."""
    settings = _releaser().settings
    return re_estimate.rescore_queues(
        _releaser().store, now=time.time(), default=policy.default_ordering(settings.scheduler.policy),
        capacity_of=lambda ref: settings.online.batching_for(ref.partition("@")[0]).queue_capacity).to_json()


@app.task(name=TUNE_TASK)
def tune_model(ask: dict[str, Any], caller: dict[str, Any]) -> dict[str, Any]:
    """One tuning sweep (`sweep.run_tuning`); Flower shows the points it chose."""
    releaser = _releaser()
    ended = run_tuning(releaser.settings, releaser.store, TuneAsk.of(ask), Caller(**caller))
    return {"tunings": [{"device_kind": t.device_kind, "status": t.status, "error": t.error,
                         "chosen": t.chosen.to_dict() if t.chosen else None} for t in ended]}


@app.task(name=STEER_TASK)
def steer_batching() -> dict[str, Any]:
    """One step of the batching controller (`steering.steer_batching`); Flower shows the changes it made."""
    releaser = _releaser()
    settings, store = releaser.settings, releaser.store
    now = time.time()
    return steering.steer_batching(store, settings.online, settings.tuning.controller, now=now,
                                   device_kinds=device_kinds(settings, store, now=now)).to_json()


@app.task(name=LEARN_TASK)
def learn_weights() -> dict[str, Any]:
    """One step of the CP-Score weight learner (`learning.learn_weights`); Flower shows the weights it made live."""
    releaser = _releaser()
    settings = releaser.settings
    return learning.learn_weights(releaser.store, settings.tuning.weights, now=time.time(),
                                  default_ordering=policy.default_ordering(settings.scheduler.policy)).to_json()
