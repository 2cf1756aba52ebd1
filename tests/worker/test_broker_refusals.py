"""A real Celery worker (a subprocess) rides out a Redis that refuses its writes for a while: NOREPLICAS, as a
primary with `min-replicas-to-write` answers between a failover and its new replica's sync. Its consumer's
pops are refused too, an error reply rather than a lost connection: it reconnects instead of stopping."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
from celery import Celery

from broker.queueing import workers
from broker.state.embedded import EmbeddedRedis
from broker.state.store import Store
from sits_api.cli.processes import Child, stop_process
from sits_api.cli.stack import worker_command
from tests.waiting import eventually


@pytest.mark.slow
def test_a_worker_goes_on_after_redis_refused_its_writes_for_want_of_replicas(tmp_path: Path) -> None:
    redis_server = EmbeddedRedis(tmp_path / "redis", appendonly=False).start()
    store = Store.connect(redis_server.url)
    argv, extra = worker_command("cpu", 1, "refused@%h", "sits")
    env = {**os.environ, **extra, "SITS_REDIS_URL": redis_server.url, "SITS_HOME": str(tmp_path / "home"),
           "PYTHONUNBUFFERED": "1"}
    env.pop("SITS_CONFIG", None)
    worker = Child.start("worker", [sys.executable, *argv[1:]], env, tmp_path / "worker.log")
    try:
        assert eventually(lambda: any(w["alive"] for w in workers.list_workers(store, now=time.time(), timeout=5)),
                          timeout=90, interval=0.1), worker.log_tail()
        store.client.config_set("min-replicas-to-write", 1)  # every write refused: NOREPLICAS
        time.sleep(3.0)  # (its consumer pops, and is refused, at least once a second)
        store.client.config_set("min-replicas-to-write", 0)
        assert worker.process.poll() is None, worker.log_tail()
        assert "NOREPLICAS" in worker.log_path.read_text(errors="replace")  # (it was refused)

        # its consumer takes tasks again: a drain task of an unknown ticket is taken off the queue (and ends)
        sender = Celery("test", broker=redis_server.url)
        sender.send_task("sits.drain", args=["t-unknown"], queue="sits")
        assert eventually(lambda: store.client.llen("sits") == 0, timeout=30, interval=0.1), worker.log_tail()
        assert worker.process.poll() is None, worker.log_tail()
    finally:
        stop_process(worker.process)
        redis_server.stop()
