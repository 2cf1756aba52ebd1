"""The liveness probe of a worker's container: a worker named for this host beat within the timeout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable

from broker.queueing import workers
from broker.state.embedded import EmbeddedRedis
from broker.state.store import Store
from sits_worker.upkeep.liveness import alive_here


def test_only_a_fresh_heartbeat_of_a_worker_of_this_host_counts(store: Store) -> None:
    now = time.time()
    workers.record_heartbeat(store, "sits-cpu-1@host-a", {"streams": 1}, now=now - 3)
    workers.record_heartbeat(store, "sits-cpu-2@host-a", {"streams": 1}, now=now - 60)  # silent: dead or frozen
    workers.record_heartbeat(store, "sits-cpu-3@host-ab", {"streams": 1}, now=now)  # another host

    assert alive_here(store, "host-a", now=now, timeout=15) == ["sits-cpu-1@host-a"]
    assert alive_here(store, "host-b", now=now, timeout=15) == []


def prober(module: str, redis_server: EmbeddedRedis, store: Store) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Runs `python -m <module>` as a container's healthcheck does, against the test's Redis."""
    environ = os.environ | {"SITS_REDIS_URL": redis_server.url, "SITS_REDIS__KEY_PREFIX": store.keys.prefix}
    environ.pop("SITS_CONFIG", None)

    def probe(**more: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", module], env=environ | more,
                              capture_output=True, text=True, timeout=60, check=False)

    return probe


def test_the_probe_exits_0_for_a_live_worker_1_for_none_and_2_without_redis(
        redis_server: EmbeddedRedis, store: Store) -> None:
    probe = prober("sits_worker.upkeep.liveness", redis_server, store)

    assert probe().returncode == 1
    workers.record_heartbeat(store, f"sits-cpu-9@{socket.gethostname()}", {"streams": 1}, now=time.time())
    alive = probe()
    assert alive.returncode == 0 and "sits-cpu-9" in alive.stdout
    away = probe(SITS_REDIS_URL="redis://127.0.0.1:1/0")
    assert away.returncode == 2 and "cannot tell" in away.stderr


def test_the_beat_probe_exits_0_while_a_beat_holds_its_turn_1_without_and_2_without_redis(
        redis_server: EmbeddedRedis, store: Store) -> None:
    probe = prober("sits_worker.beat.liveness", redis_server, store)

    assert probe().returncode == 1
    store.client.set(store.keys.beat_turn, "beat-1", px=30_000)  # as a beat's pass takes its turn
    alive = probe()
    assert alive.returncode == 0, alive.stderr
    away = probe(SITS_REDIS_URL="redis://127.0.0.1:1/0")
    assert away.returncode == 2 and "cannot tell" in away.stderr
