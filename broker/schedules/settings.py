"""The `beat` settings section: how the beat releases schedules and how long it keeps their runs."""

from __future__ import annotations

from pydantic import Field

from broker.setting_types import Integer, Seconds
from broker.setting_types import Section as _Section


class BeatSettings(_Section):
    """How SITS's beat releases schedules (docs/schedules.md)."""

    tick: Seconds = Field(0.5, gt=0, le=60)
    """The longest the beat sleeps between two passes; it wakes sooner for a slot due before then, so a
    release starts within a few milliseconds of its slot while the beat runs."""
    turn_timeout: Seconds = Field(10.0, gt=0)
    """How long the beat's turn lasts without a pass: a second beat waits while the first renews it, and
    takes over this long after the first stopped passing (killed, or cut off from Redis)."""
    missed_after: Seconds = Field(60.0, gt=0)
    """A slot the beat first looks at this long after it was due was missed (the beat was down): it is
    released once on return under `catch_up: once`, not at all under `skip`."""
    late_after: Seconds = Field(60.0, gt=0)
    """A release this long after its slot counts as late (`sits_schedule_late_releases_total`)."""
    release_timeout: Seconds = Field(30.0, gt=0)
    """A run claimed for release but not released for this long is sent to a releaser again: its
    message was lost (a beat killed between the claim and the send, a failover). It is also how long one
    releaser holds a run before another may take it."""
    release_queue: str = ""
    """The Celery queue of release tasks, which the releasers take; empty: `<redis.key_prefix>-releases`."""
    release_threads: Integer = Field(2, ge=1, le=64)
    """Releases one releaser process makes at once (each reads its input file, as a job submit does)."""
    releases_per_tenant: Integer = Field(1, ge=0)
    """Releases of one tenant's schedules made at once, over all releasers (0: no cap). A release reads and
    checksums its job's input, as a submit does: without it, one tenant's many runs due together, each of a
    large file, would hold every releaser thread while the other tenants' runs wait. One past it is sent
    again after a quarter of its wait (1 to 10 s), its place in the queue given to the others."""
    runs_kept: Integer = Field(100, ge=1, le=10_000)
    """The most recent runs kept per schedule (`GET /v1/schedules/<name>` lists them)."""
    max_schedules_per_tenant: Integer = Field(100, ge=0)
    """The most schedules one tenant may hold (admin keys: no cap)."""
    max_releases_per_minute: Integer = Field(120, ge=0)
    """The most releases a minute one tenant's schedules may ask for, at their peak: an `every` schedule
    60 over its period, a cron one (a minute at finest) 1. Every release is a job submit on the shared
    releasers, so one tenant's seconds-level schedules must not take them from the others (admin keys: no cap)."""
    rescore_every: Seconds = Field(5.0, ge=0, le=3600)
    """How often the beat that holds the turn sends the queues' re-scoring (`sits.rescore_queues`, run by a
    releaser): waiting requests re-estimated after their model's profile moved, and PSA for every queue
    (docs/scheduling.md, "The beat's re-scoring"); 0 turns it off."""

    def queue(self, key_prefix: str) -> str:
        """The Celery queue release tasks are sent to and the releasers take."""
        return self.release_queue or f"{key_prefix}-releases"
