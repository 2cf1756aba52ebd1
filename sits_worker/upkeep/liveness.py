"""Is the worker of this host alive? A probe for container healthchecks and Kubernetes probes.

A worker's Celery name ends with `@<hostname>` (`sitsctl worker` names it so), and its heartbeat
thread writes it into Redis every two seconds (`sits_worker/upkeep/heartbeat.py`). So a worker is
alive, seen from its container, when a worker named for this host has beaten within
`scheduler.worker_heartbeat_timeout`: the pool may be busy with a long batch, the heartbeat runs on a
thread of its own. `python -m sits_worker.upkeep.liveness` exits 0 then, else 1 saying why (2 when
Redis cannot be reached: not the worker's fault, but no proof of life either).
"""

from __future__ import annotations

import socket
import sys
import time

from broker.config.loading import load_settings
from broker.errors import SitsError
from broker.queueing import workers
from broker.state.store import Store


def alive_here(store: Store, hostname: str, *, now: float, timeout: float) -> list[str]:
    """The names of the live workers (a heartbeat within `timeout`) that run on `hostname`."""
    return [worker["name"] for worker in workers.list_workers(store, now=now, timeout=timeout)
            if worker["alive"] and str(worker["name"]).endswith(f"@{hostname}")]


def main() -> int:
    settings = load_settings()
    hostname = socket.gethostname()
    try:
        store = Store.of(settings.redis)
        alive = alive_here(store, hostname, now=time.time(), timeout=settings.scheduler.worker_heartbeat_timeout)
    except SitsError as err:
        print(f"cannot tell whether the worker of {hostname} is alive: {err.message}", file=sys.stderr)
        return 2
    if not alive:
        print(f"no worker of {hostname} has beaten within {settings.scheduler.worker_heartbeat_timeout:g} s "
              "(scheduler.worker_heartbeat_timeout)", file=sys.stderr)
        return 1
    print(f"alive: {', '.join(alive)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
