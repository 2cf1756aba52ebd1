"""A schedule's definition and its runs, as stored in Redis (JSON) and read back as typed records.

A schedule belongs to its tenant as a job does: its `owner` is the key name that made it, and each
release submits the schedule's job as that key, within its tenant's entitlements as they stand at the
release. Names are unique within a tenant; `member` (`tenant|name`) names a schedule in the keyspace.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from broker.errors import NotFound
from broker.schedules.slots import Cadence, CatchUp, Window

SCHEDULE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""What a schedule may be called: a name safe in keys, file names and metric labels."""

RunStatus = Literal["releasing", "released", "held", "refused", "missed"]
RUN_STATUSES: tuple[RunStatus, ...] = ("releasing", "released", "held", "refused", "missed")
"""releasing: claimed, its job being made; released: its job was made (that job's status says how it
went); held: waiting for the same slot's run of the schedules it comes `after`; refused: its release
was refused (admission, caps, paths), with the reason; missed: not released (missed while no beat ran
under `catch_up: skip`, or its window closed first)."""


def member_of(tenant: str, name: str) -> str:
    """How the keyspace names tenant `tenant`'s schedule `name` ('|' is in no tenant or schedule name)."""
    return f"{tenant}|{name}"


def split_member(member: str) -> tuple[str, str]:
    """(tenant, name) of a `member_of` text."""
    tenant, _, name = member.partition("|")
    return tenant, name


def schedule_not_found(name: str) -> NotFound:
    """The error for a schedule the caller has not: a missing one and another tenant's answer alike."""
    return NotFound(f"no schedule '{name}' (GET /v1/schedules lists this key's)")


@dataclass(frozen=True)
class Schedule:
    """One schedule: when its slots fall, the job each releases, and how a release is held or bounded."""

    name: str
    tenant: str
    owner: str
    """The key name that made it: each release is submitted as that key (within its tenant's rights then)."""
    job: dict[str, Any]
    """The `POST /v1/jobs` body; `input_batch` and `output_dir` may hold `{date}`, `{time}` and `{slot}`."""
    cron: str | None = None
    every: int | None = None
    timezone: str = "UTC"
    window: str | None = None
    deadline: float | None = None
    """Seconds after its slot each run's job must be done by (admitted as a job with that deadline)."""
    catch_up: CatchUp = "once"
    after: tuple[str, ...] = ()
    """Schedules of the same tenant whose run of the same slot must have succeeded before this one's is released."""
    paused: bool = False
    created_at: float = 0.0
    updated_at: float = 0.0
    revision: int = 1
    """Raised by every change: a beat pass that read an older one claims nothing (`claim_slot.lua`)."""
    generation: str = ""
    """Random, made at creation: the job id of each slot comes from it (`slot_job_id`), so that a schedule
    deleted and made again under its name never meets the old one's jobs."""
    release_offset: float = 0.0
    """How long after its slot each release is due (0: at the slot): what a window's plan staggers releases by
    (`broker/schedules/planning.py`). Templates and the deadline still count from the slot."""
    slot_cap: int | None = None
    """The most stream slots each run's job holds at once (its `max_slots`; None: no cap), set by a plan."""

    @property
    def member(self) -> str:
        return member_of(self.tenant, self.name)

    def cadence(self) -> Cadence:
        """What decides this schedule's slots (`broker/schedules/slots.py`)."""
        return Cadence(timezone=self.timezone, cron=self.cron, every=self.every,
                       window=Window.parse(self.window) if self.window else None, release_offset=self.release_offset)

    def to_json(self) -> dict[str, Any]:
        """The schedule as the API shows it and Redis stores it."""
        shown = asdict(self)
        shown["after"] = list(self.after)
        return shown

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)

    @classmethod
    def loads(cls, raw: str) -> Schedule:
        data = json.loads(raw)
        data["after"] = tuple(data.get("after") or ())
        known = {name for name in cls.__dataclass_fields__}
        return cls(**{name: value for name, value in data.items() if name in known})

    def changed(self, **fields: Any) -> Schedule:
        """A copy with `fields` replaced and its revision raised."""
        return replace(self, revision=self.revision + 1, **fields)


def slot_job_id(schedule: Schedule, slot: int) -> str:
    """The id of the job `schedule` releases at `slot`, the same on every try: a release made twice (two
    beats, a message sent again, a claim lost in a failover) meets its own job instead of making a
    second. Shaped as every job id (`broker.jobs.records.JOB_ID_PATTERN`)."""
    digest = hashlib.sha256(f"{schedule.member}|{schedule.generation}|{slot}".encode()).hexdigest()
    return "j" + digest[:12]


@dataclass(frozen=True)
class Run:
    """What became of one slot of a schedule."""

    slot: int
    status: RunStatus
    job_id: str
    due_at: float
    claimed_at: float
    catch_up: bool = False
    """Released (or missed) after `beat.missed_after`: no beat ran when it was due."""
    manual: bool = False
    """Made by `run-now`, not by the beat."""
    released_at: float | None = None
    reason: str = ""
    """Why it is held, refused or missed."""
    reason_code: str = ""
    """The same as one word: the error code of a refusal, `waiting` or `step_failed` of a held run."""
    predicted_finish: float | None = None
    deadline: float | None = None

    @property
    def lateness(self) -> float | None:
        """Seconds from when its release was due to when its job was made."""
        return None if self.released_at is None else max(0.0, self.released_at - self.due_at)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)

    @classmethod
    def loads(cls, raw: str) -> Run:
        data = json.loads(raw)
        known = {name for name in cls.__dataclass_fields__}
        return cls(**{name: value for name, value in data.items() if name in known})
