"""The bodies of Triton's model repository extension as `/v2/repository` answers them (the routes are
`sits_api.v2.repository`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, RootModel


class RepositoryIndexEntry(BaseModel):
    """One model version of the repository index (a model with no loaded version has no `version`)."""

    name: str
    version: str | None = None
    state: Literal["READY", "UNAVAILABLE"]
    reason: str
    """Why it is UNAVAILABLE: the refusal of its config or graph, naming the field, or 'unloaded'."""


class RepositoryIndex(RootModel[list[RepositoryIndexEntry]]):
    """`POST /v2/repository/index`: every model of the repository."""


class RepositoryDone(BaseModel):
    """`POST /v2/repository/models/{name}/load` and `/unload`: done (an empty object, as Triton answers)."""

    model_config = ConfigDict(extra="forbid")
