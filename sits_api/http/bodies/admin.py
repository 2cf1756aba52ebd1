"""The live policy, A/B routes, tenants and chargeback usage, as `/v1/policy`, `/v1/routes`, `/v1/tenants`
and `/v1/usage` answer them."""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

from pydantic import BaseModel, Field, create_model

from broker.models.routing import Route
from broker.queueing.scoring import Ordering, Weights
from broker.tenants.settings import Tenant

Policy: type[BaseModel] = create_model(  # type: ignore[call-overload]  # (every weight of `Weights`)
    "Policy", __doc__="The live queue ordering with every scoring weight and threshold.",
    ordering=(Ordering, ...),
    **{item.name: (typing.get_type_hints(Weights)[item.name], ...) for item in dataclasses.fields(Weights)},
)


class Rescore(BaseModel):
    """How the waiting items were re-scored under a new policy, in bounded slices."""

    rescored: int
    calls: int
    longest_call_ms: float
    largest_call_items: int


class PolicyUpdated(Policy):  # type: ignore[misc,valid-type]
    """`PUT /v1/policy`: the policy now live, and its re-scoring."""

    rescore: Rescore


class RouteList(BaseModel):
    """`GET /v1/routes`: the routes of bare model names the key may see, by name."""

    routes: list[Route]


class TenantRecord(Tenant):
    """A tenant's share, limit and quotas, with its name and where it is set."""

    name: str
    source: Literal["config", "api"] = Field(description="config: the file sets it (and wins); api: PUT set it")


class TenantList(BaseModel):
    """`GET /v1/tenants`."""

    tenants: list[TenantRecord]


class UsageRow(BaseModel):
    """One tenant's usage over the days asked (and, with `by`, of one model, key, day or device kind)."""

    tenant: str
    tier: str
    model: str | None = None
    key: str | None = None
    day: str | None = None
    device: str | None = None
    device_seconds: float
    rows: int
    requests: int
    failed: int
    jobs: int
    queue_seconds: float
    cost: float


class Usage(BaseModel):
    """`GET /v1/usage`: chargeback rows for the days `from`..`to` (UTC, inclusive)."""

    from_: str = Field(alias="from", description="YYYY-MM-DD")
    to: str = Field(description="YYYY-MM-DD")
    by: str = Field(description="tenant, model, key, day or device")
    currency: str
    price_per_device_hour: dict[str, float]
    usage: list[UsageRow]


class WorkerInfo(BaseModel):
    """A worker as its heartbeat says, with whether it is alive."""

    name: str
    alive: bool
    heartbeat_age_seconds: float


class BreakerInfo(BaseModel):
    """One circuit breaker of a model on a worker."""

    model: str
    worker: str
    state: str = Field(description="closed, open or half-open")
    since: float | None
    retry_at: float | None
    runs: int
    failures: int
    opened: int
    last_error: str | None


class Status(BaseModel):
    """`GET /v1/status`: workers, queue depths, tickets, jobs by status and breakers; counts only."""

    api_url: str
    redis_url: str | None = Field(None, description="admin keys only, its password masked")
    policy: str
    workers: list[WorkerInfo]
    queues: dict[str, dict[str, int]] = Field(description="model ref -> ready and inflight item counts")
    tickets: int
    jobs: dict[str, int] = Field(description="status -> jobs")
    breakers: list[BreakerInfo]


class Health(BaseModel):
    """`GET /healthz`: the process answers."""

    status: str


class Readiness(BaseModel):
    """`GET /readyz`: ready with the live workers, or unavailable with why."""

    status: str = Field(description="ready or unavailable")
    workers_alive: int | None = None
    error: str | None = None

