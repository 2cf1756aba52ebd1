"""Chunk sizes of `jobs.chunk_size: auto`: about `chunk_seconds` of work, whole batches, within bounds."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.config.loading import load_settings
from broker.config.settings import Settings
from broker.errors import ConfigError
from broker.jobs import records as jobs
from broker.jobs.chunking import (
    FALLBACK_BATCH_ROWS,
    FALLBACK_CHUNK_ROWS,
    MAX_CHUNKS_PER_JOB,
    auto_batch_size,
    auto_chunk_size,
    chunk_size_for,
    job_rows_per_second,
    least_chunk_size,
    profiled_rows_per_second,
)
from broker.models.model_record import ModelRecord

MiB = 1024**2


def size(**overrides: Any) -> int:
    arguments: dict[str, Any] = {"rows_total": 10_000_000, "batch_size": 128, "rows_per_second": 100_000.0,
                                 "output_bytes_per_row": 40, "live_workers": 1, "chunk_seconds": 1.0,
                                 "max_chunk_output_bytes": 64 * MiB}
    return auto_chunk_size(**(arguments | overrides))


def record(points: list[tuple[int, float]], output_bytes: int = 40) -> ModelRecord:
    return ModelRecord.of({
        "profile": {"points": [{"batch_size": batch, "latency_ms": batch / rate * 1000, "rows_per_second": rate}
                               for batch, rate in points]},
        "static_profile": {"output_bytes_per_sample": output_bytes}})


# --- the time target ------------------------------------------------------------------------


def test_a_chunk_holds_about_chunk_seconds_of_work_in_whole_batches() -> None:
    chunk = size(rows_per_second=100_000.0, chunk_seconds=1.0)

    assert chunk % 128 == 0
    assert 100_000 - 128 < chunk < 100_000 + 128


def test_a_slow_model_gets_smaller_chunks_than_a_fast_one() -> None:
    assert size(rows_per_second=1_300.0, batch_size=64) < size(rows_per_second=800_000.0) // 100


def test_longer_chunk_seconds_give_proportionally_longer_chunks() -> None:
    assert abs(size(chunk_seconds=2.0) - 2 * size(chunk_seconds=1.0)) <= 2 * 128


def test_a_chunk_is_never_less_than_one_batch() -> None:
    assert size(rows_per_second=10.0, batch_size=128) == 128


def test_a_job_is_split_evenly_rather_than_leaving_a_small_last_chunk() -> None:
    # 8,192 rows of about 1,950-row chunks: 5 chunks of 26 batches (the last 24), not 4 x 1,920 + 512
    chunk = size(rows_total=8192, batch_size=64, rows_per_second=1_950.0)

    ranges = jobs.chunk_ranges(8192, chunk)
    assert chunk == 26 * 64
    assert len(ranges) == 5
    assert ranges[-1][1] - ranges[-1][0] == 24 * 64


# --- parallelism ----------------------------------------------------------------------------


def test_a_short_job_is_split_into_two_chunks_per_live_worker() -> None:
    chunk = size(rows_total=102_400, rows_per_second=1_000_000.0, live_workers=4)  # 800 batches of 128

    assert chunk == 100 * 128
    assert len(jobs.chunk_ranges(102_400, chunk)) == 8


def test_no_live_worker_counts_as_one() -> None:
    assert size(rows_total=100_000, rows_per_second=1_000_000.0, live_workers=0) == size(
        rows_total=100_000, rows_per_second=1_000_000.0, live_workers=1)


def test_a_short_job_is_split_evenly_over_the_workers_without_a_small_extra_chunk() -> None:
    chunk = size(rows_total=1_000_000, rows_per_second=800_000.0, live_workers=1)  # 7,813 batches

    assert len(jobs.chunk_ranges(1_000_000, chunk)) == 2
    assert chunk == 3907 * 128


def test_a_job_of_a_few_batches_still_gets_two_chunks_per_worker() -> None:
    chunk = size(rows_total=5 * 128, rows_per_second=1_000_000.0, live_workers=2)

    assert chunk == 128  # 2 batches a chunk would make 3 chunks for 2 workers
    assert len(jobs.chunk_ranges(5 * 128, chunk)) == 5


def test_a_job_of_few_batches_is_not_split_below_one_batch_per_chunk() -> None:
    chunk = size(rows_total=300, batch_size=128, rows_per_second=1_000_000.0, live_workers=8)

    assert chunk == 128
    assert len(jobs.chunk_ranges(300, chunk)) == 3


def test_a_long_job_keeps_about_time_sized_chunks_whatever_the_workers() -> None:
    one, sixteen = size(live_workers=1), size(live_workers=16)  # 100 chunks' work, 112 chunks for 16

    assert one == 100_096 and 0.85 * one < sixteen <= one


def test_chunks_come_in_whole_rounds_of_the_live_stream_slots() -> None:
    """7 chunks' work on 2 single-thread streams would leave one core idle for the last chunk: 8 it is."""
    chunk = size(rows_total=8_192, batch_size=2, rows_per_second=1_172.0, live_workers=1, live_slots=2)

    assert len(jobs.chunk_ranges(8_192, chunk)) == 8 and chunk == 512 * 2
    assert len(jobs.chunk_ranges(8_192, size(rows_total=8_192, batch_size=2, rows_per_second=1_172.0,
                                              live_workers=1))) == 7  # one slot: no rounding


def test_whole_batches_may_leave_the_count_a_little_short_of_a_multiple_of_the_slots() -> None:
    """100 batches of 128 rows, 10 chunks' work, 8 slots: 16 chunks asked, 15 of 7 batches cut."""
    chunk = size(rows_total=12_800, rows_per_second=1_280.0, live_workers=1, live_slots=8)

    assert chunk == 7 * 128 and len(jobs.chunk_ranges(12_800, chunk)) == 15


def test_a_short_job_gets_a_chunk_for_every_stream_slot() -> None:
    chunk = size(rows_total=102_400, rows_per_second=1_000_000.0, live_workers=2, live_slots=8)

    assert len(jobs.chunk_ranges(102_400, chunk)) == 8


# --- memory ---------------------------------------------------------------------------------


def test_a_chunk_s_outputs_stay_within_max_chunk_output_bytes() -> None:
    chunk = size(rows_per_second=1_000_000.0, output_bytes_per_row=128 * 1024, max_chunk_output_bytes=64 * MiB)

    assert chunk * 128 * 1024 <= 64 * MiB
    assert chunk == 512


def test_the_output_cap_never_goes_below_one_batch() -> None:
    assert size(output_bytes_per_row=MiB, max_chunk_output_bytes=MiB, batch_size=32, rows_total=1_000_000) == 32


def test_unknown_output_bytes_or_a_zero_cap_mean_no_cap() -> None:
    uncapped = size(rows_per_second=1_000_000.0, output_bytes_per_row=0)

    assert uncapped > MiB // 40
    assert size(rows_per_second=1_000_000.0, output_bytes_per_row=40, max_chunk_output_bytes=MiB) < uncapped
    assert size(rows_per_second=1_000_000.0, output_bytes_per_row=40, max_chunk_output_bytes=0) == uncapped


def test_a_huge_job_gets_chunks_large_enough_for_max_chunks_per_job_even_over_the_output_cap() -> None:
    chunk = size(rows_total=100_000_000, rows_per_second=1_000.0, batch_size=128,
                 output_bytes_per_row=MiB, max_chunk_output_bytes=64 * MiB)  # 1 s and the cap: 128 rows

    assert chunk == 1024 and math.ceil(100_000_000 / chunk) <= MAX_CHUNKS_PER_JOB  # 8 batches
    assert least_chunk_size(100_000_000, 128) == 1024 and least_chunk_size(10, 4) == 4


# --- without a profile ----------------------------------------------------------------------


def test_without_a_measured_throughput_the_fallback_size_applies() -> None:
    assert size(rows_per_second=None) == FALLBACK_CHUNK_ROWS
    assert size(rows_per_second=None, rows_total=10) == FALLBACK_CHUNK_ROWS


def test_the_fallback_size_is_whole_batches() -> None:
    assert size(rows_per_second=None, batch_size=100) == 4000  # 40 batches, not 40.96
    assert size(rows_per_second=None, batch_size=5000) == 5000  # one batch, however large


def test_the_fallback_size_respects_the_output_cap() -> None:
    assert size(rows_per_second=None, output_bytes_per_row=128 * 1024, max_chunk_output_bytes=64 * MiB) == 512


# --- properties -----------------------------------------------------------------------------


@given(rows_total=st.integers(1, 10**8), batch_size=st.integers(1, 4096),
       rows_per_second=st.floats(0.01, 1e8), output_bytes_per_row=st.integers(0, 10**7),
       live_workers=st.integers(0, 64), streams=st.integers(1, 8), chunk_seconds=st.floats(0.01, 60))
def test_every_auto_size_is_whole_batches_within_its_bounds(
        rows_total: int, batch_size: int, rows_per_second: float, output_bytes_per_row: int, live_workers: int,
        streams: int, chunk_seconds: float) -> None:
    cap = 64 * MiB
    chunk = size(rows_total=rows_total, batch_size=batch_size, rows_per_second=rows_per_second,
                 output_bytes_per_row=output_bytes_per_row, live_workers=live_workers,
                 live_slots=live_workers * streams, chunk_seconds=chunk_seconds, max_chunk_output_bytes=cap)

    assert chunk >= batch_size and chunk % batch_size == 0
    least = least_chunk_size(rows_total, batch_size)  # the count bound comes before the others
    assert math.ceil(rows_total / chunk) <= MAX_CHUNKS_PER_JOB
    if output_bytes_per_row and chunk > max(batch_size, least):
        assert chunk * output_bytes_per_row <= cap
    target_batches = max(1, math.ceil(rows_per_second * chunk_seconds / batch_size))
    assert chunk <= max(target_batches * batch_size, least)  # at most the time target, rounded up to a batch
    chunks = math.ceil(rows_total / chunk)
    batches = math.ceil(rows_total / batch_size)
    assert chunks >= min(max(2 * live_workers, live_workers * streams, 2), batches) or chunk == batch_size


# --- reading the model's record -------------------------------------------------------------


def test_the_profile_point_at_the_job_s_batch_size_gives_the_rate() -> None:
    measured = record([(1, 40_000.0), (64, 600_000.0), (128, 800_000.0), (256, 900_000.0)])

    assert profiled_rows_per_second(measured, 128) == 800_000.0
    assert profiled_rows_per_second(measured, 200) == 800_000.0  # the largest measured batch not above it
    assert profiled_rows_per_second(measured, 4096) == 900_000.0


def test_a_profile_that_stopped_early_uses_its_largest_batch() -> None:
    measured = record([(1, 1_200.0), (2, 1_300.0), (4, 1_350.0)])

    assert profiled_rows_per_second(measured, 64) == 1_350.0


def test_a_model_without_a_measured_profile_has_no_rate() -> None:
    assert profiled_rows_per_second(ModelRecord.of({"static_profile": {"output_bytes_per_sample": 40}}), 128) is None
    assert profiled_rows_per_second(ModelRecord.of({"profile": {"points": []}}), 128) is None


def test_chunk_size_for_a_record_uses_its_rate_and_output_bytes() -> None:
    measured = record([(64, 1_000.0)], output_bytes=1024 * 1024)

    assert chunk_size_for(measured, rows_total=10**6, batch_size=64, live_workers=1, chunk_seconds=2.0,
                          max_chunk_output_bytes=64 * MiB) == 64  # 2,000 rows of work, but only 64 fit 64 MiB
    assert chunk_size_for(record([(64, 1_000.0)]), rows_total=10**6, batch_size=64, live_workers=1,
                          chunk_seconds=2.0, max_chunk_output_bytes=64 * MiB) == 2_048


# --- the settings ---------------------------------------------------------------------------


def test_jobs_chunk_size_is_auto_by_default_and_takes_a_number_of_rows() -> None:
    assert Settings().jobs.chunk_size == "auto"
    assert load_settings(environ={"SITS_JOBS__CHUNK_SIZE": "8192"}).jobs.chunk_size == 8192
    assert load_settings(environ={"SITS_JOBS__CHUNK_SECONDS": "500ms"}).jobs.chunk_seconds == 0.5
    assert load_settings(environ={"SITS_JOBS__MAX_CHUNK_OUTPUT_BYTES": "1MiB"}).jobs.max_chunk_output_bytes == MiB


@pytest.mark.parametrize("value", ["0", "-1", "automatic", "1.5"])
def test_a_chunk_size_that_is_neither_rows_nor_auto_is_a_config_error(value: str) -> None:
    with pytest.raises(ConfigError, match=r"jobs.chunk_size: .*neither a number of rows \(>= 1\) nor 'auto'"):
        load_settings(environ={"SITS_JOBS__CHUNK_SIZE": value})


def test_a_zero_chunk_seconds_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="jobs.chunk_seconds"):
        load_settings(environ={"SITS_JOBS__CHUNK_SECONDS": "0s"})


def _profiled(curve: dict[int, float]) -> ModelRecord:
    return ModelRecord.of({"profile": {"points": [
        {"batch_size": size, "latency_ms": size / rate * 1000, "rows_per_second": rate}
        for size, rate in curve.items()]}})


def test_an_auto_batch_is_the_smallest_within_5_percent_of_the_best_rows_per_second_a_job_gets() -> None:
    """A job pays a fixed cost a mini-batch besides its run: a fast model's small batches lose more
    of their rows/s to it than the bare runs the profile timed."""
    fast = {128: 770_000, 256: 936_000, 512: 1_000_000, 1024: 1_020_000, 2048: 660_000}
    # A job at 512 rows gets 512 / (0.512 ms + 0.05 ms) = 911,000 rows/s, at 1,024 rows 971,000: 512's bare
    # rate is within 5 % of the best, its rate in a job is not.
    assert job_rows_per_second(512, 1_000_000) == pytest.approx(911_032, rel=1e-4)
    assert auto_batch_size(_profiled(fast)) == 1024
    slow = {1: 1_500, 2: 1_700, 8: 1_750, 32: 1_760}  # (a CNN on a CPU: milliseconds a row)
    assert auto_batch_size(_profiled(slow)) == 8  # 1,731 rows/s in a job, within 5 % of 32's 1,755
    assert auto_batch_size(ModelRecord.of({"profile": {"points": []}})) == FALLBACK_BATCH_ROWS
    assert auto_batch_size(ModelRecord.of({})) == FALLBACK_BATCH_ROWS


def test_an_observed_profile_sets_the_job_batch_only_from_the_fallback_size_up() -> None:
    """Workers observe the sizes they happen to run: small online batches alone must not shrink a
    job's batch below the fallback, since they say nothing of where throughput peaks."""
    online_only = {"profile": {"source": "observed", "points": [
        {"batch_size": 1, "latency_ms": 0.1, "rows_per_second": 10_000.0},
        {"batch_size": 8, "latency_ms": 0.2, "rows_per_second": 40_000.0}]}}
    with_jobs = {"profile": {"source": "observed", "points": [
        *online_only["profile"]["points"],
        {"batch_size": 128, "latency_ms": 1.0, "rows_per_second": 128_000.0},
        {"batch_size": 256, "latency_ms": 2.0, "rows_per_second": 128_000.0}]}}

    assert auto_batch_size(ModelRecord.of(online_only)) == FALLBACK_BATCH_ROWS
    assert auto_batch_size(ModelRecord.of(with_jobs)) == 128  # within 5 % of the best observed from 128 up
    measured = {"profile": {"source": "measured", "points": online_only["profile"]["points"]}}
    assert auto_batch_size(ModelRecord.of(measured)) == 8  # a measured sweep is trusted as it is
    # Chunks are sized the same way: small online batches' rates do not stand for a job's.
    online_record, jobs_record = ModelRecord.of(online_only), ModelRecord.of(with_jobs)
    assert profiled_rows_per_second(online_record, 128) is None
    assert profiled_rows_per_second(jobs_record, 128) == 128_000.0
    assert profiled_rows_per_second(jobs_record, 64) is None  # a 128-row rate would overstate a 64-row batch
