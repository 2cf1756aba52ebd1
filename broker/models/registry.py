"""Registered model versions in Redis.

A version is the content hash of the model file, so re-registering a changed
file makes a new version while old ones stay addressable as `name@version`;
a bare `name` means the newest registered version. The record is stored as a JSON
object (path of the stored copy, static profile, measured profile, fusion
result) written by the API and completed by the workers' profiler task, and
read back as a `ModelRecord` (`broker/models/model_record.py`).

A name belongs to the tenant whose key registered it first (`model-owners`):
only that tenant's keys and admins add versions under it, so no one can
change what another's jobs and requests get when they name only the model.
A name first registered by an admin key belongs to no tenant (an admin is
none), like one registered before names had owners: admin keys alone add
versions to it. Using a model stays open to every key.

Names were once owned by the registering key's name rather than its tenant;
`own_names_by_tenant` moves such owners to their key's tenant, once.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import redis

from broker.errors import BadInput, Forbidden, ModelNotFound, ModelsAtLimit
from broker.models.model_record import ModelRecord
from broker.state.store import Store, translate_redis_errors
from broker.tenants.apikeys import key_tenant, owns_name


def split_model_ref(ref: str) -> tuple[str, str | None]:
    """`name@version` -> (name, version); `name` -> (name, None). BadInput for `name@` or `@version`:
    an empty part is a typo, not a request for the newest version."""
    name, at, version = ref.partition("@")
    if not name or (at and not version):
        raise BadInput(f"model reference {ref!r} has an empty {'name' if not name else 'version'}; write "
                       "'<name>' for its newest version or '<name>@<version>'")
    return name, version or None


def check_may_register(store: Store, name: str, registrant: dict[str, Any]) -> None:
    """Forbidden unless the API key `registrant` may add a version under model name `name`.

    Read at once, so that a refused registration costs no validation and stores no copy;
    `save_model_version` checks again in the transaction that writes.
    """
    with translate_redis_errors():
        pipe = store.client.pipeline(transaction=False)
        pipe.hget(store.keys.model_owners, name)
        pipe.hexists(store.keys.model_latest, name)
        owner, has_versions = pipe.execute()
    _refuse_a_name_of_another(registrant, name, owner=owner, registered=owner is not None or bool(has_versions))


def name_claimant(registrant: dict[str, Any]) -> str | None:
    """The tenant that a new model name registered by the API key `registrant` becomes: the key's
    tenant; None for an admin key. An admin is no tenant: claimed under its key's name, the name would
    belong to a tenant of that name; unclaimed, it takes versions from admin keys only, as one
    registered before names had owners (registered: in `model-latest`, not in `model-owners`)."""
    return None if registrant.get("role") == "admin" else key_tenant(registrant)


def _refuse_a_name_of_another(registrant: dict[str, Any], name: str, *, owner: str | None, registered: bool) -> None:
    """A new name is free to any key; a registered one takes versions from keys that own it
    (`apikeys.owns_name`: its tenant's keys and admins), one no tenant owns (an admin key's, or from
    before names had owners) from admins only. The message names no tenant: only a tenant's key is
    ever refused."""
    if not registered or owns_name(registrant, owner):
        return
    if owner:
        raise Forbidden(f"model name '{name}' is registered by another tenant; choose another name")
    raise Forbidden(f"model name '{name}' belongs to no tenant (registered by an admin key, or before model names "
                    "had owners), so only an admin key may add versions to it; choose another name")


@dataclass(frozen=True)
class ModelRoom:
    """The stored models tenant `tenant` may hold under the names it owns: at most `versions` versions and
    `stored_bytes` bytes of stored copies (0: no limit) (`tenants.<name>.max_model_versions`,
    `max_model_bytes`)."""

    tenant: str
    versions: int
    stored_bytes: int

    def check(self, owners: dict[str, str], records: Iterable[dict[str, Any]], *, name: str, adding: int) -> None:
        """ModelsAtLimit unless one more version of `name`, of `adding` bytes, fits beside `records` (every
        stored version's record) of the names `owners` (name -> owning tenant) gives this tenant."""
        held = [record for record in records if owners.get(record.get("name", "")) == self.tenant]
        count, used = len(held), sum(int(record.get("stored_bytes") or 0) for record in held)
        if self.versions and count + 1 > self.versions:
            raise ModelsAtLimit(f"tenant '{self.tenant}' stores {count} model versions, the most it may "
                                f"(tenants.{self.tenant}.max_model_versions); '{name}' was not registered. An "
                                "admin may raise the cap")
        if self.stored_bytes and used + adding > self.stored_bytes:
            raise ModelsAtLimit(f"tenant '{self.tenant}' stores {used} bytes of models; '{name}' ({adding} bytes) "
                                f"would pass the most it may, {self.stored_bytes} (tenants.{self.tenant}."
                                "max_model_bytes), so it was not registered. An admin may raise the cap")


def check_model_room(store: Store, room: ModelRoom, *, name: str, adding: int) -> None:
    """`room.check` against the versions stored now: asked before a registration loads its model, so that a
    tenant at its cap costs no load; `save_model_version` checks again in the transaction that writes."""
    with translate_redis_errors():
        pipe = store.client.pipeline(transaction=False)
        pipe.hgetall(store.keys.model_owners)
        pipe.hvals(store.keys.model_versions)
        owners, raws = pipe.execute()
    room.check(owners, (json.loads(raw) for raw in raws), name=name, adding=adding)


def save_model_version(store: Store, record: dict[str, Any], *, make_latest: bool = True,
                       registrant: dict[str, Any] | None = None,
                       based_on: Callable[[dict[str, Any] | None], dict[str, Any]] | None = None,
                       room: ModelRoom | None = None) -> ModelRecord:
    """Store a model version record (keys `name` and `version` required); returns it as stored.

    With `based_on`, the record stored is `based_on(the version's stored record, or None)`, read in the
    same transaction (WATCH on the versions): registering a version again keeps what a worker wrote
    into it meanwhile (its measured profile), where a record built from an earlier read would not.

    With `registrant`, the API key registering it, the name is checked and claimed in the transaction
    that writes the version (WATCH on the names), so of keys registering one new name at once exactly
    one gets it and the others are refused like any later one: a new name becomes the registrant's
    tenant's (`name_claimant`; no tenant's for an admin key: then `model-latest` alone marks it
    registered, so that key stays WATCHed), a registered one is Forbidden unless the registrant owns
    it. The record carries its name's `owner`. Without a registrant (tests, tools), nothing is
    checked or claimed.

    With `room`, a version not stored yet is refused (ModelsAtLimit, 403) when it would take its tenant past
    that room, counted in the same transaction: registrations at once cannot each pass it.
    """
    keys = store.keys
    name = record["name"]
    ref = f"{name}@{record['version']}"
    with translate_redis_errors(), store.client.pipeline(transaction=True) as pipe:
        while True:
            try:
                watched = [keys.model_owners, keys.model_latest] if registrant is not None else []
                if based_on is not None or room is not None:
                    watched.append(keys.model_versions)
                if watched:
                    pipe.watch(*watched)
                stored = record
                if based_on is not None:
                    raw = pipe.hget(keys.model_versions, ref)
                    stored = based_on(json.loads(raw) if raw else None)
                claimant = None
                if registrant is not None:
                    owner = pipe.hget(keys.model_owners, name)
                    registered = owner is not None or bool(pipe.hexists(keys.model_latest, name))
                    _refuse_a_name_of_another(registrant, name, owner=owner, registered=registered)
                    claimant = None if registered else name_claimant(registrant)
                    stored = stored | {"owner": owner if registered else claimant}
                if room is not None and not pipe.hexists(keys.model_versions, ref):
                    owners = pipe.hgetall(keys.model_owners) | ({name: claimant} if claimant is not None else {})
                    room.check(owners, (json.loads(raw) for raw in pipe.hvals(keys.model_versions)), name=name,
                               adding=int(stored.get("stored_bytes") or 0))
                pipe.multi()
                if claimant is not None:
                    pipe.hset(keys.model_owners, name, claimant)
                pipe.hset(keys.model_versions, ref, json.dumps(stored))
                if make_latest:
                    pipe.hset(keys.model_latest, name, stored["version"])
                pipe.execute()
                return ModelRecord.of(stored)
            except redis.WatchError:
                continue  # a name was claimed or a version saved meanwhile; check again


FieldsOf = Callable[[ModelRecord], "dict[str, Any] | None"]
"""Fields to merge into a record, computed from the record as it is (None: leave it as it is)."""


def update_model_version(store: Store, ref: str, fields: dict[str, Any] | FieldsOf) -> ModelRecord:
    """Merge `fields` into the record of `name@version` (read-modify-write under WATCH); `fields` may
    be a function of the record as it is then, in the same transaction (None: no change)."""
    with translate_redis_errors(), store.client.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(store.keys.model_versions)
                raw = pipe.hget(store.keys.model_versions, ref)
                if raw is None:
                    raise ModelNotFound(f"model version '{ref}' is not registered")
                current = json.loads(raw)
                update = fields(ModelRecord.of(current)) if callable(fields) else fields
                if update is None:
                    pipe.unwatch()
                    return ModelRecord.of(current)
                record = current | update
                pipe.multi()
                pipe.hset(store.keys.model_versions, ref, json.dumps(record))
                pipe.execute()
                return ModelRecord.of(record)
            except redis.WatchError:
                continue  # someone else wrote the hash meanwhile; read it again


NAMES_SHOWN = 20
"""The most registered names a ModelNotFound lists (the rest counted): its answer stays short however many
models are registered."""


def _glob(name: str) -> str:
    """`name` with the characters Redis's MATCH reads as a pattern escaped."""
    return "".join(f"\\{char}" if char in "*?[]\\" else char for char in name)


def get_model(store: Store, ref: str) -> ModelRecord:
    """The record of `name` (newest version) or `name@version`; ModelNotFound names what exists."""
    name, version = split_model_ref(ref)
    with translate_redis_errors():
        version = version or store.client.hget(store.keys.model_latest, name)
        raw = store.client.hget(store.keys.model_versions, f"{name}@{version}") if version else None
    if raw is None:
        names = list_model_names(store)
        known = ", ".join(names[:NAMES_SHOWN]) + (f" and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN
                                                 else "") if names else "none"
        what = f"model '{name}'" if version is None else f"model version '{name}@{version}'"
        raise ModelNotFound(f"{what} is not registered (registered models: {known}); "
                            "register it with POST /v1/models or `sitsctl model register`")
    return ModelRecord.of(json.loads(raw))


def version_exists(store: Store, ref: str) -> bool:
    """Whether `name@version` has a record."""
    with translate_redis_errors():
        return bool(store.client.hexists(store.keys.model_versions, ref))


def model_owners(store: Store) -> dict[str, str]:
    """Model name -> the tenant that owns it (names no tenant owns are absent)."""
    with translate_redis_errors():
        return dict(store.client.hgetall(store.keys.model_owners))


def list_model_names(store: Store) -> list[str]:
    """Names of all registered models."""
    with translate_redis_errors():
        return sorted(store.client.hkeys(store.keys.model_latest))


def list_model_versions(store: Store, name: str | None = None) -> list[ModelRecord]:
    """Every registered version (of `name` only, if given), oldest registration first, each saying
    whether it is its name's newest (`latest`)."""
    with translate_redis_errors():
        if name is None:
            raws = store.client.hvals(store.keys.model_versions)
        else:  # (its own versions' records only: a name's versions cost no read of every tenant's)
            raws = [raw for _, raw in store.client.hscan_iter(store.keys.model_versions, match=f"{_glob(name)}@*",
                                                                 count=1000)]
        latest = store.client.hgetall(store.keys.model_latest)
    records = [ModelRecord.of(json.loads(raw)) for raw in raws]
    if name is not None:
        records = [record for record in records if record.name == name]
    records = [record.replace(latest=latest.get(record.name) == record.version) for record in records]
    # (versions of one repository load share their time: by number then)
    return sorted(records, key=lambda record: (record.name, record.registered_at or 0, record.version.zfill(20)))


def own_names_by_tenant(store: Store) -> int:
    """Move model names owned by a key's name (as names were before they were their tenant's) to that
    key's tenant; returns how many names changed. Done once per store (`keys.model_owners_by_tenant`
    marks it), since afterwards an owner is a tenant, and a tenant may share its name with a key of
    another. An owner that names no key but is a key's tenant stays. One that is the name of no key,
    or of keys of several tenants (made before key names were unique), becomes no tenant's: admin
    keys alone add versions to it, as to a name an admin registered, rather than a guess handing it
    to one of them."""
    keys = store.keys
    with translate_redis_errors(), store.client.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(keys.model_owners, keys.api_keys, keys.model_owners_by_tenant)
                if pipe.exists(keys.model_owners_by_tenant):
                    pipe.unwatch()
                    return 0
                tenants_of = _tenants_by_key_name(pipe.hvals(keys.api_keys))
                known_tenants = set().union(*tenants_of.values())
                moved = {name: tenants_of.get(owner) or ({owner} & known_tenants)
                         for name, owner in pipe.hgetall(keys.model_owners).items()}
                pipe.multi()
                changed = 0
                for name, tenants in moved.items():
                    if len(tenants) == 1:
                        pipe.hset(keys.model_owners, name, next(iter(tenants)))
                    else:
                        pipe.hdel(keys.model_owners, name)
                    changed += 1
                pipe.set(keys.model_owners_by_tenant, "1")
                pipe.execute()
                return changed
            except redis.WatchError:
                continue


def _tenants_by_key_name(stored: list[str]) -> dict[str, set[str]]:
    """Key name -> the tenants of the keys of that name (admin and metrics keys, no tenant's members, left out)."""
    tenants: dict[str, set[str]] = {}
    for raw in stored:
        try:
            identity = json.loads(raw)
        except ValueError:
            continue
        if isinstance(identity, dict) and identity.get("name") and identity.get("role") not in ("admin", "metrics"):
            tenants.setdefault(identity["name"], set()).add(identity.get("tenant") or identity["name"])
    return tenants
