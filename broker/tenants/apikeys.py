"""API keys: stored as SHA-256 digests with a name and a role, never in clear text."""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import secrets
from typing import Any

import redis

from broker.errors import Forbidden, QueueFull, Unauthorized
from broker.state.store import Store, translate_redis_errors

ROLES = ("admin", "tenant-admin", "user", "viewer", "metrics")
"""admin: everything; tenant-admin: its tenant's work, whoever of the tenant submitted it, and its
tenant's usage; user: its own jobs and requests, and its tenant's model names; viewer: reads its
tenant's work and usage, submits nothing; metrics: `GET /metrics` only, a key for a Prometheus scrape
that can submit nothing and read no tenant's records.

Every check compares tenants first: a key's name is its tenant's (two tenants may each have an `alice`),
and a key reaches another tenant's work by its name alone nowhere (`owns`, `owns_name`)."""


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


GROUP_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""What a key's group may be called: the user group A/B routes send to an arm (`broker/models/routing.py`)."""
KEY_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@+-]{0,63}")
"""What a key may be called: a name a person reads (an e-mail address fits), short, in plain letters:
every record a key submits carries it, and no two names may look alike."""
KEY_WRITE_TRIES = 20
"""Most tries of one key's creation or revocation, each undone by another key's written meanwhile; then a 429
to retry (a tenant making keys without pause must not hold every other tenant's key changes in a loop)."""


def _busy_keys() -> QueueFull:
    return QueueFull(f"the API keys changed {KEY_WRITE_TRIES} times while this change was made; send it again",
                     retry_after=1)


MAX_KEYS_PER_TENANT = 1000
"""The most keys one tenant may hold: each is a record in Redis that every key change of its tenant reads."""


MEMBER_ROLES = ("tenant-admin", "user", "viewer")
"""Roles whose keys are their tenant's members: indexed by tenant (`keys.tenant_api_keys`), so that a tenant's
key changes read and wait on its own keys alone, and learn nothing of another tenant's."""
TENANTLESS_ROLES = ("admin", "metrics")
"""Roles whose keys are no tenant's members, whatever their record's name: a tenant admin neither lists nor
revokes them (`members_only`), even one whose name is its tenant's."""


def _parsed(raw: str | None) -> dict[str, Any] | None:
    """A stored key record, or None where there is none or it is damaged (`authenticate` refuses those)."""
    if raw is None:
        return None
    try:
        identity = json.loads(raw)
    except ValueError:
        return None
    return identity if isinstance(identity, dict) else None


def _index_of(store: Store, identity: dict[str, Any]) -> str:
    """The set a key record's digest is listed in: its tenant's for a member, else the tenantless keys'."""
    if identity.get("role") in MEMBER_ROLES:
        return store.keys.tenant_api_keys(key_tenant(identity))
    return store.keys.tenantless_api_keys


def create_api_key(store: Store, name: str, role: str = "user", group: str = "", tenant: str = "") -> str:
    """Make and store a new key; the clear text is returned once and kept nowhere. `group` is the user
    group its requests count in for A/B routes ('' for none); `tenant` the tenant it belongs to (''
    for the key's own name: a tenant of one key, as every key was before tenants had records).

    A name is its tenant's: another tenant may have keys of the same name, and a key made for one tenant
    reads no other tenant's keys, so it neither waits on them nor learns whether a name exists there. More
    keys of one name in one tenant are allowed (a key is rotated so). An admin, though, is no tenant's
    member yet acts as the tenant of its name: a tenant named like an admin key (case aside) would own that
    admin's work, so neither is made where the other is (ValueError), checked in the transaction that
    stores the key, so two made at once cannot pass it against each other. A tenant holds at most
    `MAX_KEYS_PER_TENANT` member keys.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if not name.strip():  # the name is the owner of what the key submits
        raise ValueError("a key needs a name: who it is for")
    if name != name.strip():  # "alice " would be an owner of its own, told from "alice" by nobody
        raise ValueError(f"key name {name!r} starts or ends with spaces; give it as {name.strip()!r}")
    if not KEY_NAME_PATTERN.fullmatch(name):  # (look-alike letters, control characters, megabytes of name)
        raise ValueError(f"key name {name[:80]!r} must be letters, digits, '_', '.', '@', '+' or '-' (64 at most), "
                         "starting with a letter or digit")
    if tenant and not GROUP_PATTERN.fullmatch(tenant):
        raise ValueError(f"tenant {tenant!r} must be letters, digits, '_', '.' or '-' (64 at most), starting with a "
                         "letter or digit")
    if group and not GROUP_PATTERN.fullmatch(group):
        raise ValueError(f"group {group!r} must be letters, digits, '_', '.' or '-' (64 at most), starting with a "
                         "letter or digit")
    key = "sits_" + secrets.token_urlsafe(24)
    identity = {"name": name, "role": role, **({"group": group} if group else {}),
                **({"tenant": tenant} if tenant and tenant != name else {})}
    keys, digest = store.keys, _digest(key)
    index = _index_of(store, identity)
    with translate_redis_errors():
        _index_keys(store)
        with store.client.pipeline(transaction=True) as pipe:
            for _ in range(KEY_WRITE_TRIES):
                try:
                    if role in MEMBER_ROLES:
                        pipe.watch(index, keys.tenantless_api_keys)
                        members = _indexed_records(store, pipe, index)
                        tenantless = _indexed_records(store, pipe, keys.tenantless_api_keys)
                        _refuse_a_tenant_named_like_an_admin(key_tenant(identity), tenantless.values())
                        if len(members) >= MAX_KEYS_PER_TENANT:
                            raise ValueError(f"tenant {key_tenant(identity)!r} holds {len(members)} keys, "
                                             "the most a tenant may; revoke some first")
                    elif role == "admin":  # (an admin's change, rare: it may read every key)
                        pipe.watch(keys.api_keys)
                        _refuse_an_admin_named_like_a_tenant(key_tenant(identity),
                                                             pipe.hvals(keys.api_keys))
                    pipe.multi()
                    pipe.hset(keys.api_keys, digest, json.dumps(identity))
                    pipe.sadd(index, digest)
                    pipe.incr(keys.api_keys_indexed)
                    pipe.execute()
                    return key
                except redis.WatchError:
                    continue  # a key was created or revoked meanwhile; look again
                except _StaleSets:
                    pipe.reset()
                    _index_keys(store, rebuild=True)
    raise _busy_keys()


class _StaleSets(Exception):
    """A per-tenant set lists a key that is gone: an older API process revoked it (and may have made others the
    sets miss, in a number that hides it from the count): build the sets again and look again."""


def _indexed_records(store: Store, pipe: Any, index: str) -> dict[str, dict[str, Any]]:
    """The key records whose digests `index` lists, by digest, read on `pipe`, watching, in immediate mode;
    _StaleSets when it lists a key that is gone or damaged."""
    digests = sorted(pipe.smembers(index))
    raws = pipe.hmget(store.keys.api_keys, digests) if digests else []
    records = {digest: identity for digest, raw in zip(digests, raws, strict=True)
               if (identity := _parsed(raw)) is not None}
    if len(records) < len(digests):
        raise _StaleSets(index)
    return records


def _refuse_a_tenant_named_like_an_admin(tenant: str, tenantless: Any) -> None:
    """ValueError when an admin key acts as `tenant` (its name, case aside): the tenant's keys would own its work.
    Met only by an admin making a tenant's first key: a tenant admin's own tenant passed it when made."""
    for identity in tenantless:
        if identity.get("role") == "admin" and key_tenant(identity).casefold() == tenant.casefold():
            raise ValueError(f"tenant {tenant!r} is named like an admin key, whose work a tenant of that name would "
                             "own; give the key another tenant")


def _refuse_an_admin_named_like_a_tenant(tenant: str, stored: list[str]) -> None:
    """ValueError when a member key of `stored` belongs to `tenant` (case aside), the tenant an admin key of that
    name would act as: that tenant's keys would own the admin's work."""
    for raw in stored:
        identity = _parsed(raw)
        if identity is not None and identity.get("role") in MEMBER_ROLES and (
                key_tenant(identity).casefold() == tenant.casefold()):
            raise ValueError(f"key name {tenant!r} is a tenant's: an admin key of that name would act as that "
                             "tenant; give the admin key another name")


KEY_SETS_CHECKED_SECONDS = 300
"""How often the per-tenant sets are built again from `api_keys` whatever their count says: an older API process
that made one key and revoked another (a rotation, during an upgrade) leaves the count right and a key in no set."""


def _index_keys(store: Store, *, rebuild: bool = False, tries: int | None = KEY_WRITE_TRIES) -> None:
    """Build the per-tenant sets of key digests again from `api_keys` when they may not list every key there: keys
    stored before the sets existed, or by an older API process during an upgrade. That is when `api_keys`' length
    is not the count the sets hold, when a reader found a set listing a key that is gone (`rebuild`), and once
    every `KEY_SETS_CHECKED_SECONDS`. Else one HLEN, one GET and one SET NX in one round trip. Tried `tries` times
    against other key writes (None: until done), then QueueFull."""
    keys = store.keys
    with store.client.pipeline(transaction=True) as check:
        length, indexed, due = (check.hlen(keys.api_keys).get(keys.api_keys_indexed)
                                .set(keys.api_keys_checked, "1", nx=True, ex=KEY_SETS_CHECKED_SECONDS).execute())
    if int(indexed or 0) == length and not due and not rebuild:
        return
    with store.client.pipeline(transaction=True) as pipe:
        for _ in itertools.count() if tries is None else range(tries):
            try:
                pipe.watch(keys.api_keys)
                stored = pipe.hgetall(keys.api_keys)
                sets: dict[str, list[str]] = {}
                for digest, raw in stored.items():
                    identity = _parsed(raw)
                    if identity is not None:
                        sets.setdefault(_index_of(store, identity), []).append(digest)
                pipe.multi()
                for index, digests in sets.items():
                    pipe.delete(index)
                    pipe.sadd(index, *digests)
                pipe.set(keys.api_keys_indexed, len(stored))
                pipe.execute()
                return
            except redis.WatchError:
                continue
    raise _busy_keys()


def authenticate(store: Store, key: str | None) -> dict[str, Any]:
    """The {name, role, tenant} (and `group`, where it has one) of `key`; Unauthorized when it is missing
    or unknown. A key stored without a tenant belongs to the tenant of its own name."""
    if not key:
        raise Unauthorized("missing API key: send 'Authorization: Bearer <key>' (see `sitsctl up`, $SITS_HOME/api-key)")
    with translate_redis_errors():
        raw = store.client.hget(store.keys.api_keys, _digest(key))
    if raw is None:
        raise Unauthorized("unknown API key: check SITS_API_KEY or $SITS_HOME/api-key")
    try:
        identity = json.loads(raw)
    except ValueError:
        identity = None
    if not isinstance(identity, dict):  # written by hand, or by something else: not a key SITS made
        raise Unauthorized("this API key's record in Redis is damaged; create a new key with `sitsctl key create`")
    return identity | {"tenant": identity.get("tenant") or identity.get("name", "")}


def require_role(identity: dict[str, Any], role: str) -> None:
    """Forbidden unless the caller has `role` (admins may do everything)."""
    if identity.get("role") != "admin" and identity.get("role") != role:
        raise Forbidden(f"this needs the '{role}' role; key '{identity.get('name')}' has '{identity.get('role')}'")


def record_tenant(owner: str | None, tenant: str | None) -> str:
    """The tenant a job or request belongs to: as stored, else its owner's name (records stored before
    keys had tenants, whose owner was their tenant)."""
    return tenant or owner or ""


def key_tenant(identity: dict[str, Any]) -> str:
    """The tenant a key acts for (`authenticate` sets it; a key record without one: its name's)."""
    return str(identity.get("tenant") or identity.get("name") or "")


def owns(identity: dict[str, Any], owner: str | None, tenant: str | None = None) -> bool:
    """May the caller see and steer (cancel, stop, resume) a job or request submitted under `owner`, for
    `tenant`?

    An `admin` key may everything. Any other key first must be of the record's tenant; then a
    `tenant-admin` key may what was submitted for its tenant, a `user` key what was submitted under
    its own name. A key of one tenant named like a key of another so reaches nothing of the other's.
    Records stored without an owner (`None` or '') belong to no tenant's key, so only admins see them.
    """
    role = identity.get("role")
    if role == "admin":
        return True
    if not owner or record_tenant(owner, tenant) != key_tenant(identity):
        return False
    return role == "tenant-admin" or (role == "user" and owner == identity.get("name"))


def owns_name(identity: dict[str, Any], owner: str | None) -> bool:
    """Is a model name owned by tenant `owner` (None: by no tenant) the caller's, to add versions to, or
    to see whole? An admin key's every name; a tenant's keys their tenant's names."""
    if identity.get("role") == "admin":
        return True
    return bool(owner) and identity.get("role") in ("tenant-admin", "user", "viewer") and owner == key_tenant(identity)


def may_read(identity: dict[str, Any], owner: str | None, tenant: str | None = None) -> bool:
    """May the caller see a job or request (`owns`, or a `viewer` key of its tenant)?"""
    if identity.get("role") == "viewer":
        return bool(owner) and record_tenant(owner, tenant) == identity.get("tenant")
    return owns(identity, owner, tenant)


def _scoped_records(store: Store, pipe: Any, tenant: str | None, members_only: bool) -> dict[str, dict[str, Any]]:
    """The key records by digest, read on `pipe` (watching what it reads): every key's where `tenant` is None; else
    `tenant`'s members', and with them, unless `members_only`, the tenantless keys that act as `tenant`."""
    if tenant is None:
        pipe.watch(store.keys.api_keys)
        stored = {digest: _parsed(raw) for digest, raw in pipe.hgetall(store.keys.api_keys).items()}
        return {digest: identity for digest, identity in stored.items() if identity is not None}
    indexes = [store.keys.tenant_api_keys(tenant), *([] if members_only else [store.keys.tenantless_api_keys])]
    pipe.watch(*indexes)
    records: dict[str, dict[str, Any]] = {}
    for index in indexes:
        records.update(_indexed_records(store, pipe, index))
    return {digest: identity for digest, identity in records.items() if key_tenant(identity) == tenant
            and not (members_only and identity.get("role") in TENANTLESS_ROLES)}


def list_api_keys(store: Store, tenant: str | None = None, *, members_only: bool = False) -> list[dict[str, Any]]:
    """Every key's name, role, tenant and group (never a digest), by name; only `tenant`'s when given (read from its
    own set: no other tenant's keys are read), and with `members_only` none of `TENANTLESS_ROLES`."""
    with translate_redis_errors():
        if tenant is not None:
            _index_keys(store)
        with store.client.pipeline(transaction=True) as pipe:
            try:
                records = _scoped_records(store, pipe, tenant, members_only)
            except _StaleSets:
                pipe.reset()
                _index_keys(store, rebuild=True)
                try:
                    records = _scoped_records(store, pipe, tenant, members_only)
                except _StaleSets as again:  # (an older process revoked another meanwhile: ask to send it again)
                    raise _busy_keys() from again
    listed = [{"name": identity["name"], "role": identity.get("role"), "tenant": key_tenant(identity),
               "group": identity.get("group") or None} for identity in records.values() if "name" in identity]
    return sorted(listed, key=lambda record: (str(record["name"]), str(record["role"])))


def revoke_api_keys(store: Store, name: str, tenant: str | None = None, *, members_only: bool = False,
                    tries: int | None = KEY_WRITE_TRIES) -> int:
    """Delete every key named `name` (only `tenant`'s when given, read from its own set, and with `members_only`
    none of `TENANTLESS_ROLES`); returns how many were deleted. The API trusts a key it checked for up to 5 s,
    so a revoked key stops working within that. Tried `tries` times against other writes to the keys it read,
    then QueueFull (None: until it is done, for SITS's own keys, which must not outlive their work)."""
    with translate_redis_errors():
        _index_keys(store, tries=tries)
        with store.client.pipeline(transaction=True) as pipe:
            for _ in itertools.count() if tries is None else range(tries):
                try:
                    records = _scoped_records(store, pipe, tenant, members_only)
                    doomed = {digest: identity for digest, identity in records.items() if identity.get("name") == name}
                    pipe.multi()
                    if doomed:
                        pipe.hdel(store.keys.api_keys, *doomed)
                        for digest, identity in doomed.items():
                            pipe.srem(_index_of(store, identity), digest)
                        pipe.decrby(store.keys.api_keys_indexed, len(doomed))
                    pipe.execute()
                    return len(doomed)
                except redis.WatchError:
                    continue
                except _StaleSets:
                    pipe.reset()
                    _index_keys(store, rebuild=True, tries=tries)
    raise _busy_keys()
