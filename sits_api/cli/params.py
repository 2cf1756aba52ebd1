"""Option types and checks for `sitsctl`: bad values fail as click usage errors that say what to give instead."""

from __future__ import annotations

from typing import Any

import click

from broker.jobs.records import JOB_ID_PATTERN as JOB_ID  # every job id the API makes: 'j' and 12 hex digits
from broker.setting_types import parse_duration


class ShapeType(click.ParamType):
    """A per-sample shape such as `3,32,32`: positive integers separated by commas."""

    name = "shape"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> list[int]:
        """The shape as a list of ints; fails on empty parts, non-numbers and dimensions below 1."""
        if isinstance(value, list):
            return value
        try:
            dims = [int(dim) for dim in str(value).split(",")]
        except ValueError:
            dims = []
        if not dims or min(dims) < 1:
            self.fail(f"{value!r} is not a shape: give positive integers separated by commas, e.g. 3,32,32",
                      param, ctx)
        return dims


SHAPE = ShapeType()


class JobIdType(click.ParamType):
    """A job id as the API makes them (`JOB_ID`), checked before any HTTP call.

    Anything else names no job the API can hold, and one holding '/' reaches another route (the
    server decodes %2F before routing), whose answer is a 404 or 405 that names no job.
    """

    name = "job_id"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        """The id unchanged; fails on anything that is not 'j' and 12 lowercase hex digits."""
        if isinstance(value, str) and JOB_ID.fullmatch(value):
            return value
        self.fail(f"{value!r} is not a job id: job ids are 'j' and 12 hex digits, like j3fa9c01b2e7d, as "
                  "`sitsctl job submit` and `sitsctl job list` print them", param, ctx)


JOB_ID_ARGUMENT = JobIdType()


class DeadlineType(click.ParamType):
    """A job's deadline: a duration from now (`10m`, `90s`, `1h`) or an RFC 3339 time with its offset.

    Converts to the `POST /v1/jobs` field that carries it: `{"deadline_s": seconds}` or
    `{"deadline": time}` (the API checks the time itself, and says what is wrong with it)."""

    name = "deadline"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> dict[str, Any]:
        """The body field for `value`; fails on what is neither a positive duration nor a time."""
        if isinstance(value, dict):
            return value
        text = str(value).strip()
        if "T" in text or ":" in text:
            return {"deadline": text}
        try:
            seconds = parse_duration(text)
        except ValueError:
            seconds = 0.0
        if seconds <= 0:
            self.fail(f"{value!r} is not a deadline: give a duration from now such as 10m, 90s or 1h, or a time "
                      "such as 2026-12-01T10:42:00Z", param, ctx)
        return {"deadline_s": seconds}


DEADLINE = DeadlineType()


def non_empty(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """Refuses an empty or blank text option (a key or model with no name cannot be told apart)."""
    if not value.strip():
        raise click.BadParameter("must not be empty", ctx, param)
    return value
