"""How many rows an offline job puts in one chunk, and in one run, when the job does not say
(`jobs.chunk_size: auto`, `jobs.batch_size: auto`).

Every chunk pays a fixed cost whatever its size: a lease, a Redis read of the
job, a part file written and fsynced, an ack, its share of the final merge
(about 4 ms on the 2-core reference machine, docs/benchmarks.md). A fixed
4,096 rows is 5 ms of the zoo MLP's work, so that cost halves its
throughput, while the same 4,096 rows are 3 s of the CNN's. So the size is
chosen in time, not rows: about `jobs.chunk_seconds` of work at the model's
measured throughput for the job's batch size.
"""

from __future__ import annotations

import math

from broker.models.model_record import ModelRecord, ProfilePoint

FALLBACK_CHUNK_ROWS = 4096
"""Rows per chunk for a model without a usable profile (see `throughput_points`)."""

FALLBACK_BATCH_ROWS = 128
"""Rows per run for a model without a usable profile."""

BEST_BATCH_SLACK = 0.05
"""An `auto` batch is the smallest measured size within this share of the best rows/s a job gets."""

MINI_BATCH_OVERHEAD_SECONDS = 0.00005
"""What one of a job's mini-batches costs besides its run: the boundary's checks, the copy of its
outputs, its bill (about 20 us on the 2-core reference machine, docs/benchmarks.md; rounded up). A
profile times bare runs, so a job's rows/s at a batch size is below the profile's by this much a run."""

CHUNKS_PER_WORKER = 2
"""Fewest chunks per live worker that a job is split into when it has the rows for it."""

MAX_CHUNKS_PER_JOB = 100_000
"""Most chunks one job may have: each is a queue item (a few hundred bytes of Redis memory) queued
and, on a stop, taken out at submit time (100,000 took 3 s to submit and 2 s to cancel on 2 cores)."""


def least_chunk_size(rows_total: int, batch_size: int = 1) -> int:
    """The smallest chunk size, in whole batches, that cuts `rows_total` into `MAX_CHUNKS_PER_JOB` chunks
    at most."""
    return math.ceil(math.ceil(rows_total / MAX_CHUNKS_PER_JOB) / batch_size) * batch_size


def throughput_points(record: ModelRecord) -> list[ProfilePoint]:
    """The profile points a job's sizes may be chosen from, by batch size: every point of a measured
    profile; of an observed one (the sizes workers happened to run, `sits_worker/device/observed_profiles.py`) only
    those from `FALLBACK_BATCH_ROWS` up, since small online batches alone say nothing of where a
    job's throughput lies."""
    points = [point for point in record.profile_points if float(point.get("rows_per_second") or 0) > 0]
    if record.observed_profile:
        points = [point for point in points if int(point["batch_size"]) >= FALLBACK_BATCH_ROWS]
    return sorted(points, key=lambda point: int(point["batch_size"]))


def profiled_rows_per_second(record: ModelRecord, batch_size: int) -> float | None:
    """Measured rows/s of a model at `batch_size`, from its registry record; None without a profile.

    The point measured at the largest batch size not above `batch_size` (throughput rarely falls
    as batches grow, so this errs towards smaller chunks); the smallest point when every one is
    larger, the largest when the profile stopped before `batch_size` (slow models are measured
    only up to the batch size where a run takes a third of the profiling budget).
    """
    points = throughput_points(record)
    if not points or (record.observed_profile and batch_size < FALLBACK_BATCH_ROWS):
        return None  # (an observed rate at 128 rows and up would overstate a smaller batch's)
    below = [point for point in points if point["batch_size"] <= batch_size]
    return float((below[-1] if below else points[0])["rows_per_second"])


def auto_batch_size(record: ModelRecord) -> int:
    """Rows per run for a job of the model whose registry record is `record`: its best batch size.

    The measured profile's best throughput is the ceiling an offline job aims at (the bare ONNX
    Runtime loop at its best batch size). A job also pays `MINI_BATCH_OVERHEAD_SECONDS` a run, which
    weighs on fast models' small batches (a 512-row run of the zoo MLP takes 0.4 ms here), so each size is
    judged by the rows/s a job gets at it (`job_rows_per_second`). The smallest batch size within
    `BEST_BATCH_SLACK` of the best is taken, since a smaller batch holds less memory and lets online
    work in sooner (a job yields between batches). Without usable profile points
    (`throughput_points`): `FALLBACK_BATCH_ROWS`.
    """
    points = throughput_points(record)
    if not points:
        return FALLBACK_BATCH_ROWS
    rates = {int(point["batch_size"]): job_rows_per_second(int(point["batch_size"]), float(point["rows_per_second"]))
             for point in points}
    best = max(rates.values())
    return min(size for size, rate in rates.items() if rate >= best * (1 - BEST_BATCH_SLACK))


def job_rows_per_second(batch_size: int, rows_per_second: float) -> float:
    """The rows/s a job gets at `batch_size` where a bare run does `rows_per_second`: each run's time
    plus `MINI_BATCH_OVERHEAD_SECONDS`."""
    return batch_size / (batch_size / rows_per_second + MINI_BATCH_OVERHEAD_SECONDS)


def output_bytes_per_row(record: ModelRecord) -> int:
    """Bytes of all outputs of one row, from the static profile (0 when unknown).

    For a token model this is a row of the profile's reference sequence length.
    """
    return int(record.static_profile.get("output_bytes_per_sample") or 0)


def auto_chunk_size(*, rows_total: int, batch_size: int, rows_per_second: float | None, output_bytes_per_row: int,
                    live_workers: int, chunk_seconds: float, max_chunk_output_bytes: int,
                    live_slots: int | None = None) -> int:
    """Rows per chunk for a job: about `chunk_seconds` of work, in whole batches, within bounds.

    - Time: `rows_per_second * chunk_seconds` rows, so the fixed cost per chunk is a small share
      (4 ms of 1 s is 0.4 %) for fast and slow models alike. It is also how much work a crash can
      lose per stream, and how long a chunk may hold a worker that another job's items wait for
      (a running chunk still lets outranking online requests through between its mini-batches).
    - Even split: a job of several chunks' work is cut into equal chunks of whole batches (the
      last one shorter by less than a batch per chunk), not into target-sized ones plus a small
      remainder that runs alone at the end.
    - Parallelism: at least `CHUNKS_PER_WORKER` chunks per live worker (none alive counts as one),
      and one per live stream slot (`live_slots`: a CPU worker's streams, a GPU worker's once, as
      `figures.LiveFleet.slots` counts them; by default one per worker), when the job has that
      many batches, so a short job still spreads over every worker and a worker that finishes early
      finds work left to take.
    - Whole rounds: the count of chunks is rounded up to a multiple of `live_slots` before the batches
      are split evenly, so the job's last round of chunks keeps the slots busy. On a CPU worker each
      stream has its own cores (streams x intra-op threads fit the cores), so 7 one-second chunks on
      2 streams ran 4 s with one core idle the last second; 8 chunks of 7/8 s run 3.5 s (a
      8,192-image CNN job on 2 cores went from 0.85 to 0.96 of the bare loop). Each added chunk costs
      its fixed cost only. Whole batches may leave the count short of the multiple (100 batches make
      15 chunks of 7 or 17 of 6, never 16): then the last round is short of a chunk or a few.
    - Memory: a worker holds a chunk's outputs in memory until its part file is written, and
      the part file is that size, so a chunk's outputs stay within `max_chunk_output_bytes`
      (`output_bytes_per_row` rows' worth; 0 means unknown and no cap), but never below one batch.
    - Without a measured throughput (`rows_per_second` None): `FALLBACK_CHUNK_ROWS`, in whole batches
      (at least one), within the memory cap.
    - Count: never more than `MAX_CHUNKS_PER_JOB` chunks, even where that takes chunks over the
      memory cap (a job of more than 100,000 capped chunks' rows).
    """
    if rows_per_second is None or rows_per_second <= 0:
        chunk = max(1, FALLBACK_CHUNK_ROWS // batch_size) * batch_size
    else:
        batches_total = max(1, math.ceil(rows_total / batch_size))
        slots = max(1, live_workers if live_slots is None else live_slots)
        least_chunks = min(max(CHUNKS_PER_WORKER * max(1, live_workers), slots), batches_total)
        time_chunks = math.ceil(rows_total / max(1.0, rows_per_second * chunk_seconds))
        whole_rounds = min(math.ceil(max(time_chunks, least_chunks) / slots) * slots, batches_total)
        batches_per_chunk = math.ceil(batches_total / whole_rounds)
        if math.ceil(batches_total / batches_per_chunk) < least_chunks:  # rounding up left too few
            batches_per_chunk = batches_total // least_chunks
        chunk = batches_per_chunk * batch_size
    if output_bytes_per_row > 0 and max_chunk_output_bytes > 0:
        cap_batches = max(1, max_chunk_output_bytes // (output_bytes_per_row * batch_size))
        chunk = min(chunk, cap_batches * batch_size)
    return max(chunk, least_chunk_size(rows_total, batch_size))  # (above the memory cap for a huge job)


def chunk_size_for(record: ModelRecord, *, rows_total: int, batch_size: int, live_workers: int,
                   chunk_seconds: float, max_chunk_output_bytes: int, calibration: float = 1.0,
                   live_slots: int | None = None) -> int:
    """`auto_chunk_size` for a job of the model whose registry record is `record`, at its profile's rate
    over `calibration`: how much longer its chunks really run than the profile says (deadline
    admission learns it from their slot time, `figures.calibrations`). A profile measured on an idle
    stream is faster than a stream beside others runs, and chunks sized from it alone hold a slot (and
    the work behind them) several times `chunk_seconds`."""
    rate = profiled_rows_per_second(record, batch_size)
    return auto_chunk_size(rows_total=rows_total, batch_size=batch_size,
                           rows_per_second=rate / max(calibration, 1e-3) if rate else rate,
                           output_bytes_per_row=output_bytes_per_row(record), live_workers=live_workers,
                           live_slots=live_slots, chunk_seconds=chunk_seconds,
                           max_chunk_output_bytes=max_chunk_output_bytes)
