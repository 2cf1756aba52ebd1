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
(`keys.routes`, one field per model name) and read again by each process within `ROUTES_TTL_SECONDS`,
so a change takes effect within a second, with no restart. The choice (`choose_version`) is a pure
function; `RouteTable` keeps each model's stored route a moment per process.

A route is read on every bare-name call of its model from any tenant, so what one costs to read is held
down where it is written and where it is read: at most `MAX_GROUPS` groups (each a `GROUP_PATTERN` name,
as a key's group is) and `MAX_SPLIT_ARMS` arms, versions of `MAX_VERSION_CHARS`, and `MAX_ROUTE_BYTES`
stored; a call reads only its own model's route (one HSTRLEN and one HGET per model and process every
`ROUTES_TTL_SECONDS`), never the others', and no lock is held while it reads. A tenant holds one route
per model name it owns, so its names bound its routes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from broker.errors import BadInput, NotFound
from broker.state.store import Store, translate_redis_errors
from broker.tenants.apikeys import GROUP_PATTERN

log = logging.getLogger(__name__)

CallKind = Literal["v1", "v2", "jobs"]
CALL_KINDS: tuple[CallKind, ...] = ("v1", "v2", "jobs")

ROUTES_TTL_SECONDS = 0.5
"""How long a process keeps a model's stored route before reading it again."""

MAX_GROUPS = 256
"""The most user groups one route names. A group is a key's group (or a header naming one): a few per
model in practice; each one is bytes every process reads back with the route."""

MAX_SPLIT_ARMS = 32
"""The most versions one split weighs. An A/B/n test has a handful of arms; 32 leaves room for a wide
one, and each arm names a registered version anyway."""

MAX_VERSION_CHARS = 128
"""The longest version a route names: versions are content hashes or repository version numbers, far
shorter, so this only keeps a route's size bounded before the registry is asked."""

MAX_ROUTE_BYTES = 64 * 1024
"""The most a route may take stored (its JSON, UTF-8). The caps above keep a route of plain-letter versions
under it (256 groups of 64-character names and 128-character versions, 32 arms, 3 paths: about 56 KiB);
it holds the rest, and a route stored before the caps, which is not read past its size (`_read_one`)."""

MAX_CACHED_MODELS = 1024
"""The most model names whose route (or lack of one) a `RouteTable` keeps per store: bare names are the
callers' to choose, so the least recently asked are forgotten past it."""

MODEL_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""What a routed model name may be: a name outside it has no route, and is not looked up."""

_WEIGHT_TOLERANCE = 1e-6

Version = Annotated[str, StringConstraints(min_length=1, max_length=MAX_VERSION_CHARS)]

_STORED = "stored"
"""Validation context of a route read back from Redis: the caps are for writes, so a route stored before
them keeps working (its size is bounded by `MAX_ROUTE_BYTES` when read)."""


def _stored(info: ValidationInfo) -> bool:
    return bool(info.context and info.context.get(_STORED))


class Route(BaseModel):
    """One model's routing rules (see the module's docstring)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(..., pattern=f"^{MODEL_PATTERN.pattern}$")
    split: dict[Version, float] = Field(default_factory=dict)
    groups: dict[str, Version] = Field(default_factory=dict)
    paths: dict[CallKind, Version] = Field(default_factory=dict)

    @field_validator("split", mode="before")
    @classmethod
    def _few_arms(cls, split: Any, info: ValidationInfo) -> Any:
        # (before the entries are parsed: a body of many is refused by its count alone)
        if isinstance(split, dict) and len(split) > MAX_SPLIT_ARMS and not _stored(info):
            raise ValueError(f"a split weighs {MAX_SPLIT_ARMS} versions at most, got {len(split)}")
        return split

    @field_validator("groups", mode="before")
    @classmethod
    def _few_groups(cls, groups: Any, info: ValidationInfo) -> Any:
        if isinstance(groups, dict) and len(groups) > MAX_GROUPS and not _stored(info):
            raise ValueError(f"a route names {MAX_GROUPS} user groups at most, got {len(groups)}; give the "
                             "users of one arm one group (a key's --group, or the X-SITS-Group header)")
        return groups

    @field_validator("groups")
    @classmethod
    def _group_names(cls, groups: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        bad = [name for name in groups if not GROUP_PATTERN.fullmatch(name)]
        if bad and not _stored(info):
            raise ValueError(f"group {bad[0][:80]!r} must be letters, digits, '_', '.' or '-' (64 at most), "
                             "as a key's group is")
        return groups

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
    """Store `route` (replacing the model's route); BadInput naming a version that is not registered, or
    for a route over `MAX_ROUTE_BYTES` stored."""
    text = route.model_dump_json()
    if len(text.encode()) > MAX_ROUTE_BYTES:
        raise BadInput(f"route: the route of model '{route.model}' takes {len(text.encode())} bytes, over the "
                       f"{MAX_ROUTE_BYTES} a route may (MAX_ROUTE_BYTES); name fewer groups or split arms")
    unknown = sorted(route.versions() - known_versions)
    if unknown:
        raise BadInput(f"model '{route.model}' has no version {', '.join(unknown)}; registered: "
                       f"{', '.join(sorted(known_versions)) or 'none'}")
    with translate_redis_errors():
        store.client.hset(store.keys.routes, route.model, text)


def delete_route(store: Store, model: str) -> None:
    """Remove the model's route; NotFound when it has none."""
    with translate_redis_errors():
        removed = store.client.hdel(store.keys.routes, model)
    if not removed:
        raise NotFound(f"model '{model}' has no route; GET /v1/routes lists them")


def _stored_route(text: str) -> Route:
    return Route.model_validate(json.loads(text), context={_STORED: True})


def _ignore_oversize(model: str, size: int) -> None:
    """A stored route over `MAX_ROUTE_BYTES` (stored before routes were capped) is not followed: its model's
    bare name goes to its newest version, as without a route, so that no caller learns of it (another
    tenant's calls of the name answer as for any model), and its owner is told in the log."""
    log.warning("model '%s' has a stored route of %d bytes, over the %d a route may take (stored before routes "
                "were capped): it is not followed; PUT a smaller route or DELETE /v1/routes/%s", model, size,
                MAX_ROUTE_BYTES, model)


def _read_one(store: Store, model: str) -> tuple[Route | None, int]:
    """(the model's stored route or None, 0), or (None, its size) for one over `MAX_ROUTE_BYTES`, which is
    not read: its size is asked first, so no stored route costs a caller more than the cap."""
    with translate_redis_errors():
        size = int(store.client.hstrlen(store.keys.routes, model))
        if size > MAX_ROUTE_BYTES:
            return None, size
        text = store.client.hget(store.keys.routes, model) if size else None
    return (None if text is None else _stored_route(text)), 0


def load_routes(store: Store) -> dict[str, Route]:
    """Every stored route by model name, but those over `MAX_ROUTE_BYTES` (stored before the cap; not
    followed): their sizes are asked first, so a listing reads none of them."""
    with translate_redis_errors():
        models = store.client.hkeys(store.keys.routes)
        with store.client.pipeline(transaction=False) as pipe:
            for model in models:
                pipe.hstrlen(store.keys.routes, model)
            sizes = pipe.execute()
        readable = [model for model, size in zip(models, sizes, strict=True) if 0 < int(size) <= MAX_ROUTE_BYTES]
        texts = store.client.hmget(store.keys.routes, readable) if readable else []
    return {model: _stored_route(text) for model, text in zip(readable, texts, strict=True) if text is not None}


@dataclass(frozen=True)
class _Kept:
    """One model's route as a `RouteTable` read it (None for none, or one over `MAX_ROUTE_BYTES`), and when."""

    read_at: float
    route: Route | None


@dataclass
class _StoreView:
    """A `RouteTable`'s routes of one store, least recently asked first; `generation` counts `forget`s,
    so a read that began before one is not kept."""

    models: OrderedDict[str, _Kept] = field(default_factory=OrderedDict)
    generation: int = 0


class RouteTable:
    """The stored routes, each model's read again when older than `ttl_seconds` (a process's view of
    `keys.routes`, kept per store, and forgotten with it), for at most `max_models` names per store.
    Thread-safe: the lock guards only the kept routes, never a Redis read, so a slow read (Redis busy)
    holds up only its own call, not the process's other calls of other models; `clock` is passed in for
    tests."""

    def __init__(self, ttl_seconds: float = ROUTES_TTL_SECONDS, clock: Callable[[], float] = time.monotonic,
                 max_models: int = MAX_CACHED_MODELS) -> None:
        self.ttl_seconds = ttl_seconds
        self.max_models = max_models
        self._clock = clock
        self._views: weakref.WeakKeyDictionary[Store, _StoreView] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def route(self, store: Store, model: str) -> Route | None:
        """The model's route as stored at most `ttl_seconds` ago (one HSTRLEN and one HGET when it is
        older; none for a name no route may have). None for a stored route over `MAX_ROUTE_BYTES` (logged
        at each read); ConnectionLost, as any read, when Redis is away (nothing is kept then)."""
        if not MODEL_PATTERN.fullmatch(model):
            return None
        with self._lock:
            view = self._views.setdefault(store, _StoreView())
            kept, generation = view.models.get(model), view.generation
            if kept is not None:
                view.models.move_to_end(model)
        if kept is None or self._clock() - kept.read_at > self.ttl_seconds:
            kept = self._read(store, model)
            with self._lock:
                view = self._views.setdefault(store, _StoreView())
                if view.generation == generation:
                    view.models[model] = kept
                    view.models.move_to_end(model)
                    while len(view.models) > self.max_models:
                        view.models.popitem(last=False)
        return kept.route

    def _read(self, store: Store, model: str) -> _Kept:
        read_at = self._clock()
        route, oversize = _read_one(store, model)
        if oversize:
            _ignore_oversize(model, oversize)
        return _Kept(read_at, route)

    def forget(self, store: Store, model: str | None = None) -> None:
        """Read `model`'s route (every route, without one) again at the next call (this process just
        changed it)."""
        with self._lock:
            view = self._views.setdefault(store, _StoreView())
            view.generation += 1
            if model is None:
                view.models.clear()
            else:
                view.models.pop(model, None)


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
