"""Tenants: who shares the fleet, with which guaranteed share, limit and quotas, kept live in Redis.

A tenant is a name that API keys belong to (`broker/tenants/apikeys.py`). Its record says what it is owed and
what it may do: `guaranteed_share` of the fleet's device time, `limit` (the most it may use when the
others are idle, as a multiple of its share), `preemption_target` (how soon its work must get a device
when it is below its share), `max_queued` online requests unanswered, `max_queued_bytes` of their inputs
and `max_inflight` jobs active (429 beyond each), the `default_priority` of its work and the `models` it may use.

Tenants come from `tenants:` in `sits-config.yaml`, which every process reads, and from
`PUT /v1/tenants/{name}` (admin), stored in one HASH (`keys.tenants`); the file wins for the names it
lists (`effective`), and both are validated together: guarantees sum to at most the whole fleet, with
a message naming the tenant that takes the sum past it. A tenant never configured has no share: its work runs on
what the others leave idle (`broker/tenants/shares.py`). Processes read the table again within
`TENANTS_TTL_SECONDS` (`TenantTable`), so a change takes effect within a second, with no restart.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import redis
from pydantic import ValidationError

from broker.errors import BadInput, ConfigError, Conflict, NotFound
from broker.state.store import Store, translate_redis_errors
from broker.tenants.settings import Tenant
from broker.tenants.shares import validate_shares

TENANT_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""What a tenant may be called (it appears in Redis keys, metrics labels and URLs)."""

TENANTS_TTL_SECONDS = 0.5
"""How long a process keeps the stored tenants before reading them again."""


def check_name(name: str) -> str:
    """`name` if it may name a tenant; BadInput saying how to write one."""
    if not TENANT_PATTERN.fullmatch(name):
        raise BadInput(f"tenant name {name!r} must be letters, digits, '_', '.' or '-' (64 at most), starting with "
                       "a letter or digit")
    return name


def parse_tenant(name: str, body: Any) -> Tenant:
    """A tenant's record from a request body; BadInput naming the tenant and what is wrong."""
    check_name(name)
    if not isinstance(body, dict):
        raise BadInput('a tenant is a JSON object, e.g. {"guaranteed_share": 0.7, "limit": 1.2, '
                       '"preemption_target": "5ms"}')
    try:
        return Tenant.model_validate(body)
    except ValidationError as err:
        raise BadInput.from_validation(err, "tenant", f"tenant '{name}': ") from err


def validate_tenants(tenants: Mapping[str, Tenant]) -> None:
    """ConfigError naming the tenant at fault when the shares cannot all be guaranteed together."""
    for name in tenants:
        if not TENANT_PATTERN.fullmatch(name):
            raise ConfigError(f"tenant name {name!r} must be letters, digits, '_', '.' or '-' (64 at most)")
    validate_shares({name: tenant.share() for name, tenant in tenants.items()})


def describe(name: str, tenant: Tenant, *, configured: Mapping[str, Tenant]) -> dict[str, Any]:
    """A tenant as the API shows it, with where it is set (`config` or `api`)."""
    return {"name": name, **tenant.model_dump(mode="json"), "source": "config" if name in configured else "api"}


def load_tenants(store: Store) -> dict[str, Tenant]:
    """Every tenant stored over the API, by name (a record damaged by hand is skipped: it has no share)."""
    with translate_redis_errors():
        return _decoded(store.client.hgetall(store.keys.tenants))


def save_tenants(store: Store, changed: Mapping[str, Tenant], *, configured: Mapping[str, Tenant]) -> None:
    """Store `changed` (replacing those names' records), checked together with every other tenant, those
    of the file (`configured`) and those stored, in one transaction (WATCH), so two admins adding 60 %
    each at once cannot both succeed. BadInput naming the tenant whose share takes the guarantees past
    the whole fleet; Conflict for a tenant the file sets (the file wins: change it there)."""
    fixed = sorted(set(changed) & set(configured))
    if fixed:
        raise Conflict(f"tenant '{fixed[0]}' is set in the configuration file (tenants.{fixed[0]}), which wins over "
                       "the API; change it there and restart, or give this tenant another name")
    with translate_redis_errors(), store.client.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(store.keys.tenants)
                stored = _decoded(pipe.hgetall(store.keys.tenants))
                try:
                    # (the changed ones last: a share that takes the sum past 1 is theirs, named in the message)
                    kept = {name: tenant for name, tenant in stored.items() if name not in changed}
                    validate_tenants({**kept, **configured, **changed})
                except ConfigError as err:
                    raise BadInput(err.message) from err
                pipe.multi()
                for name, tenant in changed.items():
                    pipe.hset(store.keys.tenants, name, tenant.model_dump_json())
                pipe.execute()
                return
            except redis.WatchError:
                continue


def _decoded(raw: Mapping[str, str]) -> dict[str, Tenant]:
    """Stored records by name; one damaged by hand is skipped (its tenant has no share)."""
    tenants = {}
    for name, text in sorted(raw.items()):
        try:
            tenants[name] = Tenant.model_validate(json.loads(text))
        except (ValueError, ValidationError):
            continue
    return tenants


def effective(stored: Mapping[str, Tenant], configured: Mapping[str, Tenant]) -> dict[str, Tenant]:
    """The tenants in force: those stored over the API, and the file's, which win for the names they list."""
    return dict(sorted({**stored, **configured}.items()))


def tenant_not_found(name: str) -> NotFound:
    """The error for a tenant with no record."""
    return NotFound(f"no tenant '{name}'; GET /v1/tenants lists them")


def delete_tenant(store: Store, name: str, *, configured: Mapping[str, Tenant]) -> None:
    """Remove a tenant's record (its keys stay, with no share); NotFound when there is none, Conflict for
    one the configuration file sets."""
    if name in configured:
        raise Conflict(f"tenant '{name}' is set in the configuration file (tenants.{name}); remove it there")
    with translate_redis_errors():
        removed = store.client.hdel(store.keys.tenants, name)
    if not removed:
        raise tenant_not_found(name)


class TenantTable:
    """The tenants in force (`effective`), the stored ones read again when older than `ttl_seconds` (a
    process's view of `keys.tenants`, kept per store, and forgotten with it), over the file's
    `configured` ones. Thread-safe; `clock` is passed in for tests."""

    def __init__(self, configured: Mapping[str, Tenant], ttl_seconds: float = TENANTS_TTL_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.configured = dict(configured)
        self.ttl_seconds = ttl_seconds
        self._clock = clock
        self._read: weakref.WeakKeyDictionary[Store, tuple[float, dict[str, Tenant]]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def tenants(self, store: Store) -> dict[str, Tenant]:
        """The tenants as stored at most `ttl_seconds` ago."""
        with self._lock:
            read_at, tenants = self._read.get(store, (-math.inf, {}))
            if self._clock() - read_at > self.ttl_seconds:
                tenants = effective(load_tenants(store), self.configured)
                self._read[store] = (self._clock(), tenants)
            return tenants

    def tenant(self, store: Store, name: str) -> Tenant | None:
        """One tenant's record, or None for a tenant never configured."""
        return self.tenants(store).get(name)

    def forget(self, store: Store) -> None:
        """Read the tenants again at the next call (this process just changed them)."""
        with self._lock:
            self._read.pop(store, None)
