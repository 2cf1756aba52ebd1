"""The one settings object of SITS: its sections, their keys and defaults, and their validation.

Loaded once at a process's edge (the CLI, the API factory, the Celery app's
configure hook: `broker/config_loading.py`) and passed down; nothing reads
the environment deep inside. Unknown keys are errors, not silently ignored,
and units are parsed from strings ("3600s", "128MiB") into seconds and bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from broker.errors import ConfigError
from broker.failure_settings import BreakerSettings, DegradeSettings, FaultSettings, RetryPolicy, RetrySettings
from broker.scoring import MAX_PRIORITY
from broker.setting_types import Bytes, Integer, Number, Seconds
from broker.setting_types import Section as _Section
from broker.tenant_settings import FairShareSettings, Tenant
from broker.tenant_shares import validate_shares
from broker.units import parse_duration, parse_size


def _count_or_auto(value: Any, what: str, *, most: int | None = None) -> Any:
    """A whole number >= 1 (at most `most`), also written as a string, or 'auto'; ValueError says `what`."""
    text = value.strip() if isinstance(value, str) else value
    if text == "auto":
        return text
    if isinstance(text, str) and text.isdigit():
        text = int(text)
    if isinstance(text, int) and not isinstance(text, bool) and 1 <= text <= (most or text):
        return text
    raise ValueError(f"{value!r} is neither {what} nor 'auto'")


class SchedulerSettings(_Section):
    """How waiting work is ordered, leased and recovered."""

    policy: Literal["fifo", "round-robin", "graph-aware-backfill"] = "graph-aware-backfill"
    model_profile_cache_ttl: Seconds = 3600.0
    fallback_strategy: Literal["cpu-offload-on-oom", "fail"] = "cpu-offload-on-oom"
    oom_ceiling_decay: Seconds = Field(default=60.0, ge=0)
    """After a device OOM, a model's batch ceiling doubles this often until it is back at the size that
    failed (`broker/oom_ceiling.py`); the ledger's learnt need lasts as long. 0: no ceiling is kept."""
    lease_timeout: Seconds = 60.0
    """How long a worker may hold leased items before the reaper returns them."""
    run_time_limit: Seconds = Field(default=300.0, ge=0)
    """A run (one `session.run`: a mini-batch, or a batch of requests) still running after this long is
    stopped and fails as `run_timeout`, retried by `retry.run_timeout`; 0: no limit."""
    reap_interval: Seconds = Field(default=1.0, ge=0.05)
    """Period of the reaper pass (expired leases back, lost tickets replaced, stalled fills completed):
    every worker's reaper thread ticks at it, and the one holding the turn passes. At least 50 ms: a
    pass is a dozen round trips."""
    ticket_time_slice: Seconds = 2.0
    """How long one batch ticket drains queues before it yields its thread and re-queues itself."""
    ticket_timeout: Seconds = 30.0
    """A ticket not seen for this long is taken as lost (its worker died) and replaced. A live
    ticket is touched at every lease and every `lease_timeout / 4` during a long chunk."""
    ticket_linger: Seconds = 1.0
    """How long a ticket whose queues ran dry waits on the doorbell for new work before it retires:
    the next request is then leased at once, without a Celery publish and delivery in between."""
    yield_check_interval: Seconds = 0.05
    """How often a running job chunk looks, between its mini-batches, for online requests that
    outrank it (they then run on its stream slot before its next mini-batch): at most this often for
    announced requests, and this often when none is announced; 0 looks every time. Each look is a
    Redis round trip: every 10 ms cost the MLP's offline throughput about 4 %."""
    merge_requests_into_jobs: bool = True
    """At each such look, online requests of the chunk's own model and shape bucket ride along in
    its next mini-batch (one `session.run` for both), and a worker that leases a batch of requests
    takes a waiting chunk of that model with it, to fill the batch's empty rows. Off: requests and
    job rows never share a run (a chunk still lets outranking requests through between batches)."""
    merge_latency_factor: Number = Field(1.5, ge=1.0)
    """How much longer than the requests' own batch (by the model's profile) a run of requests with
    job rows may take: job rows fill an online batch's empty rows only while they are nearly free
    (a GPU's flat latency curve; on a CPU, or with only a static profile, few rows fit). 1: none."""
    worker_heartbeat_timeout: Seconds = 15.0

    @model_validator(mode="after")
    def _linger_below_ticket_timeout(self) -> SchedulerSettings:
        if self.ticket_linger * 2 > self.ticket_timeout:
            raise ValueError(f"ticket_linger ({self.ticket_linger}s) must be at most half of ticket_timeout "
                             f"({self.ticket_timeout}s), or lingering tickets are taken for lost")
        return self


MAX_CONCURRENT_STREAMS = 64
"""The most stream slots (batches in flight at once) one worker may have."""


class ResourceSettings(_Section):
    """What a worker may use on its device."""

    gpu_memory_granularity: Bytes = parse_size("128MiB")
    """The unit a GPU worker reserves batch memory in."""
    cpu_memory_granularity: Bytes = parse_size("2MiB")
    """The unit a CPU worker reserves batch memory in: CPU batches need a few MiB, so GPU-sized units
    would be almost all waste (fragmentation ~98 % at 128 MiB, ~22 % at 2 MiB, measured)."""
    max_concurrent_streams: Integer = Field(4, ge=1, le=MAX_CONCURRENT_STREAMS)
    """Most batches a worker runs at once; a CPU worker runs at most one per core (its streams x
    intra-op threads stay within its cores: `sits_worker/worker_settings.py`)."""
    intra_op_threads: Integer = Field(0, ge=0)
    """ONNX Runtime intra-op threads per session; 0 (auto): on a CPU worker its cores shared out among
    its streams, on a GPU worker ONNX Runtime's own choice."""
    device_memory: Bytes = parse_size("16GiB")
    """Capacity assumed for a device when NVML cannot tell (a CPU's, always)."""
    device_memory_limit: Bytes = 0
    """Most batch memory a worker may reserve on its device, whatever NVML reports (a device shared
    with other work); 0: the whole device."""


class RedisSettings(_Section):
    """Where state lives. `url` empty means: start the embedded Redis."""

    url: str = ""
    key_prefix: str = "sits"
    appendonly: bool = True

    @property
    def task_queue(self) -> str:
        """The Celery queue of this deployment's tasks: its key prefix, so that deployments sharing one
        Redis under different prefixes never take each other's tasks (a worker of another prefix would
        take a drain task and find none of this deployment's queues)."""
        return self.key_prefix


class ApiSettings(_Section):
    """The REST edge."""

    host: str = "127.0.0.1"
    port: Integer = Field(8470, ge=0, le=65535)
    max_body_bytes: Bytes = parse_size("16MiB")
    body_timeout: Seconds = Field(default=30.0, gt=0)
    """The longest a request's body may pause, no byte of it arriving, once its headers came (a 408
    past it): a client that stops part-way must not hold a request thread for ever. (A client that
    trickles its body, or stalls inside its headers, is a slow client for a buffering proxy in front
    of the API to absorb, as gunicorn's documentation advises.)"""
    server: Literal["gunicorn", "granian"] = "gunicorn"
    """The HTTP server the embedded stack runs the API under. gunicorn (its gthread workers) answers
    malformed HTTP in the API's JSON error form and enforces `body_timeout`. granian (a Rust HTTP
    server; `pip install 'sits[granian]'`) costs about a quarter less CPU per online request, but its
    own HTTP layer answers malformed requests with a bare status and reads bodies before the app does
    (docs/operations.md, "The API's HTTP server")."""
    workers: Integer = Field(2, ge=1, le=64)
    """API server processes; each runs `threads` request threads."""
    threads: Integer = Field(16, ge=1, le=1024)
    """Request threads per API process; a `wait=true` call holds one while it waits."""
    url: str = ""
    """The URL clients use; empty means http://host:port."""

    def public_url(self) -> str:
        """The URL a client should call."""
        return self.url or f"http://{self.host}:{self.port}"


class PathSettings(_Section):
    """Where files may be read and written; every path a request names must lie in these roots."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)  # expand the defaults too

    home: Path = Path("~/.sits")
    model_roots: tuple[Path, ...] = (Path("."),)
    input_roots: tuple[Path, ...] = (Path("."),)
    output_roots: tuple[Path, ...] = (Path("."),)
    model_store: Path | None = None
    """Where registered model versions are copied; default `<home>/models`."""

    @field_validator("home", "model_store")
    @classmethod
    def _expand(cls, value: Path | None) -> Path | None:
        return None if value is None else value.expanduser().resolve()

    @field_validator("model_roots", "input_roots", "output_roots")
    @classmethod
    def _expand_roots(cls, value: tuple[Path, ...]) -> tuple[Path, ...]:
        return tuple(Path(root).expanduser().resolve() for root in value)

    def store(self) -> Path:
        """The folder that holds copies of registered models."""
        return self.model_store or self.home / "models"


class JobSettings(_Section):
    """Defaults for offline jobs."""

    chunk_size: int | Literal["auto"] = "auto"
    """Rows per queue item for jobs that do not set one; `auto`: about `chunk_seconds` of work at the
    model's measured throughput, in whole batches, split over live workers and capped by
    `max_chunk_output_bytes` (broker/chunking.py); 4096 for a model without a usable profile (a
    measured one, or an observed one with batches of 128 rows or more)."""
    chunk_seconds: Seconds = Field(1.0, gt=0)
    """How long an `auto` chunk runs; each chunk has a fixed cost of a few ms (lease, part file, ack)."""
    max_chunk_output_bytes: Bytes = parse_size("64MiB")
    """Most output bytes in an `auto` chunk: a worker holds them in memory until its part file is
    written (0: no cap)."""
    batch_size: int | Literal["auto"] = "auto"
    """Rows per ONNX Runtime run for jobs that do not set one; `auto`: the model's best measured
    batch size (the smallest within 5 % of the best rows/s a job gets, its profile's rows/s less a
    mini-batch's own cost, broker/chunking.py); 128 for a model without a usable profile."""
    max_attempts: Integer = Field(3, ge=1)
    """A chunk (or request) whose lease ran out this many times fails its job (poison batch): the
    attempts of `retry.worker_lost` unless that sets its own. Failures of other classes count
    against their own `retry.<class>.attempts`."""
    max_bad_rows: int | float = 0.001
    """Most rows of a job that may fail for their input and be quarantined (docs/failures.md,
    "Bad-row quarantine"): a whole number is a count, a number between 0 and 1 a share of the job's
    rows (rounded down). One more fails the job, naming them; 0 fails it at its first failing batch,
    with that batch's error, unbisected."""
    quarantine_fill: Literal["nan"] | Number = "nan"
    """What a quarantined row holds in a float output (integer outputs: -1, or 0 when unsigned,
    unless this is a whole number they can hold)."""

    @field_validator("chunk_size", "batch_size", mode="before")
    @classmethod
    def _rows_or_auto(cls, value: Any) -> Any:
        return _count_or_auto(value, "a number of rows (>= 1)")

    @field_validator("max_bad_rows", mode="before")
    @classmethod
    def _count_or_share(cls, value: Any) -> Any:
        text = value.strip() if isinstance(value, str) else value
        try:
            number = float(text) if isinstance(text, str | int | float) and not isinstance(text, bool) else None
        except ValueError:
            number = None
        if number is not None and number >= 1 and number == int(number):
            return int(number)
        if number is not None and 0 <= number < 1:
            return int(number) if number == 0 else number
        raise ValueError(f"{value!r} is neither a count of rows (a whole number >= 0) nor a share between 0 and 1")


TimeoutAction = Literal["reject", "delay"]


class LevelQueuePolicy(_Section):
    """The queue policy of one priority level (Triton's `priority_queue_policy` entry); a key it leaves
    out is its model's (`ModelBatching`). `max_queue_size` here bounds this level's waiting requests."""

    max_queue_size: Integer | None = Field(None, ge=0)
    default_timeout: Seconds | None = Field(None, ge=0)
    timeout_action: TimeoutAction | None = None
    allow_timeout_override: bool | None = None


MAX_BATCH_SIZE = 65536
"""The largest batch size the configuration takes (a batch is leased in one Redis call)."""
MAX_QUEUE_DELAY = 1.0
"""The longest `max_queue_delay` (a waiting stream slot does not touch its ticket)."""


class ModelBatching(_Section):
    """How a model's online requests are merged into batches (Triton's dynamic batcher knobs).

    `auto` values come from the model's measured profile when it has one (`broker/batching.py`
    resolves them per model version); the comments say what they are without one.
    """

    max_batch_size: int | Literal["auto"] = "auto"
    """Most requests in one batch (and most rows, for requests of one row); `auto`: the largest
    measured batch size that runs within `max_batch_latency` (64 without a measured profile)."""
    max_queue_delay: float | Literal["auto"] = "auto"
    """How long the first request of a batch may wait for company (0: batch what is there); `auto`:
    the measured run time of one row when that is at least 0.5 ms, at most 5 ms (0 without a measured
    profile)."""
    preferred_batch_sizes: tuple[int, ...] = ()
    """Batch sizes the batcher prefers, as Triton's `preferred_batch_size`: when the queue holds
    enough requests for one, the largest such batch runs at once (the rest waits for the next);
    below the smallest, the head waits up to `max_queue_delay` for company, then what is there runs."""
    max_batch_latency: Seconds = Field(0.05, gt=0)
    """How long one batch may run by the measured profile, for an `auto` `max_batch_size`."""
    max_batch_tokens: Integer = Field(8192, ge=0)
    """Token models: most tokens in one batch (0: no limit)."""
    queue_capacity: Integer = Field(1024, ge=1)
    """Items (waiting + leased) that make the model's queue 100 % loaded, for PSA jumps."""
    # The queue policy (Triton's ModelQueuePolicy): docs/scheduling.md, "Queue policy and backpressure".
    max_queue_size: Integer = Field(0, ge=0)
    """Most online requests waiting (not leased) in a model version's queue; one more is a 429. 0: no limit."""
    default_timeout: Seconds = Field(0.0, ge=0)
    """How long a request may wait for a worker when it names no timeout of its own; 0: no timeout."""
    timeout_action: TimeoutAction = "reject"
    """What happens to a request still waiting at its timeout: `reject` fails it as timed out;
    `delay` keeps it queued at the lowest priority level, and it still runs."""
    allow_timeout_override: bool = True
    """Whether a request's own timeout (v1 `timeout_ms`, v2 `timeout`) applies: below `default_timeout`
    when one is set (as in Triton), any when none is. (Triton's default is false; SITS keeps the v2
    `timeout` it always honoured.)"""
    priority_levels: dict[int, LevelQueuePolicy] = {}
    """Per priority level (0-15, 15 the most urgent), overrides of the four keys above."""

    @field_validator("priority_levels", mode="before")
    @classmethod
    def _levels(cls, value: Any) -> Any:
        if not isinstance(value, Mapping):
            raise ValueError(f"{value!r} is not a mapping of priority levels (0-15) to queue policies")
        for level in value:
            text = str(level).strip()
            if isinstance(level, bool) or not text.isdigit() or int(text) > MAX_PRIORITY:
                raise ValueError(f"{level!r} is not a priority level: use 0 to {MAX_PRIORITY} (15 the most "
                                 "urgent; a v2 `priority` p is level 16 - p)")
        return value

    @model_validator(mode="after")
    def _level_limits_within_the_model_s(self) -> ModelBatching:
        for level, entry in sorted(self.priority_levels.items()):
            if self.max_queue_size and entry.max_queue_size and entry.max_queue_size > self.max_queue_size:
                raise ValueError(f"priority_levels.{level}.max_queue_size ({entry.max_queue_size}) is above "
                                 f"max_queue_size ({self.max_queue_size}), which bounds all levels together; "
                                 "lower it or leave it out")
        return self

    @field_validator("max_batch_size", mode="before")
    @classmethod
    def _size_or_auto(cls, value: Any) -> Any:
        return _count_or_auto(value, f"a batch size (1 to {MAX_BATCH_SIZE})", most=MAX_BATCH_SIZE)

    @field_validator("max_queue_delay", mode="before")
    @classmethod
    def _delay_or_auto(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip() == "auto":
            return "auto"
        seconds = parse_duration(value)
        if seconds > MAX_QUEUE_DELAY:
            raise ValueError(f"{value!r} is longer than {MAX_QUEUE_DELAY:g}s: a batch's first request would wait"
                             " longer than it takes to run most batches")
        return seconds

    @field_validator("preferred_batch_sizes", mode="before")
    @classmethod
    def _sizes(cls, value: Any) -> Any:
        if isinstance(value, list | tuple) and all(isinstance(v, int) and not isinstance(v, bool)
                                                     and 1 <= v <= MAX_BATCH_SIZE for v in value):
            return tuple(sorted(set(value)))
        raise ValueError(f"{value!r} is not a list of batch sizes (each 1 to {MAX_BATCH_SIZE})")

    @model_validator(mode="after")
    def _preferred_within_max(self) -> ModelBatching:
        if isinstance(self.max_batch_size, int) and any(size > self.max_batch_size
                                                        for size in self.preferred_batch_sizes):
            raise ValueError(f"preferred_batch_sizes {list(self.preferred_batch_sizes)} go beyond "
                             f"max_batch_size {self.max_batch_size}")
        return self


class OnlineSettings(_Section):
    """Online requests: batching defaults, per-model overrides, how long results are kept."""

    batching: ModelBatching = ModelBatching()
    models: dict[str, ModelBatching] = {}
    """Per-model overrides of `batching`, by model name; keys a model does not set come from `batching`."""
    result_ttl: Seconds = 600.0
    max_wait: Seconds = 30.0
    """Longest a `wait=true` call holds its connection when the request has no deadline."""

    @model_validator(mode="before")
    @classmethod
    def _models_inherit_batching(cls, data: Any) -> Any:
        """`models: {bert: {max_batch_tokens: 4096}}` changes that one key, not the others back to defaults."""
        if not isinstance(data, Mapping) or not isinstance(data.get("models"), Mapping):
            return data
        base = data.get("batching") or {}
        base = base.model_dump() if isinstance(base, ModelBatching) else dict(base) if isinstance(base, Mapping) else {}
        models = {name: {**base, **entry} if isinstance(entry, Mapping) else entry
                  for name, entry in data["models"].items()}
        return {**data, "models": models}

    def batching_for(self, model_name: str) -> ModelBatching:
        """The batching settings of `model_name`."""
        return self.models.get(model_name, self.batching)


Admission = Literal["reject", "flag", "off"]


class ModelSla(_Section):
    """One model's deadline settings (`sla.models.<name>`); a key it leaves out is `sla`'s."""

    admission: Admission | None = None


class SlaSettings(_Section):
    """Deadlines on offline jobs: how they are ordered and whether one that cannot be met is refused."""

    admission: Admission = "reject"
    """At submit, a job with a deadline is checked against its predicted finish (`broker/admission.py`):
    `reject` refuses one that cannot finish in time, or that would make an accepted job miss its own
    deadline (422, `deadline_infeasible`); `flag` accepts it with `at_risk: true`; `off` never checks."""
    admission_margin: Number = Field(0.1, ge=0, le=10)
    """Share of the predicted time kept in hand: with 0.1 a job predicted to need 100 s is accepted only
    with a deadline at least 110 s away."""
    admission_margin_floor: Seconds = Field(0.25, ge=0)
    """The least time kept in hand, however short the job: its fixed costs (the submit, the first lease, a
    chunk's start, the final merge) vary by a few hundred milliseconds on a loaded host, which a share of
    a one-second prediction does not cover."""
    deadline_horizon: Seconds = Field(300.0, ge=0)
    """A job with a deadline waits as if it had arrived this long before it (or when it came, if that is
    earlier): deadlines within the horizon are served earliest first and gain up to δ·horizon priority
    points as they near (30 at the defaults)."""
    models: dict[str, ModelSla] = {}
    """Per-model overrides, by model name."""

    def admission_for(self, model_name: str) -> Admission:
        """The admission mode of `model_name`'s jobs."""
        entry = self.models.get(model_name)
        return entry.admission if entry is not None and entry.admission is not None else self.admission


class Settings(_Section):
    """Everything configurable in SITS."""

    scheduler: SchedulerSettings = SchedulerSettings()
    resources: ResourceSettings = ResourceSettings()
    redis: RedisSettings = RedisSettings()
    api: ApiSettings = ApiSettings()
    paths: PathSettings = PathSettings()
    jobs: JobSettings = JobSettings()
    online: OnlineSettings = OnlineSettings()
    sla: SlaSettings = SlaSettings()
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
