"""The `jobs` settings section: how offline jobs are chunked, batched, retried and quarantined."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from broker.setting_types import Bytes, Integer, Number, Seconds, count_or_auto, parse_duration, parse_size
from broker.setting_types import Section as _Section


class JobSettings(_Section):
    """Defaults for offline jobs."""

    chunk_size: int | Literal["auto"] = "auto"
    """Rows per queue item for jobs that do not set one; `auto`: about `chunk_seconds` of work at the
    model's measured throughput, in whole batches, split over live workers and capped by
    `max_chunk_output_bytes` (broker/jobs/chunking.py); 4096 for a model without a usable profile (a
    measured one, or an observed one with batches of 128 rows or more)."""
    chunk_seconds: Seconds = Field(1.0, gt=0)
    """How long an `auto` chunk runs; each chunk has a fixed cost of a few ms (lease, part file, ack)."""
    max_chunk_output_bytes: Bytes = parse_size("64MiB")
    """Most output bytes in an `auto` chunk: a worker holds them in memory until its part file is
    written (0: no cap)."""
    batch_size: int | Literal["auto"] = "auto"
    """Rows per ONNX Runtime run for jobs that do not set one; `auto`: the model's best measured
    batch size (the smallest within 5 % of the best rows/s a job gets, its profile's rows/s less a
    mini-batch's own cost, broker/jobs/chunking.py); 128 for a model without a usable profile."""
    merge_chunks: Integer = Field(1, ge=1)
    """Most job chunks one lease takes as a run unit (broker/jobs/granularity.py): a slot that leases a
    chunk takes further waiting chunks of the same model along, of any job of its tenant, while together
    they run within `unit_seconds`, and runs them in shared mini-batches, each chunk committed on its
    own; 1 (the default: no gain was measured on a CPU, docs/benchmarks.md): every chunk runs alone."""
    unit_seconds: Seconds = Field(0.1, gt=0)
    """How long a run unit of several chunks may run at the model's rate: it holds its slot throughout
    (online requests do not ride in it), so it is kept well below `chunk_seconds`."""
    split_chunks: bool = False
    """A running chunk that would run more than twice `chunk_seconds` at the rate it shows ends early at a
    mini-batch boundary once it has run `chunk_seconds`; the rest of its rows is queued as a new chunk of its
    job (broker/jobs/cuts.py). So a chunk's size follows the rate the run shows, not only the profile. Off by
    default: a client that sets `chunk_size` gets chunks of that size."""
    retention: Seconds = Field(parse_duration("7d"), ge=0)
    """How long an ended job's record, done set and index entries stay in Redis after it ended (the
    files it wrote stay): the reaper then forgets it, and it answers 404 (0: keep every job)."""
    max_attempts: Integer = Field(3, ge=1)
    """A chunk (or request) whose lease ran out this many times fails its job (poison batch): the
    attempts of `retry.worker_lost` unless that sets its own. Failures of other classes count
    against their own `retry.<class>.attempts`."""
    max_bad_rows: int | float = 0.001
    """Most rows of a job that may fail for their input and be quarantined (docs/failures.md,
    "Bad-row quarantine"): a whole number is a count, a number between 0 and 1 a share of the job's
    rows (rounded down). One more fails the job, naming them; 0 fails it at its first failing batch,
    with that batch's error, unbisected."""
    quarantine_fill: Literal["nan"] | Number = "nan"
    """What a quarantined row holds in a float output (integer outputs: -1, or 0 when unsigned,
    unless this is a whole number they can hold)."""

    @field_validator("chunk_size", "batch_size", mode="before")
    @classmethod
    def _rows_or_auto(cls, value: Any) -> Any:
        return count_or_auto(value, "a number of rows (>= 1)")

    @field_validator("max_bad_rows", mode="before")
    @classmethod
    def _count_or_share(cls, value: Any) -> Any:
        text = value.strip() if isinstance(value, str) else value
        try:
            number = float(text) if isinstance(text, str | int | float) and not isinstance(text, bool) else None
        except ValueError:
            number = None
        if number is not None and number >= 1 and number == int(number):
            return int(number)
        if number is not None and 0 <= number < 1:
            return int(number) if number == 0 else number
        raise ValueError(f"{value!r} is neither a count of rows (a whole number >= 0) nor a share between 0 and 1")
