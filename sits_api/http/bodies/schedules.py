"""Schedules, their runs and a window's staggering plan, as `/v1/schedules` answers them
(`sits_api.schedules.definitions` and `planner`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class ScheduleRun(BaseModel):
    """What became of one slot: released (with its job and how it ended), held, refused or missed."""

    slot: str = Field(description="UTC, ISO 8601")
    status: str = Field(description="releasing, released, held, refused or missed")
    job_id: str | None
    job_status: str | None
    reason: str | None
    catch_up: bool
    manual: bool
    due_at: float
    released_at: float | None
    lateness_s: float | None
    deadline: float | None
    predicted_finish: float | None
    finished_at: float | None


class Schedule(BaseModel):
    """A schedule: its cadence, the job each slot releases, its next slot and (read alone) its latest runs."""

    name: str
    tenant: str
    owner: str
    job: dict[str, Any] = Field(description="the POST /v1/jobs body each slot submits")
    cron: str | None
    every: int | None = Field(description="seconds")
    timezone: str
    window: str | None
    deadline: float | None = Field(description="seconds after its slot")
    catch_up: str = Field(description="once or skip")
    after: list[str]
    paused: bool
    created_at: float
    updated_at: float
    release_offset: float
    slot_cap: int | None
    next_slot: str | None = Field(description="UTC, ISO 8601; null while paused")
    runs: list[ScheduleRun] | None = Field(None, description="GET /v1/schedules/{name} and changes: the latest runs")


class ScheduleList(BaseModel):
    """`GET /v1/schedules`: by tenant and name."""

    schedules: list[Schedule]


class LeftOut(BaseModel):
    """A schedule with slots in the window that the plan could not cost, and why."""

    schedule: str
    tenant: str
    reason: str


class PlanLoad(BaseModel):
    """The fleet's load over the window under one set of releases."""

    peak_slots: int
    peak_rows_per_second: float
    late_runs: int


class StoredRelease(BaseModel):
    """A schedule's release offset and slot cap as stored now."""

    offset_s: float
    max_slots: int | None


class PlanRunRow(BaseModel):
    """One planned run: its release offset and slot cap, and its finish before and after staggering."""

    schedule: str
    tenant: str
    slot: str | None
    deadline: str | None
    rows: int
    slot_seconds: float
    offset_s: float
    max_slots: int | None
    stored: StoredRelease | None
    finish_before: str | None
    finish: str | None
    predicted_finish: str | None
    admitted: bool
    on_time: bool


class Plan(BaseModel):
    """`GET` and `POST /v1/schedules/plan`: the window's runs staggered to the lowest peak with every run on
    time, or why no plan is feasible."""

    window: str | None
    from_: str | None = Field(alias="from")
    until: str | None
    slots: int = Field(description="the fleet's stream slots planned for")
    left_out: list[LeftOut]
    feasible: bool
    before: PlanLoad
    after: PlanLoad | None = None
    peak_drop: float | None = None
    runs: list[PlanRunRow]
    response_time_analysis: dict[str, Any] | None = None
    applied: list[str] = Field([], description="POST: the schedules whose offset and cap were stored")
    reason: str | None = Field(None, description="an infeasible plan's why")
