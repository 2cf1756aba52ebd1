"""API keys: stored as SHA-256 digests with a name and a role, never in clear text."""

from __future__ import annotations

import hashlib
import json
import secrets
from typing import Any

from broker.errors import Forbidden, Unauthorized
from broker.store import Store, translate_redis_errors

ROLES = ("admin", "user")


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_api_key(store: Store, name: str, role: str = "user") -> str:
    """Make and store a new key; the clear text is returned once and kept nowhere."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if not name.strip():  # the name is the tenant: what a key submits is owned by it
        raise ValueError("a key needs a name: who it is for")
    if name != name.strip():  # "alice " would be a tenant of its own, told from "alice" by nobody
        raise ValueError(f"key name {name!r} starts or ends with spaces; give it as {name.strip()!r}")
    key = "sits_" + secrets.token_urlsafe(24)
    with translate_redis_errors():
        store.client.hset(store.keys.api_keys, _digest(key), json.dumps({"name": name, "role": role}))
    return key


def authenticate(store: Store, key: str | None) -> dict[str, Any]:
    """The {name, role} of `key`; Unauthorized when it is missing or unknown."""
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
    return identity


def require_role(identity: dict[str, Any], role: str) -> None:
    """Forbidden unless the caller has `role` (admins may do everything)."""
    if identity.get("role") != "admin" and identity.get("role") != role:
        raise Forbidden(f"this needs the '{role}' role; key '{identity.get('name')}' has '{identity.get('role')}'")


def owns(identity: dict[str, Any], owner: str | None) -> bool:
    """May the caller see and steer a job or request submitted under `owner`?

    A key's name is its tenant: a `user` key owns what was submitted under its name, an `admin`
    key everything. Records stored without an owner (`None` or '') belong to no user key, so only
    admins see them.
    """
    if identity.get("role") == "admin":
        return True
    return bool(owner) and owner == identity.get("name")
