"""A/B routing: which version of a model a bare model name is sent to.

A route belongs to one model name and says, in order of precedence:

- `groups`: a user group (a key's group, or the `X-SITS-Group` header) -> the version its users get;
- `paths`: the kind of call (`v1` for `POST /v1/requests`, `v2` for the KServe v2 routes, `jobs` for
  `POST /v1/jobs`) -> the version those calls get;
- `split`: version -> weight (the weights sum to 1), for everyone else, sticky per user: a user's
  place in [0, 1) is a hash of the model and the user (the `X-SITS-User` header, else the key's
  name), so one user sees one arm for as long as the split stands, and a changed split moves only
  the users whose place crosses a boundary.

A name pinned to a version (`name@version`) is never routed. Routes are stored in Redis
(`keys.routes`) and read again by each process within `ROUTES_TTL_SECONDS`, so a change takes effect
within a second, with no restart. The choice (`choose_version`) is a pure function; `RouteTable` keeps
the stored routes a moment per process.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from broker.errors import BadInput, NotFound
from broker.state.store import Store, translate_redis_errors

CallKind = Literal["v1", "v2", "jobs"]
CALL_KINDS: tuple[CallKind, ...] = ("v1", "v2", "jobs")

ROUTES_TTL_SECONDS = 0.5
"""How long a process keeps the stored routes before reading them again."""

_WEIGHT_TOLERANCE = 1e-6


class Route(BaseModel):
    """One model's routing rules (see the module's docstring)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    split: dict[str, float] = Field(default_factory=dict)
    groups: dict[str, str] = Field(default_factory=dict)
    paths: dict[CallKind, str] = Field(default_factory=dict)

    @field_validator("split")
    @classmethod
    def _weights_sum_to_one(cls, split: dict[str, float]) -> dict[str, float]:
        if any(not math.isfinite(weight) or weight < 0 for weight in split.values()):
            raise ValueError(f"split weights must be numbers of 0 or more, got {split}")
        if split and abs(sum(split.values()) - 1.0) > _WEIGHT_TOLERANCE:
            raise ValueError(f"split weights must sum to 1, got {sum(split.values()):g} ({split})")
        return split

    @model_validator(mode="after")
    def _routes_somewhere(self) -> Route:
        if not (self.split or self.groups or self.paths):
            raise ValueError("a route needs a split, groups or paths; DELETE /v1/routes/{model} removes one")
        return self

    def versions(self) -> set[str]:
        """Every version the route may send to."""
        return set(self.split) | set(self.groups.values()) | set(self.paths.values())


def parse_route(body: Any) -> Route:
    """A route from a request body; BadInput saying what is wrong."""
    if not isinstance(body, dict):
        raise BadInput('a route is a JSON object, e.g. {"model": "convnet", "split": {"<version>": 0.8, '
                       '"<other version>": 0.2}}')
    try:
        return Route.model_validate(body)
    except ValidationError as err:
        raise BadInput.from_validation(err, "route", "invalid route: ") from err


def place(model: str, user: str) -> float:
    """The user's sticky place in [0, 1) for the model's split."""
    digest = hashlib.sha256(f"{model}\x00{user}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def choose_version(route: Route | None, *, user: str, group: str | None, call: CallKind) -> str | None:
    """The version `route` sends this call to, or None (no route, or no rule applies: the newest version
    serves it). Groups first, then the kind of call, then the user's place in the split."""
    if route is None:
        return None
    if group is not None and group in route.groups:
        return route.groups[group]
    if call in route.paths:
        return route.paths[call]
    if not route.split:
        return None
    at, edge = place(route.model, user), 0.0
    arms = sorted(route.split.items())
    for version, weight in arms:
        edge += weight
        if at < edge:
            return version
    return next(version for version, weight in reversed(arms) if weight > 0)  # (rounding: the last arm)


def save_route(store: Store, route: Route, *, known_versions: set[str]) -> None:
    """Store `route` (replacing the model's route); BadInput naming a version that is not registered."""
    unknown = sorted(route.versions() - known_versions)
    if unknown:
        raise BadInput(f"model '{route.model}' has no version {', '.join(unknown)}; registered: "
                       f"{', '.join(sorted(known_versions)) or 'none'}")
    with translate_redis_errors():
        store.client.hset(store.keys.routes, route.model, route.model_dump_json())


def delete_route(store: Store, model: str) -> None:
    """Remove the model's route; NotFound when it has none."""
    with translate_redis_errors():
        removed = store.client.hdel(store.keys.routes, model)
    if not removed:
        raise NotFound(f"model '{model}' has no route; GET /v1/routes lists them")


def load_routes(store: Store) -> dict[str, Route]:
    """Every stored route by model name."""
    with translate_redis_errors():
        raw = store.client.hgetall(store.keys.routes)
    return {model: Route.model_validate(json.loads(text)) for model, text in raw.items()}


class RouteTable:
    """The stored routes, read again when older than `ttl_seconds` (a process's view of `keys.routes`,
    kept per store, and forgotten with it). Thread-safe; `clock` is passed in for tests."""

    def __init__(self, ttl_seconds: float = ROUTES_TTL_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_seconds = ttl_seconds
        self._clock = clock
        self._read: weakref.WeakKeyDictionary[Store, tuple[float, Mapping[str, Route]]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def route(self, store: Store, model: str) -> Route | None:
        """The model's route as stored at most `ttl_seconds` ago."""
        with self._lock:
            read_at, routes = self._read.get(store, (-math.inf, {}))
            if self._clock() - read_at > self.ttl_seconds:
                routes = load_routes(store)
                self._read[store] = (self._clock(), routes)
            return routes.get(model)

    def forget(self, store: Store) -> None:
        """Read the routes again at the next call (this process just changed them)."""
        with self._lock:
            self._read.pop(store, None)


def routed_ref(table: RouteTable, store: Store, model_ref: str, *, user: str, group: str | None,
               call: CallKind) -> str:
    """`model_ref` as the routes send it: a bare name with a route that applies becomes `name@version`;
    a pinned ref, or a name without one, is returned as it is."""
    if "@" in model_ref:
        return model_ref
    version = choose_version(table.route(store, model_ref), user=user, group=group, call=call)
    return model_ref if version is None else f"{model_ref}@{version}"


def describe(route: Route) -> dict[str, Any]:
    """A route as the API shows it."""
    return route.model_dump()
