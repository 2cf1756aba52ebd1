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

Every check compares tenants first: a key's name is unique across tenants (`create_api_key`), and
even a record stored before it was, or a key made by hand, reaches another tenant's work by its
name alone nowhere (`owns`, `owns_name`)."""


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
"""The most keys one tenant may hold: each is a record in Redis that every key made or revoked reads."""


def create_api_key(store: Store, name: str, role: str = "user", group: str = "", tenant: str = "") -> str:
    """Make and store a new key; the clear text is returned once and kept nowhere. `group` is the user
    group its requests count in for A/B routes ('' for none); `tenant` the tenant it belongs to (''
    for the key's own name: a tenant of one key, as every key was before tenants had records).

    A name belongs to one tenant (or to the admins): a key of another tenant's name would be taken
    for that tenant's by anyone reading a name, and an admin is no tenant's member. So a name some
    key of another tenant, or of the other kind (admin or not), has is refused (ValueError), checked
    in the transaction that stores the key (WATCH on the keys), so two keys created at once cannot
    split one name either. More keys of one name in one tenant are allowed (a key is rotated so).
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if not name.strip():  # the name is the tenant: what a key submits is owned by it
        raise ValueError("a key needs a name: who it is for")
    if name != name.strip():  # "alice " would be a tenant of its own, told from "alice" by nobody
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
    record = json.dumps({"name": name, "role": role, **({"group": group} if group else {}),
                         **({"tenant": tenant} if tenant and tenant != name else {})})
    with translate_redis_errors(), store.client.pipeline(transaction=True) as pipe:
        for _ in range(KEY_WRITE_TRIES):
            try:
                pipe.watch(store.keys.api_keys)
                stored = pipe.hvals(store.keys.api_keys)
                _refuse_a_taken_name(name, role, tenant or name, stored)
                _refuse_past_the_keys_of_a_tenant(role, tenant or name, stored)
                pipe.multi()
                pipe.hset(store.keys.api_keys, _digest(key), record)
                pipe.execute()
                return key
            except redis.WatchError:
                continue  # a key was created or revoked meanwhile; look again
    raise _busy_keys()


def _refuse_a_taken_name(name: str, role: str, tenant: str, stored: list[str]) -> None:
    """ValueError when a key in `stored` (records as `create_api_key` writes them) has `name` and is an
    admin's where `role` is a tenant's, or the other way round, or belongs to a tenant other than
    `tenant`; names that differ only in case count as one. `metrics` keys own nothing, so their names are free
    of the rule either way. The message
    names no tenant and no role: a tenant admin learns only that the name is taken, not whose it is."""
    if role == "metrics":
        return
    for raw in stored:
        try:
            identity = json.loads(raw)
        except ValueError:
            continue  # damaged: `authenticate` refuses it anyway
        if not isinstance(identity, dict) or identity.get("role") == "metrics":
            continue
        if str(identity.get("name", "")).casefold() != name.casefold():  # ("Bob@acme.com" looks like "bob@...")
            continue
        if (identity.get("role") == "admin") != (role == "admin") or (
                role != "admin" and (identity.get("tenant") or identity.get("name")) != tenant):
            raise ValueError(f"key name {name!r} is taken: a key name belongs to one tenant, or to the admin keys; "
                             f"give this {role} key another name")


def _refuse_past_the_keys_of_a_tenant(role: str, tenant: str, stored: list[str]) -> None:
    """ValueError when `tenant` holds `MAX_KEYS_PER_TENANT` keys already (admin and metrics keys aside)."""
    if role in ("admin", "metrics"):
        return
    held = 0
    for raw in stored:
        try:
            identity = json.loads(raw)
        except ValueError:
            continue
        if isinstance(identity, dict) and identity.get("role") not in ("admin", "metrics") and (
                identity.get("tenant") or identity.get("name")) == tenant:
            held += 1
    if held >= MAX_KEYS_PER_TENANT:
        raise ValueError(f"tenant {tenant!r} holds {held} keys, the most a tenant may; revoke some first")


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


TENANTLESS_ROLES = ("admin", "metrics")
"""Roles whose keys are no tenant's members, whatever their record's name: a tenant admin neither lists nor
revokes them (`members_only`), even one whose name is its tenant's."""


def list_api_keys(store: Store, tenant: str | None = None, *, members_only: bool = False) -> list[dict[str, Any]]:
    """Every key's name, role, tenant and group (never a digest), by name; only `tenant`'s when given, and
    with `members_only` none of `TENANTLESS_ROLES`."""
    with translate_redis_errors():
        stored = store.client.hvals(store.keys.api_keys)
    listed = []
    for raw in stored:
        try:
            identity = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(identity, dict) or "name" not in identity:
            continue
        record = {"name": identity["name"], "role": identity.get("role"),
                  "tenant": identity.get("tenant") or identity["name"], "group": identity.get("group") or None}
        if (tenant is None or record["tenant"] == tenant) and not (members_only and record["role"] in TENANTLESS_ROLES):
            listed.append(record)
    return sorted(listed, key=lambda record: (record["name"], str(record["role"])))


def revoke_api_keys(store: Store, name: str, tenant: str | None = None, *, members_only: bool = False,
                    tries: int | None = KEY_WRITE_TRIES) -> int:
    """Delete every key named `name` (only `tenant`'s when given, and with `members_only` none of
    `TENANTLESS_ROLES`); returns how many were deleted. The API trusts a key it checked for up to 5 s, so a
    revoked key stops working within that. Tried `tries` times against other writes, then QueueFull (None:
    until it is done, for SITS's own keys, which must not outlive their work)."""
    with translate_redis_errors(), store.client.pipeline(transaction=True) as pipe:
        for _ in itertools.count() if tries is None else range(tries):
            try:
                pipe.watch(store.keys.api_keys)
                doomed = []
                for digest, raw in pipe.hgetall(store.keys.api_keys).items():
                    try:
                        identity = json.loads(raw)
                    except ValueError:
                        continue
                    if isinstance(identity, dict) and identity.get("name") == name and (
                            tenant is None or (identity.get("tenant") or identity.get("name")) == tenant) and not (
                            members_only and identity.get("role") in TENANTLESS_ROLES):
                        doomed.append(digest)
                pipe.multi()
                if doomed:
                    pipe.hdel(store.keys.api_keys, *doomed)
                pipe.execute()
                return len(doomed)
            except redis.WatchError:
                continue
    raise _busy_keys()
