"""The settings of tenants and of fair share: what `tenants:` and `fair_share:` in `sits-config.yaml` hold.

A tenant's record is the same whether it comes from the file or from `PUT /v1/tenants/{name}`
(`broker/tenants/records.py` stores it); `broker/config/settings.py` holds these sections with the others.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator

from broker.setting_types import MAX_PRIORITY, Bytes, Integer, Number, Seconds, UserTier, parse_size
from broker.setting_types import Section as _Section
from broker.tenants.shares import TenantShare


class Tenant(_Section):
    """One tenant's share of the fleet and its quotas (see the module's docstring); every key optional."""

    tier: str = Field("standard", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    """A label for dashboards and chargeback (`gold`, `batch`, ...); scheduling reads the numbers below."""
    guaranteed_share: Number = Field(0.0, ge=0.0, le=1.0)
    limit: Number = Field(1.0, ge=1.0)
    preemption_target: Seconds = Field(1.0, gt=0)
    max_queued: Integer = Field(1024, ge=0)
    """Most online requests of the tenant waiting or running at once (0: no limit). The default keeps one
    tenant's flood to what a small Redis holds beside everyone else's work."""
    max_queued_bytes: Bytes = Field(parse_size("256MiB"), ge=0)
    """Most bytes of inputs its online requests not answered yet may hold in Redis (0: no limit): what
    `max_queued` cannot bound, since one request may carry megabytes. The default lets one tenant fill a
    quarter of the embedded Redis's 1 GiB at most, so a flood of large requests leaves the others room."""
    max_inflight: Integer = Field(64, ge=0)
    """Most jobs of the tenant queued or running at once (0: no limit)."""
    max_queued_chunks: Integer = Field(100_000, ge=0)
    """Most chunks its active jobs may hold together (0: no limit): each queued chunk is a few hundred bytes in
    Redis, so without it one tenant's jobs cut into one-row chunks (`chunk_size: 1`) fill the Redis every
    tenant writes to, within `max_inflight`. A job past it is a 429 (a 400 when it alone is larger)."""
    max_model_versions: Integer = Field(256, ge=0)
    """Most model versions stored under the model names the tenant owns (0: no limit; 403 `models_at_limit`
    past it): each registration of a new graph stores a copy on the folder every host shares."""
    max_model_bytes: Bytes = Field(parse_size("64GiB"), ge=0)
    """Most bytes those stored copies may hold together, external data included (0: no limit)."""
    default_priority: Integer | None = Field(None, ge=0, le=MAX_PRIORITY)
    """The priority of its work that names none (None: the system's default)."""
    max_priority: Integer = Field(MAX_PRIORITY, ge=0, le=MAX_PRIORITY)
    """The highest priority its work may ask; more is refused (403 `priority_not_allowed`)."""
    user_tiers: tuple[UserTier, ...] | None = None
    """The `user_tier` values its requests may name besides `free` (None: every tier); another is refused
    (403 `tier_not_allowed`)."""
    models: tuple[str, ...] = ()
    """Model names its keys may use (empty: every model)."""
    model_roots: tuple[Path, ...] | None = None
    """Where its keys' models to register must lie (None: `<root>/<tenant>` under each of `paths.model_roots`)."""
    input_roots: tuple[Path, ...] | None = None
    """Where its keys' job inputs must lie (None: `<root>/<tenant>` under each of `paths.input_roots`)."""
    output_roots: tuple[Path, ...] | None = None
    """Where its keys' job output folders must lie (None: `<root>/<tenant>` under each of `paths.output_roots`)."""

    @field_validator("model_roots", "input_roots", "output_roots")
    @classmethod
    def _expand_roots(cls, value: tuple[Path, ...] | None) -> tuple[Path, ...] | None:
        return None if value is None else tuple(Path(root).expanduser().resolve() for root in value)

    @model_validator(mode="after")
    def _default_within_the_cap(self) -> Tenant:
        if self.default_priority is not None and self.default_priority > self.max_priority:
            raise ValueError(f"default_priority {self.default_priority} is above max_priority {self.max_priority}; "
                             "lower it, or raise max_priority")
        return self

    def share(self) -> TenantShare:
        """The part `broker/tenants/shares.py` decides with."""
        return TenantShare(self.guaranteed_share, self.limit)

    def allows_model(self, model: str) -> bool:
        """May the tenant use `model` (a bare name or `name@version`)?"""
        return not self.models or model.split("@", 1)[0] in self.models


class FairShareSettings(_Section):
    """How the fleet is shared between tenants (docs/tenants.md)."""

    enabled: bool = True
    """Order work by tenants' usage against their shares; off: the queue's own order only (FIFO by priority)."""
    usage_half_life: Seconds = Field(30.0, gt=0)
    """How fast past device time stops counting against a tenant: halved every this many seconds."""
    window: Integer = Field(4096, ge=1, le=65536)
    """How deep into a model's queue a lease looks for the first-ranked tenant's work (in items)."""
    usage_refresh: Seconds = Field(0.05, ge=0)
    """How long a worker reuses the usage it read before reading it again (on a thread of its own, beside the
    leases; 0: every lease reads it)."""
    present_for: Seconds = Field(0.05, gt=0, le=10)
    """How long a tenant stays present on a model after one of its requests there was answered, while its
    clients send the next (`broker/tenants/batch_shares.py`): while it is present with nothing waiting, the
    others' requests of the model wait. Longer than a closed-loop client takes from an answer to its next call;
    a lone tenant waits at most this long once the other has gone."""
    price_per_device_hour: dict[str, Number] = {}
    """Chargeback price of an hour of one device stream, per device kind (`cpu`, `gpu`), e.g. {gpu: 2.5};
    `cuda` is taken for `gpu`, the kind workers bill a GPU's time under."""
    currency: str = "USD"

    @field_validator("price_per_device_hour")
    @classmethod
    def _gpu_by_either_name(cls, prices: dict[str, float]) -> dict[str, float]:
        if "cuda" in prices and "gpu" in prices and prices["cuda"] != prices["gpu"]:
            raise ValueError(f"price_per_device_hour gives cuda {prices['cuda']} and gpu {prices['gpu']}: they are one "
                             "device kind (gpu); give one")
        return {("gpu" if kind == "cuda" else kind): price for kind, price in prices.items()}


UNRECORDED = Tenant()
"""What a tenant without a record gets: no share, the default caps and entitlements."""
UNCAPPED = Tenant(max_queued=0, max_queued_bytes=0, max_inflight=0, max_queued_chunks=0)
"""What an admin key's tenant without a record gets: operators are not capped by default."""
