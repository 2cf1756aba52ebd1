"""`celery -A sits_worker beat -S sits_worker.beat.scheduler:SlotScheduler`: SITS's own beat scheduler.

Celery's beat loop calls `tick()` and sleeps for what it answers. Here a tick is one `BeatPass`: the
schedules live in Redis (not in a file or in Celery's `beat_schedule`), each due slot is claimed there
once (`claim_slot.lua`) and only then sent as a `sits.release_schedule` task to the releasers' queue,
so a second beat, a restart or a message sent twice never makes a second job for one slot. Every
`beat.rescore_every` it also sends a `sits.rescore_queues` task there (docs/scheduling.md, "The beat's
re-scoring"). Why not RedBeat: docs/architecture.md, "The beat".
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import time
from typing import Any

from celery.beat import Scheduler

from broker.config.loading import load_settings
from broker.errors import SitsError
from broker.schedules.passes import RELEASE_TASK, RESCORE_TASK, BeatPass, Periodic
from broker.state.embedded import masked_url
from broker.state.store import Store
from broker.tuning.learning import LEARN_TASK
from broker.tuning.steering import STEER_TASK

log = logging.getLogger(__name__)


class SlotScheduler(Scheduler):
    """Celery beat's scheduler for SITS's schedules: each tick is one pass over Redis (`BeatPass`)."""

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        self._settings = load_settings()
        self._store = Store.of(self._settings.redis)
        self._queue = self._settings.beat.queue(self._settings.redis.key_prefix)
        holder = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        tuning = self._settings.tuning
        steer = Periodic(tuning.controller.every, lambda: self._send_periodic(STEER_TASK, tuning.controller.every))
        learn = Periodic(tuning.weights.every, lambda: self._send_periodic(LEARN_TASK, tuning.weights.every))
        self._pass = BeatPass(self._store, self._settings.beat, holder, self._send, self._send_rescore,
                              periodic=[steer, learn])
        super().__init__(app, *args, **kwargs)

    def setup_schedule(self) -> None:
        """Nothing to load: the schedules are read from Redis at every pass."""

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """One pass; the seconds to sleep before the next. Redis out of reach is logged and tried again."""
        try:
            return self._pass.run(time.time())
        except SitsError as err:
            log.warning("beat pass failed (%s); trying again in %gs", err.message, self._settings.beat.tick)
        except Exception:  # a bug must not stop the beat: the next pass tries again
            log.exception("beat pass failed; trying again in %gs", self._settings.beat.tick)
        return self._settings.beat.tick

    def _send(self, member: str, slot: int) -> None:
        """Publish one release to the releasers. A message that cannot be sent is left to a later pass:
        its run stays claimed, and is sent again after `beat.release_timeout`."""
        try:
            self.app.send_task(RELEASE_TASK, args=[member, slot], queue=self._queue)
        except Exception as err:  # kombu's OperationalError and the like: Redis away or full
            log.warning("release of %s at %d not sent (%s); sent again within beat.release_timeout", member,
                        slot, err)

    def _send_rescore(self) -> None:
        """Publish one re-scoring pass to the releasers, dropped unrun once the next is due (releasers that
        were away do not run a backlog of them). One that cannot be sent is logged: the next period sends
        another."""
        try:
            self.app.send_task(RESCORE_TASK, queue=self._queue, expires=self._settings.beat.rescore_every)
        except Exception as err:  # kombu's OperationalError and the like: Redis away or full
            log.warning("re-scoring not sent (%s); the next is sent in %gs", err, self._settings.beat.rescore_every)

    def _send_periodic(self, task: str, every: float) -> None:
        """Publish one step of a tuning loop to the releasers (the batching controller's, `sits.steer_batching`;
        the weight learner's, `sits.learn_weights`), dropped unrun once the next is due."""
        try:
            self.app.send_task(task, queue=self._queue, expires=every)
        except Exception as err:  # kombu's OperationalError and the like: Redis away or full
            log.warning("%s not sent (%s); the next is sent in %gs", task, err, every)

    def should_sync(self) -> bool:
        return False

    def close(self) -> None:
        """Hand the beat's turn over at once, so a waiting beat takes over without waiting for it to lapse."""
        with contextlib.suppress(SitsError):
            self._pass.give_up_turn()
        super().close()

    @property
    def info(self) -> str:
        return (f"    . schedules -> Redis {masked_url(self._settings.redis.url)}, releases and re-scoring "
                f"(every {self._settings.beat.rescore_every:g}s) -> queue {self._queue}")
