"""Option types and checks for `sitsctl`: bad values fail as click usage errors that say what to give instead."""

from __future__ import annotations

from typing import Any

import click


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


def non_empty(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """Refuses an empty or blank text option (a key or model with no name cannot be told apart)."""
    if not value.strip():
        raise click.BadParameter("must not be empty", ctx, param)
    return value
