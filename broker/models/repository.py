"""Models of a Triton model repository: their state in Redis, and what a version loaded from one carries.

A model folder of a repository (`repository.paths`) is READY (its selected versions are registered
under its name), UNAVAILABLE with the reason its config or graph was refused, or UNLOADED (by
`POST /v2/repository/models/{m}/unload`). The state lives in one hash (`keys.model_repository`), so
every API process answers the repository index alike. A loaded version's registry record carries its
config as loaded and what SITS takes from it (`RepositoryServing`), so every process and worker reads
the same batching, queue policy and priority levels. docs/models.md, "A Triton model repository".
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from broker.models.model_record import ModelRecord
from broker.state.store import Store, translate_redis_errors

RepositoryState = Literal["READY", "UNAVAILABLE", "UNLOADED"]
SERVING_KEY = "repository"
"""The record field of a version loaded from a repository (`RepositoryServing.to_json`)."""
SITS_LEVELS = 16
"""Triton priority p is SITS level 16 - p, as the v2 `priority` parameter maps it."""


@dataclass(frozen=True)
class RepositoryModel:
    """One model folder of a repository and where its loading stands."""

    name: str
    state: RepositoryState
    reason: str = ""
    """Why it is UNAVAILABLE (the refusal, naming the field), or 'unloaded'; for a READY one, why its last
    load again failed (its versions stay)."""
    versions: list[str] = field(default_factory=list)
    """The versions registered from it (READY)."""
    folder: str = ""
    updated_at: float = 0.0

    @classmethod
    def of(cls, stored: dict[str, Any]) -> RepositoryModel:
        """The entry of its stored JSON."""
        return cls(name=str(stored["name"]), state=stored["state"], reason=str(stored.get("reason", "")),
                   versions=[str(v) for v in stored.get("versions", [])], folder=str(stored.get("folder", "")),
                   updated_at=float(stored.get("updated_at", 0.0)))


def save_state(store: Store, entry: RepositoryModel) -> None:
    """Store `entry` as its model's state."""
    with translate_redis_errors():
        store.client.hset(store.keys.model_repository, entry.name, json.dumps(asdict(entry)))


def get_state(store: Store, name: str) -> RepositoryModel | None:
    """The state of repository model `name`; None for a name no repository load has seen."""
    with translate_redis_errors():
        raw = store.client.hget(store.keys.model_repository, name)
    return RepositoryModel.of(json.loads(raw)) if raw else None


def list_states(store: Store) -> list[RepositoryModel]:
    """Every repository model's state, by name."""
    with translate_redis_errors():
        raws = store.client.hvals(store.keys.model_repository)
    return sorted((RepositoryModel.of(json.loads(raw)) for raw in raws), key=lambda entry: entry.name)


def remove_versions(store: Store, name: str, keep: list[str]) -> None:
    """Take the versions of `name` loaded from a repository and not in `keep` out of the registry, and
    `name` itself when none of its versions is left, so that requests for them are refused as for a
    model never registered (an unload, a failed load, or a version its `version_policy` no longer
    selects). A version registered through `POST /v1/models` is never touched. Queued requests of a
    removed version fail when a worker finds no record."""
    keys = store.keys
    with translate_redis_errors():
        stored = store.client.hgetall(keys.model_versions)
        ours = {ref: json.loads(raw) for ref, raw in stored.items() if ref.partition("@")[0] == name}
        removed = [ref for ref, record in ours.items()
                   if SERVING_KEY in record and ref.partition("@")[2] not in keep]
        left = [ref.partition("@")[2] for ref in ours if ref not in removed]
        latest = store.client.hget(keys.model_latest, name)
        with store.client.pipeline(transaction=True) as pipe:
            if removed:
                pipe.hdel(keys.model_versions, *removed)
            if ours and not left:
                pipe.hdel(keys.model_latest, name)
            elif left and latest not in left:  # the newest left is its name's latest
                pipe.hset(keys.model_latest, name, max(left, key=lambda v: int(v) if v.isdigit() else -1))
            pipe.execute()


@dataclass(frozen=True)
class RepositoryServing:
    """What SITS takes from the config of a version loaded from a repository."""

    config: dict[str, Any]
    """The config as loaded (Triton's JSON of it), as `GET /v2/models/{m}/config` answers."""
    max_batch_size: int
    """Triton's: > 0, requests carry a batch axis of at most this many rows; 0, no batch axis."""
    priority_levels: int
    default_priority_level: int
    online: dict[str, Any]
    """The `online.models.<name>` keys it sets (`broker.online.settings.ModelBatching`)."""

    @classmethod
    def of(cls, record: ModelRecord) -> RepositoryServing | None:
        """The serving settings of `record`; None for a version registered through `POST /v1/models`."""
        stored = record.extra.get(SERVING_KEY)
        if not isinstance(stored, dict):
            return None
        return cls(config=dict(stored.get("config") or {}), max_batch_size=int(stored.get("max_batch_size", 0)),
                   priority_levels=int(stored.get("priority_levels", 0)),
                   default_priority_level=int(stored.get("default_priority_level", 0)),
                   online=dict(stored.get("online") or {}))

    def to_json(self) -> dict[str, Any]:
        """The record field that holds it."""
        return asdict(self)

    def level_of(self, priority: int) -> int:
        """The SITS level of a request's Triton `priority`: p is level 16 - p; 0, or one past the config's
        `priority_levels`, is its `default_priority_level`, as Triton takes it; without priority levels
        every request is alike (level 0)."""
        if not self.priority_levels:
            return 0
        chosen = priority if 1 <= priority <= self.priority_levels else self.default_priority_level
        return SITS_LEVELS - chosen
