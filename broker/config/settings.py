"""The one settings object of SITS: every room's section gathered, checked across sections, and loaded.

Each room owns its section (`broker/jobs/settings.py` holds `jobs`, ...); this module puts them
together in `Settings`, settles what spans sections (tenants' shares must fit the fleet; a failure
class's attempts left empty are `jobs.max_attempts`), and says where each problem came from: the file or a `SITS_*`
variable. Loaded once at a process's edge (the CLI, the API factory, the Celery app's configure hook:
`broker/config/loading.py`) and passed down; nothing reads the environment deep inside. Unknown keys
are errors, not silently ignored, and units are parsed from strings ("3600s", "128MiB").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError, field_validator

from broker.config.sections import ApiSettings, PathSettings
from broker.errors import ConfigError
from broker.failures.settings import BreakerSettings, DegradeSettings, FaultSettings, RetryPolicy, RetrySettings
from broker.jobs.settings import JobSettings
from broker.memory.settings import ResourceSettings
from broker.models.settings import ModelSettings, RepositorySettings
from broker.online.settings import OnlineSettings
from broker.queueing.settings import SchedulerSettings
from broker.schedules.settings import BeatSettings
from broker.setting_types import Section as _Section
from broker.sla.settings import SlaSettings
from broker.state.settings import RedisSettings
from broker.tenants.settings import FairShareSettings, Tenant
from broker.tenants.shares import validate_shares
from broker.tuning.settings import TuningSettings


class Settings(_Section):
    """Everything configurable in SITS."""

    scheduler: SchedulerSettings = SchedulerSettings()
    resources: ResourceSettings = ResourceSettings()
    redis: RedisSettings = RedisSettings()
    api: ApiSettings = ApiSettings()
    paths: PathSettings = PathSettings()
    models: ModelSettings = ModelSettings()
    """What model registration takes: the largest file (docs/models.md)."""
    repository: RepositorySettings = RepositorySettings()
    """Triton model repositories the API loads at its start (docs/models.md)."""
    jobs: JobSettings = JobSettings()
    online: OnlineSettings = OnlineSettings()
    sla: SlaSettings = SlaSettings()
    tuning: TuningSettings = TuningSettings()
    """Self-tuning: the batching controller (docs/tuning.md)."""
    retry: RetrySettings = RetrySettings()
    """The retry matrix: per failure class, how often and after how long (docs/failures.md)."""
    breaker: BreakerSettings = BreakerSettings()
    """The circuit breaker of each (model version, worker): when it opens and for how long (docs/failures.md)."""
    degrade: DegradeSettings = DegradeSettings()
    """How a worker steps its lower priority classes down while its device memory jitters (docs/failures.md)."""
    faults: FaultSettings = FaultSettings()
    """Fault injection for tests and benchmarks; refused unless `faults.enabled`."""
    tenants: dict[str, Tenant] = {}
    """Tenant name -> its share of the fleet and quotas (docs/tenants.md); API processes store them at start."""
    fair_share: FairShareSettings = FairShareSettings()
    """How tenants share the fleet: usage decay, the window weighed, chargeback prices (docs/tenants.md)."""
    beat: BeatSettings = BeatSettings()
    """How the beat releases schedules and keeps their runs (docs/schedules.md)."""

    @field_validator("tenants")
    @classmethod
    def _shares_fit_the_fleet(cls, tenants: dict[str, Tenant]) -> dict[str, Tenant]:
        try:
            validate_shares({name: tenant.share() for name, tenant in tenants.items()})
        except ConfigError as err:
            raise ValueError(err.message) from err
        return tenants

    def retry_policy(self, failure_class: str) -> RetryPolicy:
        """The retry policy of `failure_class`, its attempts resolved (`retry.worker_lost.attempts`
        left empty is `jobs.max_attempts`)."""
        policy = self.retry.policy(failure_class)
        if policy.attempts is None:
            return policy.model_copy(update={"attempts": self.jobs.max_attempts})
        return policy

    def with_overrides(self, **sections: Mapping[str, Any]) -> Settings:
        """A copy with some keys replaced, validated like a loaded file."""
        data = self.model_dump(mode="json")
        for section, values in sections.items():
            data.setdefault(section, {}).update(values)
        return validate_settings(data, source="overrides")


def validate_settings(data: Mapping[str, Any], source: str,
                      variables: Mapping[tuple[str, str], str] | None = None) -> Settings:
    """Settings from `data`; a ConfigError lists every problem, each with where it came from: `source`,
    or the variable in `variables` that set the key (or created the section)."""
    try:
        return Settings.model_validate(data)
    except ValidationError as err:
        variables = variables or {}
        problems: list[tuple[str, str]] = []
        for error in err.errors():
            loc = tuple(str(part) for part in error["loc"])
            key = ".".join(loc)
            reason = "unknown key" if error["type"] == "extra_forbidden" else error["msg"]
            origin = _origin(loc, variables, source, unknown=error["type"] == "extra_forbidden")
            problems.append((origin, f"{key}: {reason}"))
        origins = {origin for origin, _ in problems}
        if len(origins) == 1:
            raise ConfigError(f"invalid configuration in {origins.pop()}: "
                              + "; ".join(text for _, text in problems)) from err
        raise ConfigError("invalid configuration: " + "; ".join(f"{text} (in {origin})"
                                                                 for origin, text in problems)) from err


def _origin(loc: tuple[str, ...], variables: Mapping[tuple[str, str], str], source: str, *, unknown: bool) -> str:
    """The variable that set the key at `loc`, or the variables that made an `unknown` section; for a
    problem of a whole section (a check across its keys), the variables that set keys of it and
    `source`, as either may be at fault; else `source`."""
    if len(loc) >= 2 and (loc[0], loc[1]) in variables:
        return variables[(loc[0], loc[1])]
    setters = sorted(name for (section, _), name in variables.items() if loc and section == loc[0])
    if len(loc) == 1 and setters:
        return ", ".join(setters if unknown else [*setters, source])
    return source
