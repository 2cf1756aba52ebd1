"""The API's side of A/B routing (`broker/models/routing.py`): who a call is for, which version its bare model
name goes to, and the `/v1/routes` resources.

A call's user is its `X-SITS-User` header, else its key's name; its group is its key's group, else its
`X-SITS-Group` header (a key's own group is not the client's to change).
"""

from __future__ import annotations

from typing import Any

from broker.errors import BadInput
from broker.models import registry, routing
from broker.models.routing import CallKind, RouteTable
from broker.state.store import Store
from broker.tenants.apikeys import GROUP_PATTERN

USER_HEADER = "X-SITS-User"
GROUP_HEADER = "X-SITS-Group"

_TABLE = RouteTable()
"""This process's view of the stored routes, each model's read again within `routing.ROUTES_TTL_SECONDS`
(and only when a call names it: one tenant's routes cost no other model's calls anything)."""


def caller(identity: dict[str, Any], headers: Any) -> tuple[str, str | None]:
    """(user, group) of a call from its key's `identity` and its request `headers`."""
    user = (headers.get(USER_HEADER) or "").strip() or str(identity.get("name", ""))
    group = identity.get("group") or (headers.get(GROUP_HEADER) or "").strip() or None
    if group is not None and not GROUP_PATTERN.fullmatch(group):
        raise BadInput(f"{GROUP_HEADER} {group!r} must be letters, digits, '_', '.' or '-' (64 at most)")
    return user, group


def routed(store: Store, model: str, identity: dict[str, Any], headers: Any, call: CallKind) -> str:
    """The model ref a call names, as the routes send it (`routing.routed_ref`)."""
    if "@" in model:
        return model
    user, group = caller(identity, headers)
    return routing.routed_ref(_TABLE, store, model, user=user, group=group, call=call)


def put_route(store: Store, body: Any) -> dict[str, Any]:
    """Store a route from a request body, its versions checked against the registry; the route stored."""
    route = routing.parse_route(body)
    registry.get_model(store, route.model)  # ModelNotFound (404) for a name never registered
    versions = {record.version for record in registry.list_model_versions(store, route.model)}
    routing.save_route(store, route, known_versions=versions)
    _TABLE.forget(store, route.model)  # this process at once; the others within a second
    return routing.describe(route)


def delete_route(store: Store, model: str) -> None:
    """Remove the model's route (NotFound when it has none)."""
    routing.delete_route(store, model)
    _TABLE.forget(store, model)


def list_routes(store: Store) -> list[dict[str, Any]]:
    """Every stored route, by model name."""
    return [routing.describe(route) for _, route in sorted(routing.load_routes(store).items())]
