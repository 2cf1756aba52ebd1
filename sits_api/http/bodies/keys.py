"""`/v1/keys`: the body that makes a key, and the answers that show keys (never a digest)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from broker.tenants.apikeys import GROUP_PATTERN, KEY_NAME_PATTERN

Role = Literal["admin", "tenant-admin", "user", "viewer", "metrics"]
_GROUP_OR_EMPTY = f"^(|{GROUP_PATTERN.pattern})$"


class KeyCreation(BaseModel):
    """`POST /v1/keys`: a key for `name` (a tenant admin: of its own tenant, as tenant-admin, user or viewer)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=f"^{KEY_NAME_PATTERN.pattern}$", description="who it is for; a name belongs to "
                                                                           "one tenant")
    role: Role = "user"
    tenant: str = Field("", pattern=_GROUP_OR_EMPTY, description="default: the key's name (a tenant of one key)")
    group: str = Field("", pattern=_GROUP_OR_EMPTY, description="the user group its requests count in for A/B "
                                                                "routes")


class KeyMade(BaseModel):
    """A new key: the clear key is answered this once and kept nowhere."""

    key: str
    name: str
    role: Role
    tenant: str
    group: str | None


class KeyInfo(BaseModel):
    """A key's name, role, tenant and group."""

    name: str
    role: str | None
    tenant: str
    group: str | None


class KeyList(BaseModel):
    """`GET /v1/keys`: by name."""

    keys: list[KeyInfo]


class KeysRevoked(BaseModel):
    """`DELETE /v1/keys/{name}`: how many keys of that name were deleted."""

    revoked: int
