"""The API's side of tenants: which tenant a call acts for, what its record lets it do, and the
`/v1/tenants`, `/v1/keys` and `/v1/usage` resources.

A key belongs to one tenant (`broker/tenants/apikeys.py`); a tenant's record (`broker/tenants/records.py`) may narrow
the models its keys use and cap its unanswered requests (`max_queued`), their inputs' bytes
(`max_queued_bytes`) and its active jobs (`max_inflight`). A tenant with no record has no share, and the
default caps (`UNRECORDED`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from broker.config.settings import Settings
from broker.errors import BadInput, Conflict, Forbidden, NotFound, PriorityNotAllowed, TierNotAllowed
from broker.models.registry import ModelRoom
from broker.setting_types import MAX_PRIORITY
from broker.state.store import Store, translate_redis_errors
from broker.tenants import apikeys
from broker.tenants import records as tenants
from broker.tenants import usage as tenant_usage
from broker.tenants.records import TenantTable
from broker.tenants.settings import UNCAPPED, UNRECORDED, Tenant


def tenant_of(identity: dict[str, Any]) -> str:
    """The tenant a call's work is billed to and shares the fleet as."""
    return str(identity.get("tenant") or identity.get("name") or "")


def check_model(table: TenantTable, store: Store, identity: dict[str, Any], model: str) -> Tenant | None:
    """The caller's tenant's record (None when it has none), after checking that it may use `model`;
    Forbidden naming the models it may use when not."""
    found = table.tenant(store, tenant_of(identity))
    if found is not None and not found.allows_model(model):
        raise Forbidden(f"tenant '{tenant_of(identity)}' may use only the models {', '.join(found.models)}; "
                        f"'{model.split('@', 1)[0]}' is not one of them (tenants.<name>.models)")
    return found


def caps_of(identity: dict[str, Any], tenant: Tenant | None) -> Tenant:
    """The record whose caps (`max_queued`, `max_queued_bytes`, `max_inflight`) hold for the caller: its
    tenant's, else the defaults (`UNRECORDED`), which an admin key's tenant without a record is spared
    (`UNCAPPED`)."""
    if tenant is not None:
        return tenant
    return UNCAPPED if identity.get("role") == "admin" else UNRECORDED


def model_room(table: TenantTable, store: Store, identity: dict[str, Any]) -> ModelRoom | None:
    """The stored models the caller's tenant may hold (`max_model_versions`, `max_model_bytes`); None for an
    admin key, whose registrations are not capped."""
    if identity.get("role") == "admin":
        return None
    caps = caps_of(identity, table.tenant(store, tenant_of(identity)))
    return ModelRoom(tenant_of(identity), caps.max_model_versions, caps.max_model_bytes)


def check_entitlements(identity: dict[str, Any], tenant: Tenant | None, *, priority: int,
                       user_tier: str | None = None) -> None:
    """Refuse work that asks more than the caller's tenant may: a priority above its `max_priority`
    (PriorityNotAllowed), a `user_tier` outside its `user_tiers` (TierNotAllowed; `free`, every
    request's default and the tier that weighs least, is every tenant's); both 403s whose message
    names the cap. A tenant without a record has the default entitlements: every priority and tier."""
    if tenant is None:
        return
    name = tenant_of(identity)
    if priority > tenant.max_priority:
        raise PriorityNotAllowed(f"tenant '{name}' may ask priority {tenant.max_priority} at most "
                                 f"(tenants.{name}.max_priority), not {priority}; ask {tenant.max_priority} or less")
    if user_tier not in (None, "free") and tenant.user_tiers is not None and user_tier not in tenant.user_tiers:
        allowed = ", ".join(dict.fromkeys(("free", *tenant.user_tiers)))
        raise TierNotAllowed(f"tenant '{name}' may name the user tiers {allowed} (tenants.{name}.user_tiers), "
                             f"not '{user_tier}'")


def priority_cap(tenant: Tenant | None) -> int:
    """The highest level the caller's work may reach: what it may ask (`check_entitlements`), and so
    what neither its deadlines nor PSA jumps may raise it past (`scoring.Factors.max_level`). A tenant
    without a record has every priority (15)."""
    return MAX_PRIORITY if tenant is None else tenant.max_priority


def put_tenant(table: TenantTable, store: Store, name: str, body: Any) -> dict[str, Any]:
    """Store a tenant from a request body, checked with the others; the tenant stored."""
    tenant = tenants.parse_tenant(name, body)
    tenants.save_tenants(store, {name: tenant}, configured=table.configured)
    table.forget(store)  # this process at once; the others within a second
    return tenants.describe(name, tenant, configured=table.configured)


def delete_tenant(table: TenantTable, store: Store, name: str) -> None:
    """Remove a tenant's record (NotFound when it has none)."""
    tenants.delete_tenant(store, name, configured=table.configured)
    table.forget(store)


def list_tenants(table: TenantTable, store: Store) -> list[dict[str, Any]]:
    """Every tenant in force, by name."""
    table.forget(store)
    return [tenants.describe(name, tenant, configured=table.configured)
            for name, tenant in table.tenants(store).items()]


def get_tenant(table: TenantTable, store: Store, name: str) -> dict[str, Any]:
    """One tenant's record; NotFound when it has none."""
    table.forget(store)
    found = table.tenant(store, name)
    if found is None:
        raise tenants.tenant_not_found(name)
    return tenants.describe(name, found, configured=table.configured)


def usage(settings: Settings, store: Store, identity: dict[str, Any], query: Mapping[str, str], *,
          now: float) -> dict[str, Any]:
    """`GET /v1/usage`: the chargeback rows the query asks for (`tenant_usage.usage_report`). `from` and
    `to` are UTC dates (default: today), `by` one of `tenant_usage.BREAKDOWNS` (default `tenant`),
    `tenant` one tenant (default: every tenant for an admin key, its own for any other, which may name
    no other: a 404, as for a tenant that does not exist). Each row carries its tenant's `tier`, for
    bills by tier."""
    by = (query.get("by") or "tenant").strip()
    if by not in tenant_usage.BREAKDOWNS:
        raise BadInput(f"by must be one of {', '.join(tenant_usage.BREAKDOWNS)}, got {by!r}")
    today = tenant_usage.day_number(now)
    last_day = tenant_usage.parse_day(query.get("to"), "to", today)
    first_day = tenant_usage.parse_day(query.get("from"), "from", last_day)
    asked = (query.get("tenant") or "").strip() or None
    if identity.get("role") == "admin":
        names = [asked] if asked else tenant_usage.billed_tenants(store)
    else:
        own = tenant_of(identity)
        if asked not in (None, own):
            raise NotFound(f"no usage of tenant '{asked}' for this key; leave out tenant= for your own ('{own}')")
        names = [own]
    prices = dict(settings.fair_share.price_per_device_hour)
    rows = tenant_usage.report_for_key(store, identity, names, first_day=first_day, last_day=last_day,
                                       by=by, prices=prices)  # type: ignore[arg-type]
    in_force = tenants.effective(tenants.load_tenants(store), settings.tenants)
    rows = [{"tenant": row["tenant"], "tier": (in_force.get(row["tenant"]) or UNRECORDED).tier,
             **{name: value for name, value in row.items() if name != "tenant"}} for row in rows]
    return {"from": tenant_usage.day_text(first_day), "to": tenant_usage.day_text(last_day), "by": by,
            "currency": settings.fair_share.currency, "price_per_device_hour": prices, "usage": rows}


TENANT_ADMIN_MAY_CREATE = ("tenant-admin", "user", "viewer")
"""The roles a tenant admin may give its tenant's new keys."""


def create_key(store: Store, identity: dict[str, Any], body: Any) -> dict[str, Any]:
    """`POST /v1/keys`: a new key from `{name, role, tenant, group}` (role `user`, tenant the name, by
    default). An admin makes any key; a tenant admin keys of its own tenant, of the roles
    `TENANT_ADMIN_MAY_CREATE`; anyone else none. The clear key is in the answer, once."""
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        raise BadInput('a key is a JSON object with a "name", e.g. {"name": "alice", "role": "user", '
                       '"tenant": "acme"}')
    unknown = sorted(set(body) - {"name", "role", "tenant", "group"})
    if unknown:
        raise BadInput(f"unknown field(s) {', '.join(unknown)}: a key has name, role, tenant and group")
    role, group = body.get("role", "user"), body.get("group", "")
    tenant = body.get("tenant") or ""
    if not all(isinstance(value, str) for value in (role, group, tenant)):
        raise BadInput("role, tenant and group must be strings")
    if identity.get("role") != "admin":
        own = tenant_of(identity)
        if identity.get("role") != "tenant-admin":
            raise Forbidden(f"key '{identity.get('name')}' has the '{identity.get('role')}' role: only admin and "
                            "tenant-admin keys make keys")
        if (tenant or body["name"]) != own:
            raise Forbidden(f"a tenant admin makes keys of its own tenant ('{own}') only; give \"tenant\": \"{own}\"")
        if role not in TENANT_ADMIN_MAY_CREATE:
            raise Forbidden(f"a tenant admin gives keys the roles {', '.join(TENANT_ADMIN_MAY_CREATE)}, not '{role}'")
    try:
        key = apikeys.create_api_key(store, body["name"], role, group, tenant)
    except ValueError as err:
        raise BadInput(str(err)) from err
    return {"key": key, "name": body["name"], "role": role, "tenant": tenant or body["name"], "group": group or None}


def keys_visible(store: Store, identity: dict[str, Any]) -> list[dict[str, Any]]:
    """`GET /v1/keys`: every key to an admin, its tenant's to a tenant admin (Forbidden to others)."""
    if identity.get("role") == "admin":
        return apikeys.list_api_keys(store)
    if identity.get("role") == "tenant-admin":
        return apikeys.list_api_keys(store, tenant_of(identity), members_only=True)
    raise Forbidden(f"key '{identity.get('name')}' has the '{identity.get('role')}' role: only admin and "
                    "tenant-admin keys list keys")


def revoke_keys(store: Store, identity: dict[str, Any], name: str, tenant: str | None = None) -> tuple[int, str | None]:
    """`DELETE /v1/keys/{name}`: delete the keys of that name (a tenant admin: only its tenant's; an admin: those of
    `tenant` where given, else of every tenant); how many, and the tenant they were of (None: any).
    NotFound when there are none it may delete, and for a tenant admin naming another tenant."""
    if identity.get("role") not in ("admin", "tenant-admin"):
        raise Forbidden(f"key '{identity.get('name')}' has the '{identity.get('role')}' role: only admin and "
                        "tenant-admin keys revoke keys")
    scope = tenant if identity.get("role") == "admin" else tenant_of(identity)
    if identity.get("role") != "admin" and tenant not in (None, scope):
        raise NotFound(f"no key named '{name}' in tenant '{tenant}'")  # (as for a tenant without keys)
    if scope is None:  # an admin's, of every tenant: only where the name is one tenant's (or the admins') alone
        holders = sorted({("admin keys" if key["role"] in apikeys.TENANTLESS_ROLES else f"tenant '{key['tenant']}'")
                          for key in apikeys.list_api_keys(store) if key["name"] == name})
        if len(holders) > 1:
            raise Conflict(f"keys named '{name}' belong to {', '.join(holders)}: name the one whose keys to revoke "
                           f"with ?tenant= (an admin key's tenant is its own name)")
    revoked = apikeys.revoke_api_keys(store, name, scope, members_only=identity.get("role") != "admin")
    if not revoked:
        raise NotFound(f"no key named '{name}'" + (f" in tenant '{scope}'" if scope else ""))
    return revoked, scope


def may_route(store: Store, identity: dict[str, Any], model: str) -> bool:
    """May the caller set or remove `model`'s A/B route? An admin any model's; a tenant admin those whose
    name its tenant owns (registered first by one of its tenant's keys: `registry`)."""
    if identity.get("role") == "admin":
        return True
    if identity.get("role") != "tenant-admin":
        return False
    with translate_redis_errors():
        owner = store.client.hget(store.keys.model_owners, model)
    return apikeys.owns_name(identity, owner)


def check_route_access(store: Store, identity: dict[str, Any], model: str) -> None:
    """Forbidden unless the caller may route `model` (`may_route`)."""
    if not may_route(store, identity, model):
        raise Forbidden(f"key '{identity.get('name')}' may not route model '{model}': routes are set by admin keys, "
                        "and by tenant-admin keys for the model names their tenant registered")
