"""Who is calling over gRPC: the bearer key in the `authorization` metadata, checked as HTTP checks
the `Authorization` header (`sits_api.tenancy.auth`): against Redis, trusted a few seconds per
process, and refused where its role may not go."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from broker.errors import Forbidden
from broker.tenants.apikeys import require_role
from sits_api.state import AppState

CallKind = Literal["read", "statistics", "infer", "admin"]
"""What a call does: reads a model's description, reads the statistics (a `metrics` key's one call),
submits work (which a `viewer` key may not), or changes what every tenant is served (admins only)."""


def bearer_key(metadata: Mapping[str, str]) -> str | None:
    """The key of `authorization: Bearer <key>` (gRPC metadata keys are lower case); None without one."""
    scheme, _, credentials = (metadata.get("authorization") or "").partition(" ")
    return credentials.strip() if scheme.lower() == "bearer" else None


def identity_of(state: AppState, metadata: Mapping[str, str], call: CallKind) -> dict[str, Any]:
    """The caller's {name, role, tenant}; Unauthorized for a missing or unknown key, Forbidden where its
    role may not make `call`. Blocking (a Redis read when the key is not trusted yet)."""
    identity = state.known_keys.identity(state.store, bearer_key(metadata))
    role = identity.get("role")
    if call in ("statistics", "admin"):
        require_role(identity, "metrics" if call == "statistics" else "admin")
    elif role == "metrics":
        raise Forbidden(f"key '{identity.get('name')}' has the 'metrics' role: it may only read GET /metrics "
                        "and the v2 model statistics (GET /v2/models/stats, or ModelStatistics over gRPC)")
    elif role == "viewer" and call == "infer":
        raise Forbidden(f"key '{identity.get('name')}' has the 'viewer' role: it reads its tenant's work and "
                        "submits or changes nothing; use a key with the 'user' role")
    return identity
