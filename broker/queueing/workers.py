"""Worker heartbeats: which workers are alive, on which device, with how many streams; and whose
turn the next reaper pass is.

Each worker process writes its record every few seconds; readers judge
liveness by the age of `last_heartbeat` against a timeout passed in, so
the decision is a pure function of `now`.
"""

from __future__ import annotations

import json
from typing import Any

from broker.state.store import Store, translate_redis_errors


def record_heartbeat(store: Store, worker_name: str, info: dict[str, Any], *, now: float) -> None:
    """Write a worker's record with `last_heartbeat = now`."""
    with translate_redis_errors():
        store.client.hset(store.keys.workers, worker_name, json.dumps(info | {"last_heartbeat": now}))


def remove_worker(store: Store, worker_name: str) -> None:
    """Forget a worker that shut down cleanly."""
    with translate_redis_errors():
        store.client.hdel(store.keys.workers, worker_name)


def take_reaper_turn(store: Store, worker_name: str, *, hold_seconds: float) -> bool:
    """True when `worker_name` may do the next reaper pass: no other worker holds the turn, or it
    already does; the turn is then (re)set to last `hold_seconds` (`take_reaper_turn.lua`). Overlapping
    passes would be safe (every step of a pass is idempotent); the turn spares the other workers
    doing the same pass again within one interval."""
    with translate_redis_errors():
        return bool(store.scripts.take_reaper_turn(keys=[store.keys.reaper_turn],
                                                   args=[worker_name, max(1, int(hold_seconds * 1000))]))


def list_workers(store: Store, *, now: float, timeout: float) -> list[dict[str, Any]]:
    """All known workers with `alive` and `heartbeat_age_seconds`; dead ones long gone are pruned."""
    with translate_redis_errors():
        raw = store.client.hgetall(store.keys.workers)
    workers, gone = decode_workers(raw, now=now, timeout=timeout)
    if gone:
        with translate_redis_errors():
            store.client.hdel(store.keys.workers, *gone)
    return workers


def decode_workers(raw: dict[str, str], *, now: float, timeout: float) -> tuple[list[dict[str, Any]], list[str]]:
    """(The heartbeats of `raw`, the workers hash, by name with `alive` and `heartbeat_age_seconds`; the
    names of workers silent for over ten `timeout`s, long gone, left out: `list_workers` prunes them)."""
    workers, gone = [], []
    for name, value in sorted(raw.items()):
        record = json.loads(value)
        age = now - float(record.get("last_heartbeat", 0))
        if age > 10 * timeout:
            gone.append(name)
            continue
        workers.append(record | {"name": name, "alive": age <= timeout, "heartbeat_age_seconds": round(age, 1)})
    return workers, gone


def live_stream_slots(store: Store, *, now: float, timeout: float) -> int:
    """Sum of `streams` over live workers: how many batch tickets should circulate."""
    return sum(int(worker.get("streams", 1)) for worker in list_workers(store, now=now, timeout=timeout)
               if worker["alive"])
