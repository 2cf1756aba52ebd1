"""The batch size histograms of /metrics: each model run's rows, and a token model's tokens.

A worker counts every run it makes in memory (`observe_run`, on the run's own thread) and its heartbeat
adds the counts to `keys.batch_sizes` every two seconds (`histograms.Tally.flush`): a run costs no
round trip, and a worker killed outright loses at most its last two seconds of counts. A run is one
`session.run` as SITS asks for it: a merged batch of requests, a job's mini-batch with the requests
riding in it, or a piece of a batch bisected to find its bad rows. Tokens are rows times the padded
sequence length: what the device computes, and what `max_batch_tokens` bounds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from broker.monitoring.histograms import Histogram, Tally, decode

ROW_BUCKETS = tuple(float(2**power) for power in range(11))
"""Upper bounds of the rows histogram: 1, 2, 4, ... 1024 rows."""

TOKEN_BUCKETS = tuple(float(2**power) for power in range(4, 17))
"""Upper bounds of the tokens histogram: 16, 32, ... 65536 tokens (`max_batch_tokens` is 8192 by default)."""

SUM_FIELD = "sum"

_BOUNDS = {"rows": ROW_BUCKETS, "tokens": TOKEN_BUCKETS}


def new_tally() -> Tally:
    """A worker's tally of its runs' sizes, for `keys.batch_sizes`."""
    return Tally(sum_field=SUM_FIELD)


def observe_run(tally: Tally, model_ref: str, rows: int, tokens: int | None) -> None:
    """Count one run of `model_ref` of `rows` rows (and `tokens` tokens, for a token model; None else)."""
    tally.observe(f"{model_ref}|rows", rows, ROW_BUCKETS)
    if tokens is not None:
        tally.observe(f"{model_ref}|tokens", tokens, TOKEN_BUCKETS)


def decode_batch_sizes(raw: Mapping[str, str]) -> dict[tuple[str, str], Histogram]:
    """The `keys.batch_sizes` hash as (model ref, 'rows' or 'tokens') -> `Histogram`."""
    found = {}
    for what, bounds in _BOUNDS.items():
        own = {field: value for field, value in raw.items() if field.rsplit("|", 2)[-2:-1] == [what]}
        for series, histogram in decode(own, len(bounds) + 1, sum_field=SUM_FIELD).items():
            found[(series.rpartition("|")[0], what)] = histogram
    return found


def run_size(shapes: Mapping[str, tuple[int, ...]], sequence_axis: Mapping[str, Any] | None) -> tuple[int, int | None]:
    """(Rows, tokens) of a run whose inputs have `shapes`: rows along the batch axis, and for a token model
    (its static profile's `sequence_axis`, {input, axis}) rows times that input's length on that axis."""
    rows = next((int(shape[0]) for shape in shapes.values() if shape), 0)
    if not sequence_axis:
        return rows, None
    shape = shapes.get(str(sequence_axis.get("input")))
    axis = int(sequence_axis.get("axis") or 0)
    return rows, rows * int(shape[axis]) if shape is not None and 0 < axis < len(shape) else None
