"""The `scheduler` settings section: how waiting work is ordered, leased and recovered."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from broker.setting_types import Number, Seconds
from broker.setting_types import Section as _Section


class SchedulerSettings(_Section):
    """How waiting work is ordered, leased and recovered."""

    policy: Literal["fifo", "round-robin", "graph-aware-backfill"] = "graph-aware-backfill"
    model_profile_cache_ttl: Seconds = 3600.0
    fallback_strategy: Literal["cpu-offload-on-oom", "fail"] = "cpu-offload-on-oom"
    oom_ceiling_decay: Seconds = Field(default=60.0, ge=0)
    """After a device OOM, a model's batch ceiling doubles this often until it is back at the size that
    failed (`broker/memory/oom_ceiling.py`); the ledger's learnt need lasts as long. 0: no ceiling is kept."""
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
