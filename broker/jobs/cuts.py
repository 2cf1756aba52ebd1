"""A job's chunks once some were split as they ran: which rows each chunk index covers.

A job is cut at submit into chunks of `chunk_size` rows (`records.chunk_ranges`). A chunk that runs far
longer than `jobs.chunk_seconds` at the rate it shows may end early at a mini-batch boundary
(`granularity.split_row`); the rest of its rows becomes a new chunk, numbered after the job's last, and
waits in the queue for any slot (`split_chunk.lua`, one atomic step). The job's `cuts` hash then holds
the range of every chunk that is not the one its chunk size gives: the shortened chunk and the new one.
Everything that reads a job's chunks reads them here (`chunk_layout`), so a resume, a refill and the
final merge see the chunks as they are now. Chunk indexes are no longer in row order once a chunk was
split: the merge takes the parts in row order (`in_row_order`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from broker.jobs.records import chunk_item_prefix, chunk_ranges
from broker.queueing.leases import LeasedItem
from broker.state.store import Store, translate_redis_errors


def chunk_layout(store: Store, job_id: str, *, rows_total: int, chunk_size: int,
                 chunks_total: int) -> list[tuple[int, int]]:
    """The rows [start, stop) of each of the job's chunks, by index: as its chunk size cut them, but for
    those split as they ran (the `cuts` hash); `chunks_total` counts the chunks splits added too."""
    with translate_redis_errors():
        cuts = store.client.hgetall(store.keys.job_cuts(job_id))
    return apply_cuts(chunk_ranges(rows_total, chunk_size), cuts, chunks_total)


def apply_cuts(ranges: Sequence[tuple[int, int]], cuts: dict[str, str], chunks_total: int) -> list[tuple[int, int]]:
    """`ranges` (as the chunk size cut them) with the `cuts` hash's ranges in place, and its new chunks after."""
    layout = list(ranges)
    layout += [(0, 0)] * max(0, chunks_total - len(layout))  # (each new chunk's range is in `cuts`: same step)
    for field, value in cuts.items():
        start, _, stop = value.partition(",")
        if field.isdigit() and int(field) < len(layout):
            layout[int(field)] = (int(start), int(stop))
    return layout


def in_row_order(layout: Sequence[tuple[int, int]]) -> list[tuple[int, tuple[int, int]]]:
    """(index, range) of every chunk, in the order of their rows."""
    return sorted(enumerate(layout), key=lambda pair: pair[1][0])


@dataclass(frozen=True)
class Split:
    """What `split_chunk` did."""

    split: bool
    stop: int
    """The chunk's stop now: the row it ends at when split; when not, its stop as stored (0: it is gone)."""
    new_index: int | None = None


def split_chunk(store: Store, item: LeasedItem, *, row: int) -> Split:
    """End the running chunk `item` at `row` and queue the rest of its rows as a new chunk of its job
    (`split_chunk.lua`); on success `item.payload['stop']` becomes `row`."""
    payload, keys = item.payload, store.keys
    job_id = str(payload["job"])
    with translate_redis_errors():
        done, value = store.scripts.split_chunk(
            keys=[keys.items, keys.inflight(item.model_ref), keys.ready(item.model_ref), keys.job(job_id),
                  keys.job_cuts(job_id), keys.queues, keys.queues_version, keys.doorbell],
            args=[item.item_id, int(payload["start"]), int(payload["stop"]), int(row), item.model_ref,
                  chunk_item_prefix(job_id)])
    if int(done) == 1:
        payload["stop"] = int(row)
        return Split(split=True, stop=int(row), new_index=int(value))
    return Split(split=False, stop=int(value))


def stored_stop(store: Store, job_id: str, index: int, *, rows_total: int, chunk_size: int) -> int:
    """Where chunk `index` of the job ends now (a split may have ended it early since a run read it)."""
    with translate_redis_errors():
        cut = store.client.hget(store.keys.job_cuts(job_id), str(index))
    if cut:
        return int(cut.partition(",")[2])
    return min((index + 1) * chunk_size, rows_total) if index * chunk_size < rows_total else 0
