"""How much job work one lease takes, and one chunk runs: chosen as the work runs, not when a job is cut.

Two decisions, both pure: the run unit (`choose_unit`: how many waiting chunks a lease takes together) and
a split (`split_row`: where a chunk running far past its plan ends, its rest queued as a new chunk).

A job is cut into chunks at submit, for the job alone: about `jobs.chunk_seconds` of work each, and at
least one per slot so that a short job spreads over the fleet (`chunking.auto_chunk_size`). What a slot
should run at once depends on what waits when it leases. What weighs on it on SITS (docs/scheduling.md,
"Run units"; measured on the 2-core reference machine, docs/benchmarks.md):

- every chunk pays a lease, a read of its job, a part file written and fsynced, an ack and its share of
  the final merge, whatever its rows; a unit saves the leases and job reads, not the rest;
- on a CPU, ONNX Runtime's rows/s hardly change with the batch (the zoo CNN: 864 images/s one at a
  time, 1,050 in batches of 16), so a larger batch buys little there; on a GPU it buys most;
- a unit holds its slot until it ends, so how long it runs is what others wait behind it (online
  requests ride between a chunk's mini-batches; a merged unit is kept shorter than one chunk instead);
- a unit's outputs stay in memory until their part files are written.

So, with `jobs.merge_chunks` above 1 (off by default: on a 2-core CPU no gain was measured,
docs/benchmarks.md), a slot that leases a chunk takes further waiting chunks of the same model along, of any
job of the same tenant (one tenant's rows that crash a run must not cost another's chunks their attempts), in
queue order (their tenants' fair-share order included), while together they run within `unit_seconds`
at the model's rate and their outputs within `max_output_bytes`; the worker runs them in shared
mini-batches and commits each chunk on its own, so exactly-once holds per chunk as before. A chunk of
a large job, about a second of work, fills a unit by itself and runs alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RunUnit:
    """What one lease of job chunks may take (`leases.LeaseOptions.max_chunks` and `merge_rows`)."""

    max_chunks: int
    """Most chunks (1: the head chunk alone)."""
    max_rows: int
    """Most rows of all of them together (0 with `max_chunks` 1: no limit, the head goes whatever its size)."""


ALONE = RunUnit(max_chunks=1, max_rows=0)
"""The head chunk alone, as every lease took before run units."""


def choose_unit(*, batch_rows: int, rows_per_second: float | None, unit_seconds: float, most_chunks: int,
                output_bytes_per_row: int = 0, max_output_bytes: int = 0) -> RunUnit:
    """The run unit for a lease of a model whose job mini-batches hold `batch_rows` rows and run at
    `rows_per_second` (its measured or observed profile; None: unknown).

    Rows: what runs in `unit_seconds` at that rate, but at least one mini-batch (a unit that merges
    nothing gains nothing); within `max_output_bytes` of outputs at `output_bytes_per_row` (0: unknown or
    no cap), never below one mini-batch. Without a rate (a model registered with a static profile, no runs
    observed yet) how long a unit would run is unknown: `ALONE`, as is `most_chunks` 1 and a mini-batch of
    one row.
    """
    if most_chunks <= 1 or batch_rows < 2 or rows_per_second is None or rows_per_second <= 0:
        return ALONE
    rows = max(batch_rows, math.floor(rows_per_second * unit_seconds))
    if output_bytes_per_row > 0 and max_output_bytes > 0:
        rows = min(rows, max(batch_rows, max_output_bytes // output_bytes_per_row))
    return RunUnit(max_chunks=most_chunks, max_rows=rows)


SPLIT_AFTER = 2.0
"""A running chunk whose whole run, at the rate it shows, would pass this many times `jobs.chunk_seconds`
ends early (`split_row`)."""


def split_row(*, start: int, stop: int, next_row: int, elapsed: float, chunk_seconds: float, batch_rows: int,
              after: float = SPLIT_AFTER) -> int | None:
    """The row at which a running chunk of rows [start, stop) should end, its rest queued as a new chunk;
    None to run it to its end. `next_row`: the first row not run yet, `elapsed` seconds after it began.

    A chunk is cut at submit to about `chunk_seconds` of work at the model's measured rate. When it runs
    slower than that (other models share the device, the profile was taken on an idle one, the client
    chose a large chunk size), it holds its slot, the work behind it and its job's other slots' share for
    longer. So once it has run `chunk_seconds`, if at the rate it shows the whole would take more than
    `after` times that, it ends at the mini-batch boundary it is at; the rest, requeued, is taken by any
    idle slot and may split again. Less than one mini-batch left is not worth a chunk: it runs on.
    """
    done = next_row - start
    if done <= 0 or elapsed < chunk_seconds or stop - next_row < batch_rows:
        return None
    rate = done / elapsed
    if (stop - start) / rate <= after * chunk_seconds:
        return None
    return next_row
