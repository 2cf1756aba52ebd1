"""The `redis` settings section: where state lives."""

from __future__ import annotations

from broker.setting_types import Bytes, parse_size
from broker.setting_types import Section as _Section


class RedisSettings(_Section):
    """Where state lives. `url` empty means: start the embedded Redis."""

    url: str = ""
    key_prefix: str = "sits"
    appendonly: bool = True
    maxmemory: Bytes = parse_size("1GiB")
    """The most memory the embedded Redis holds (0: no limit). Past it Redis evicts nothing and refuses
    writes, and SITS answers them 503 `store_full` while reads, leases and acks go on, until finished
    work and results expire. An external Redis keeps its own `maxmemory`: set it there, with
    `maxmemory-policy noeviction`."""

    @property
    def task_queue(self) -> str:
        """The Celery queue of this deployment's tasks: its key prefix, so that deployments sharing one
        Redis under different prefixes never take each other's tasks (a worker of another prefix would
        take a drain task and find none of this deployment's queues)."""
        return self.key_prefix
