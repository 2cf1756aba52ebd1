"""The `redis` settings section: where state lives."""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import Field, field_validator

from broker.setting_types import Bytes, Integer, Seconds, parse_size
from broker.setting_types import Section as _Section


class RedisSettings(_Section):
    """Where state lives. `url` empty means: start the embedded Redis."""

    url: str = ""
    sentinel_master: str = ""
    """The Redis group to use when `url` names Sentinels (`sentinel://host:port;sentinel://host:port/db`):
    the NAME of their `sentinel monitor NAME host port quorum` (`broker/state/sentinel.py`)."""
    sentinel_auth: Literal["same", "none"] = "same"
    """Whether the Sentinels ask for the password of `url` (`same`) or for none (`none`)."""
    wait_replicas: Integer = Field(0, ge=0)
    """How many replicas must hold a write before the API acknowledges it (Redis's WAIT): a job, a
    cancel, a key, a request queued with 202. Fewer within `wait_timeout` is a 503. 0: no wait."""
    wait_timeout: Seconds = Field(1.0, gt=0)
    key_prefix: str = "sits"
    bind: str = "127.0.0.1"
    """The one address the embedded Redis listens on, and the host its URL names: loopback by default; an
    address the fleet's other hosts reach (`sitsctl up --listen`) lets their workers join. Its password
    guards it either way; firewall its port to the fleet's hosts."""
    port: Integer = Field(0, ge=0, le=65535)
    """The port the embedded Redis listens on; 0: a free one at each start. A fixed one keeps a firewall
    rule for the fleet's hosts valid across restarts."""
    appendonly: bool = True
    maxmemory: Bytes = parse_size("1GiB")
    """The most memory the embedded Redis holds (0: no limit). Past it Redis evicts nothing and refuses
    writes, and SITS answers them 503 `store_full` while reads, leases and acks go on, until finished
    work and results expire. An external Redis keeps its own `maxmemory`: set it there, with
    `maxmemory-policy noeviction`."""

    @field_validator("bind")
    @classmethod
    def _one_address(cls, value: str) -> str:
        try:
            address = ipaddress.ip_address(value.strip().strip("[]"))
        except ValueError:
            raise ValueError(f"{value!r} is not an IP address: name the one address of this host that the "
                             "fleet's hosts reach (127.0.0.1: this host only)") from None
        if address.is_unspecified:
            raise ValueError(f"{value} is every address of this host, which no worker can be given to reach: "
                             "name the one address the fleet's hosts reach")
        return str(address)

    @property
    def task_queue(self) -> str:
        """The Celery queue of this deployment's tasks: its key prefix, so that deployments sharing one
        Redis under different prefixes never take each other's tasks (a worker of another prefix would
        take a drain task and find none of this deployment's queues)."""
        return self.key_prefix
