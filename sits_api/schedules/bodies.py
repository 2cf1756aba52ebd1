"""Request bodies of `/v1/schedules`, validated with pydantic (unknown fields rejected)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from broker.errors import BadInput
from broker.schedules.records import SCHEDULE_NAME
from sits_api.schemas import JobSubmission, WholeNumber

MAX_STEPS_BEFORE = 16
"""The most schedules one may come `after`."""
_NAME = SCHEDULE_NAME.pattern


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Cadence(_Body):
    cron: str | None = Field(None, max_length=200, description="five fields in `timezone`'s wall time, e.g. "
                                                               "'30 17 * * 1-5'")
    every: str | int | None = Field(None, description="a period from 1s to 1d, e.g. '10s' or 600 (seconds); "
                                                      "slots fall on its multiples since the Unix epoch")
    timezone: str | None = Field(None, max_length=64, description="IANA time zone of `cron`, `window` and the "
                                                                  "{date} and {time} templates (default UTC)")
    window: str | None = Field(None, max_length=11, description="HH:MM-HH:MM local: only slots inside it run, and "
                                                                "a late or held release only until it ends")
    deadline: str | float | None = Field(None, description="how long after its slot each run's job must be done, "
                                                           "e.g. '2h': admitted as a job with that deadline")
    catch_up: Literal["once", "skip"] | None = Field(None, description="a slot missed while no beat ran: released "
                                                                       "once on return, or not at all")
    after: list[str] | None = Field(None, max_length=MAX_STEPS_BEFORE,
                                    description="schedules of this tenant whose run of the same slot must "
                                                "have succeeded first")
    paused: bool | None = None
    release_offset: str | float | None = Field(None, description="how long after each slot its release is due, "
                                                                 "e.g. '15m' (0: at the slot); `schedule plan "
                                                                 "--apply` sets it")
    slot_cap: WholeNumber | None = Field(None, ge=1, le=100_000, description="the most stream slots each run's job "
                                                                     "holds at once (its `max_slots`); `null`: "
                                                                     "no cap; `schedule plan --apply` sets it")


class ScheduleSubmission(_Cadence):
    """`POST /v1/schedules`: a job released at each slot of a cron expression or a period."""

    name: str = Field(..., pattern=f"^{_NAME}$")
    job: JobSubmission = Field(..., description="the POST /v1/jobs body; input_batch and output_dir may hold "
                                                "{date}, {time} and {slot}")

    @model_validator(mode="after")
    def _one_cadence(self) -> ScheduleSubmission:
        if (self.cron is None) == (self.every is None):
            raise ValueError("give either cron (e.g. '30 17 * * 1-5') or every (e.g. '10s'), one of the two")
        return self


class SchedulePatch(_Cadence):
    """`PATCH /v1/schedules/<name>`: the fields to change; `null` clears window and deadline. Giving cron
    replaces every, and the other way round."""

    job: JobSubmission | None = None

    @model_validator(mode="after")
    def _one_cadence(self) -> SchedulePatch:
        if self.cron is not None and self.every is not None:
            raise ValueError("give either cron or every, not both")
        return self

    def changes(self) -> dict[str, Any]:
        """The fields the body sets, `null`s included."""
        return {name: getattr(self, name) for name in self.model_fields_set}


class PlanAsk(_Body):
    """`GET` (query) or `POST` (body) `/v1/schedules/plan`: which window to plan, for how many slots."""

    window: str | None = Field(None, max_length=11, description="HH:MM-HH:MM in `timezone`; unset: the next 24 h")
    day: str | None = Field(None, max_length=10, description="YYYY-MM-DD of the window (default: its next opening)")
    timezone: str = Field("UTC", max_length=64, description="IANA time zone of `window` and `day`")
    slots: WholeNumber | None = Field(None, ge=1, le=10_000, description="the fleet's stream slots to plan for "
                                                                   "(default: the live workers')")

    @classmethod
    def from_query(cls, args: Mapping[str, str]) -> PlanAsk:
        """The ask from a query string (`slots` as text)."""
        unknown = set(args) - set(cls.model_fields) - {"tenant"}
        if unknown:
            raise BadInput(f"unknown query parameters {sorted(unknown)}; known: {', '.join(cls.model_fields)}, tenant")
        slots = args.get("slots")
        if slots is not None and not slots.isdigit():
            raise BadInput(f"slots must be a whole number of stream slots, got {slots!r}")
        values: dict[str, Any] = {name: args[name] for name in ("window", "day", "timezone") if name in args}
        if slots is not None:
            values["slots"] = int(slots)
        try:
            return cls(**values)
        except ValidationError as err:
            first = err.errors()[0]
            raise BadInput(f"{'.'.join(str(part) for part in first['loc'])}: {first['msg']}") from None
