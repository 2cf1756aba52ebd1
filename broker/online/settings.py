"""The `online` settings section: batching and the queue policy of online requests, per model and per priority level."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from broker.setting_types import MAX_PRIORITY, Integer, Seconds, count_or_auto, parse_duration
from broker.setting_types import Section as _Section

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

    `auto` values come from the model's measured profile when it has one (`broker/online/batching.py`
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
    streams: Integer | None = Field(None, ge=1)
    """Most of one worker's stream slots that run this model's batches at once, as Triton's
    `instance_group` count; None: as many as the worker has. Fewer streams make fuller batches under
    load; more serve more batches side by side (`sitsctl model tune` measures which pays)."""
    closed_loop: bool = False
    """Whether the batching controller moves this model's `max_batch_size` and `max_queue_delay` from the
    P99, throughput and queue its clients see, toward `target_p99` (`tuning.controller`)."""
    target_p99: Seconds = Field(0.12, gt=0)
    """The P99 from submit to answer the batching controller steers toward, with `closed_loop`."""
    queue_capacity: Integer = Field(1024, ge=1)
    """Items (waiting + leased) that make the model's queue 100 % loaded, for PSA jumps."""
    # The queue policy (Triton's ModelQueuePolicy): docs/scheduling.md, "Queue policy and backpressure".
    max_queue_size: Integer = Field(4096, ge=0)
    """Most online requests waiting (not leased) in a model version's queue; one more is a 429. 0: no limit.
    The default bounds what a flood keeps in Redis (each request holds its inputs until it runs)."""
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
        return count_or_auto(value, f"a batch size (1 to {MAX_BATCH_SIZE})", most=MAX_BATCH_SIZE)

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
