"""The API's side of tenants: which tenant a call acts for, what its record lets it do, and the
`/v1/tenants` and `/v1/usage` resources.

A key belongs to one tenant (`broker/apikeys.py`); a tenant's record (`broker/tenants.py`) may narrow
the models its keys use and cap its unanswered requests (`max_queued`) and active jobs
(`max_inflight`). A tenant with no record has no caps and no share.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from broker import tenant_usage, tenants
from broker.config import Settings
from broker.errors import BadInput, Forbidden, NotFound
from broker.store import Store
from broker.tenant_settings import Tenant
from broker.tenants import TenantTable


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
    no other: a 404, as for a tenant that does not exist)."""
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
    rows = tenant_usage.usage_report(store, names, first_day=first_day, last_day=last_day, by=by,  # type: ignore[arg-type]
                                     prices=prices)
    return {"from": tenant_usage.day_text(first_day), "to": tenant_usage.day_text(last_day), "by": by,
            "currency": settings.fair_share.currency, "price_per_device_hour": prices, "usage": rows}
