"""Redis behind Sentinel: the `sentinel://` form of `redis.url`, read in this one place.

`sentinel://:PASSWORD@host:26379;sentinel://:PASSWORD@host2:26379/0` names the Sentinels that watch
the Redis group `redis.sentinel_master`, and the database. Every client SITS makes asks them where the
primary is, at each connect: the API and the workers through redis-py's `Sentinel.master_for`, Celery
through kombu's Sentinel transport (`celery_broker`). After a failover a connection to the old primary
fails, or is refused as read-only, and the next one goes to the new primary.

One password serves the whole group: the Redis servers' `requirepass` (and `masterauth`), and the
Sentinels' own `requirepass` (`redis.sentinel_auth: same`, the default; `none` for Sentinels that ask
for none). Write it in any part of the URL, and the database after any part: parts that name one
must name the same.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from typing import Any, Literal

import redis
from redis.sentinel import Sentinel, SentinelManagedConnection

from broker.errors import ConfigError

SCHEME = "sentinel"
DEFAULT_PORT = 26379
SENTINEL_TIMEOUT_SECONDS = 2.0
"""How long a Sentinel may take to answer where the primary is, or to accept a connection: one that
does not (frozen, cut off) is passed over for the next, rather than holding every reconnect."""

SentinelAuth = Literal["same", "none"]
"""Whether the Sentinels ask for the group's password (`same`) or for none (`none`)."""


@dataclass(frozen=True)
class SentinelUrl:
    """A `sentinel://` URL read: where the Sentinels listen, and what the primary's connections use."""

    sentinels: tuple[tuple[str, int], ...]
    username: str | None
    password: str | None
    db: int


def is_sentinel_url(url: str) -> bool:
    """Whether `url` is the Sentinel form (`sentinel://...`), not a plain Redis URL."""
    return url.strip().lower().startswith(f"{SCHEME}://")


def parse_sentinel_url(url: str) -> SentinelUrl:
    """The Sentinels, credentials and database of a `sentinel://` URL; ConfigError saying what to fix."""
    sentinels: list[tuple[str, int]] = []
    users, passwords, dbs = set(), set(), set()
    for part in (part.strip() for part in url.split(";")):
        if not part:
            continue
        try:
            parts = urllib.parse.urlsplit(part)
            port = parts.port or DEFAULT_PORT
        except ValueError:  # (urllib's message may quote a piece of the password)
            raise _bad(url, "a part's host or port cannot be read; URL-quote any ';', ':', '@' or '/' in the "
                            "password") from None
        if parts.scheme.lower() != SCHEME or not parts.hostname:
            raise _bad(url, "every part must be sentinel://host:port")
        if parts.query or parts.fragment:
            raise _bad(url, "a part takes no query or fragment")
        path = parts.path.strip("/")
        if path:
            if not path.isdigit():
                raise _bad(url, f"'/{path}' is not a database number")
            dbs.add(int(path))
        if parts.username:
            users.add(urllib.parse.unquote(parts.username))
        if parts.password is not None:
            passwords.add(urllib.parse.unquote(parts.password))
        sentinels.append((parts.hostname, port))
    if not sentinels:
        raise _bad(url, "it names no Sentinel")
    for what, values in (("users", users), ("passwords", passwords), ("databases", dbs)):
        if len(values) > 1:
            raise _bad(url, f"its parts name different {what}; the group has one")
    return SentinelUrl(sentinels=tuple(sentinels), username=next(iter(users), None),
                       password=next(iter(passwords), None), db=next(iter(dbs), 0))


def _bad(url: str, why: str) -> ConfigError:
    # (the URL itself is not shown: one that cannot be read cannot be masked for sure)
    return ConfigError(f"redis.url is not a Sentinel URL ({why}); give one like "
                       "sentinel://:PASSWORD@host1:26379;sentinel://:PASSWORD@host2:26379/0 "
                       "(redis.url, SITS_REDIS_URL)")


def master_name_of(sentinel_master: str) -> str:
    """`redis.sentinel_master`, required with a Sentinel URL (ConfigError naming the setting)."""
    name = sentinel_master.strip()
    if not name:
        raise ConfigError("redis.url names Sentinels, but not which Redis group of theirs to use: set "
                          "redis.sentinel_master (SITS_REDIS__SENTINEL_MASTER) to its name, as in their "
                          "`sentinel monitor NAME host port quorum`")
    return name


def _sentinel_kwargs(address: SentinelUrl, auth: SentinelAuth) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"socket_timeout": SENTINEL_TIMEOUT_SECONDS,
                              "socket_connect_timeout": SENTINEL_TIMEOUT_SECONDS}
    if auth == "same" and address.password is not None:
        kwargs.update(password=address.password, **({"username": address.username} if address.username else {}))
    return kwargs


class RediscoveringConnection(SentinelManagedConnection):
    """A connection to the primary that asks the Sentinels where it is whenever it connects again.

    redis-py 8 opens a dropped connection again through `connect_check_health`, which keeps the
    address it had (redis/redis-py#3874): after a failover every pooled or held connection would go
    back to the dead primary until its retries ran out, and fail. Here that path asks the Sentinels
    first, with the connection's retries, so a command sent while the Sentinels promote a replica
    reaches the new primary once they name it."""

    def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        if self._sock:
            return
        if retry_socket_connect:  # (not `connect_to`, which calls this with the address it was given)
            self.connect()
            return
        super().connect_check_health(check_health=check_health, retry_socket_connect=False)


def primary_client(url: str, sentinel_master: str, *, sentinel_auth: SentinelAuth = "same",
                   **client_kwargs: Any) -> redis.Redis:
    """A client of the primary of group `sentinel_master`, found through the Sentinels of `url` at each
    connect (`redis.sentinel.Sentinel.master_for`); `client_kwargs` as for `redis.Redis`."""
    address = parse_sentinel_url(url)
    master = master_name_of(sentinel_master)
    sentinel = Sentinel(list(address.sentinels), sentinel_kwargs=_sentinel_kwargs(address, sentinel_auth))
    credentials: dict[str, Any] = {"password": address.password,
                                   **({"username": address.username} if address.username else {})}
    client: redis.Redis = sentinel.master_for(master, db=address.db, connection_class=RediscoveringConnection,
                                              **credentials, **client_kwargs)
    return client


def celery_broker(url: str, sentinel_master: str, *,
                  sentinel_auth: SentinelAuth = "same") -> tuple[str, dict[str, Any]]:
    """Celery's `broker_url` for `url` and the `broker_transport_options` it needs besides SITS's own.

    A plain Redis URL is passed as it is. For the Sentinel form, kombu reads the credentials and the
    database from the first part only: each part is written with them, and the group's name goes in
    `master_name` (the Sentinels' password, if they ask for one, in `sentinel_kwargs`)."""
    if not is_sentinel_url(url):
        return url, {}
    address = parse_sentinel_url(url)
    master = master_name_of(sentinel_master)
    user = urllib.parse.quote(address.username or "", safe="")
    secret = "" if address.password is None else ":" + urllib.parse.quote(address.password, safe="")
    credentials = f"{user}{secret}@" if user or secret else ""
    parts = [f"{SCHEME}://{credentials}{f'[{host}]' if ':' in host else host}:{port}/{address.db}"
             for host, port in address.sentinels]
    return ";".join(parts), {"master_name": master, "sentinel_kwargs": _sentinel_kwargs(address, sentinel_auth)}
