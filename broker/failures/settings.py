"""The settings sections of failure handling: `retry` (one policy per failure class), `breaker`, `degrade`
and `faults`.

The failures room owns these sections; `broker/config/settings.py` gathers them into `Settings` with
every other room's. docs/failures.md says what each key does.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from broker.setting_types import Bytes, Integer, Number, Seconds
from broker.setting_types import Section as _Section

FAILURE_CLASSES = ("worker_lost", "transient", "device_oom", "run_timeout", "bad_input", "invalid_model",
                   "cancelled")
"""Every class a failure falls in (`broker/failures/retry_policy.py`, `classify`), each with its
`retry.<class>` policy."""

InjectedClass = Literal["transient", "device_oom", "run_timeout", "bad_input", "invalid_model"]
"""The failure classes a `faults.fail_models` entry may inject into a model's runs."""


class RetryPolicy(_Section):
    """How often one class of failure is retried, and how long a retried item waits first.

    The n-th retry waits `backoff` x `backoff_factor`^(n-1), plus a random share of `jitter`; the
    wait is spent in Redis, not in a worker thread (docs/failures.md)."""

    attempts: Integer | None = Field(3, ge=1)
    """Runs of one item that may fail this way before its job (or request) fails; 1: no retry.
    `retry.worker_lost` only: empty (null) means `jobs.max_attempts`."""
    backoff: Seconds = Field(0.0, ge=0)
    """The wait before the first retry."""
    backoff_factor: Number = Field(1.0, ge=1.0, le=100.0)
    """Each further retry waits this many times the one before (1: the same each time)."""
    jitter: Seconds = Field(0.0, ge=0)
    """Up to this much more, drawn at random for each retry, so that items that failed together do not
    all come back together."""


def _policy(attempts: int | None, backoff: float = 0.0, factor: float = 1.0, jitter: float = 0.0) -> RetryPolicy:
    return RetryPolicy(attempts=attempts, backoff=backoff, backoff_factor=factor, jitter=jitter)


class RetrySettings(_Section):
    """The retry matrix: one policy per failure class (`broker/errors.py` names each error's class)."""

    worker_lost: RetryPolicy = _policy(None)
    """A lease that expired (its worker died or froze): back in its queue at once."""
    transient: RetryPolicy = _policy(4, 2.0, 1.0, 1.0)
    """Redis unreachable or full, a file system error that may pass (EAGAIN, EIO, ENOSPC), an unknown error."""
    device_oom: RetryPolicy = _policy(4, 1.0, 4.0)
    """The device ran out of memory (1 s, 4 s, 16 s)."""
    run_timeout: RetryPolicy = _policy(4, 1.0, 4.0)
    """A run went past its time limit (1 s, 4 s, 16 s)."""
    bad_input: RetryPolicy = _policy(1)
    """The input does not fit the model (or ONNX Runtime refused it): never retried."""
    invalid_model: RetryPolicy = _policy(1)
    """The model cannot be loaded or gives malformed outputs: never retried."""
    cancelled: RetryPolicy = _policy(1)
    """The work was cancelled while it ran: never retried."""

    @model_validator(mode="after")
    def _attempts_set(self) -> RetrySettings:
        for name in FAILURE_CLASSES:
            if name != "worker_lost" and self.policy(name).attempts is None:
                raise ValueError(f"retry.{name}.attempts must be a number (only retry.worker_lost.attempts may be "
                                 "empty, meaning jobs.max_attempts)")
        return self

    def policy(self, failure_class: str) -> RetryPolicy:
        """The policy of `failure_class` (one of `FAILURE_CLASSES`)."""
        policy = getattr(self, failure_class)
        assert isinstance(policy, RetryPolicy)
        return policy


class BreakerSettings(_Section):
    """The circuit breaker of each (model version, worker): when it opens, how long it stays open.

    A breaker opens when more than `failure_rate` of the runs in the last `window` failed on that
    worker's device, once at least `min_runs` ran; after `cool_down` one probe batch closes it or
    opens it again (`broker/failures/breaker.py`, docs/failures.md)."""

    enabled: bool = True
    """False: workers keep no breakers and take every model's batches, as before breakers."""
    failure_rate: Number = Field(0.003, gt=0, le=1)
    """Share of runs in the window that may fail; more opens the breaker (0.003: 0.3 %)."""
    window: Seconds = Field(60.0, gt=0)
    """How far back runs are counted."""
    min_runs: Integer = Field(20, ge=1)
    """Runs (failed ones included) the window must hold before the breaker may open."""
    cool_down: Seconds = Field(30.0, gt=0)
    """How long an open breaker stays open before one probe batch may run (half-open)."""


class DegradeSettings(_Section):
    """Stepping a worker's lower priority classes down while its device memory jitters.

    Every `sample_interval` a worker reads its device memory (NVML's used memory on a GPU, its own
    resident memory on a CPU). When the readings of the last `window` both rose and fell by more than
    `jitter_threshold` of the capacity, it steps down: first P1 work is served as P2, then P2 work
    is paused (kept queued). Calm for `calm_for`, it steps back one step at a time. P0, the top
    class, is never paused (`broker/failures/degrade.py`, docs/failures.md)."""

    enabled: bool = True
    """False: workers watch nothing and serve every class as usual."""
    jitter_threshold: Number = Field(0.1, gt=0, le=1)
    """How far the memory readings in the window both rose and fell (the smaller of their largest rise
    and their largest fall), as a share of the capacity, above which the worker steps down (0.1: 10 %)."""
    window: Seconds = Field(10.0, gt=0)
    """How far back readings count."""
    sample_interval: Seconds = Field(0.5, gt=0)
    """How often the memory is read."""
    step_interval: Seconds = Field(5.0, ge=0)
    """At most one step down this often: a worker still jittering after it steps down once more."""
    calm_for: Seconds = Field(10.0, gt=0)
    """How long the jitter must stay within the threshold (and the last step be this old) before one step back."""
    memory_limit: Bytes = 0
    """The capacity the jitter is measured against; 0: the worker's device memory (NVML's on a GPU,
    `resources.device_memory` on a CPU), capped by `resources.device_memory_limit`."""
    top_level: Integer = Field(12, ge=1, le=15)
    """The lowest priority level of class P0, the top class (never paused)."""
    middle_level: Integer = Field(8, ge=1, le=15)
    """The lowest priority level of class P1; the levels below it are class P2."""

    @model_validator(mode="after")
    def _classes_in_order(self) -> DegradeSettings:
        if self.middle_level >= self.top_level:
            raise ValueError(f"degrade.middle_level ({self.middle_level}) must be below degrade.top_level "
                             f"({self.top_level}): P1's levels lie below P0's")
        if self.sample_interval > self.window:
            raise ValueError(f"degrade.sample_interval ({self.sample_interval:g}s) is longer than degrade.window "
                             f"({self.window:g}s): the window would never hold two readings")
        return self


class FaultSettings(_Section):
    """Faults a worker injects into its own work, for tests and benchmarks: off unless `enabled`.

    Each fault takes the worker's real error path (an injected out-of-memory is the error a real one
    becomes); nothing is replaced by a stand-in."""

    enabled: bool = False
    """Must be true for any other key here to be set: a fault left in a production file is refused."""
    seed: Integer = 0
    """Seed of the draws that pick which runs fail: the same seed, the same faults."""
    run_latency: Seconds = Field(0.0, ge=0)
    """Added to every run, before it starts."""
    oom_share: Number = Field(0.0, ge=0, le=1)
    """Share of runs that fail as out of device memory."""
    oom_above_rows: Integer = Field(0, ge=0)
    """Runs of more rows than this fail as out of device memory (0: none)."""
    fail_rows: tuple[int, ...] = ()
    """Job row indexes (0-based, in the input file) whose runs fail as bad input."""
    fail_values: tuple[float, ...] = ()
    """Input values: a run whose inputs hold one fails as bad input (online requests too)."""
    fail_models: dict[str, InjectedClass] = {}
    """Model name -> the class of failure every run of it raises."""
    fail_models_share: Number = Field(0.0, ge=0, le=1)
    """Share of the runs of `fail_models` that fail, drawn run by run (0: every run): a model that fails
    now and then, whatever its input."""
    fail_models_for: Seconds = Field(0.0, ge=0)
    """`fail_models` stop failing this long after a worker's first injected model failure (0: never):
    a device that fails for a while, then recovers."""
    workers: tuple[str, ...] = ()
    """Worker names (fnmatch patterns, e.g. `sits0-*`) that inject these faults; empty: every worker."""
    memory_reading: Bytes = Field(0, ge=0)
    """What the worker's memory reading returns instead of the real one (0: the real one)."""
    memory_jitter: Bytes = Field(0, ge=0)
    """Every other memory reading is this much higher: the readings jitter by this much (0: they do not)."""
    memory_jitter_after: Seconds = Field(0.0, ge=0)
    """The jitter starts this long after the worker's first memory reading."""
    memory_jitter_for: Seconds = Field(0.0, ge=0)
    """The jitter stops after this long (0: never): memory that calms down again."""
    redis_drop_share: Number = Field(0.0, ge=0, le=1)
    """Share of runs after which the running thread's Redis connection drops."""
    redis_drop_calls: Integer = Field(1, ge=1)
    """How many Redis calls fail with a connection error after each drop."""

    @field_validator("workers", mode="before")
    @classmethod
    def _names(cls, value: Any) -> Any:
        if isinstance(value, list | tuple) and all(isinstance(entry, str) and entry for entry in value):
            return tuple(value)
        raise ValueError(f"{value!r} is not a list of worker names (or fnmatch patterns)")

    @field_validator("fail_rows", "fail_values", mode="before")
    @classmethod
    def _list(cls, value: Any) -> Any:
        if isinstance(value, list | tuple) and not any(isinstance(entry, bool) for entry in value):
            return tuple(value)
        raise ValueError(f"{value!r} is not a list of numbers")

    @model_validator(mode="after")
    def _refused_unless_enabled(self) -> FaultSettings:
        if self.enabled:
            return self
        set_keys = sorted(name for name in self.model_fields_set
                          if name != "enabled" and getattr(self, name) != _FAULT_DEFAULTS[name])
        if set_keys:
            raise ValueError(f"faults {', '.join(set_keys)} set while faults.enabled is false: fault injection "
                             "is for tests and benchmarks; set faults.enabled: true to use it")
        return self

    @property
    def active(self) -> bool:
        """Whether any fault is to be injected."""
        return self.enabled and any(getattr(self, name) != default for name, default in _FAULT_DEFAULTS.items()
                                    if name not in _NOT_FAULTS)


_NOT_FAULTS = ("enabled", "seed", "redis_drop_calls", "fail_models_share", "fail_models_for", "workers",
               "memory_jitter_after", "memory_jitter_for")
"""Keys that only shape the faults others set."""
_FAULT_DEFAULTS: dict[str, Any] = {name: field.default for name, field in FaultSettings.model_fields.items()}
