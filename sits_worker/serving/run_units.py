"""Running a run unit: job chunks of one model that one lease took together (`broker.jobs.granularity`).

Their rows run in shared mini-batches (one `session.run` for rows of several jobs, each job's tenant
billed for its own rows), then each chunk's outputs are handed to the commit threads as a chunk run
alone hands its own: written as its part files, then acked, so exactly-once holds per chunk as before.

Whatever cannot share a run runs alone, as a single leased chunk does (`run_alone`): a chunk whose rows
do not read as one block of one shape (a JSON Lines file's rows grouped by length), one whose inputs
differ in shape or type from every other's, one whose read fails (its rows are then read in pieces and
quarantined as a chunk alone does), and every chunk of a shared run that failed (each runs again alone,
and settles its own failure by its class). A worker with fault injection configured runs every chunk
alone: its faults name rows of one job.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np

from broker.jobs import progress as job_progress
from broker.jobs import records as jobs
from broker.jobs.job_record import JobRecord
from broker.models.registry import split_model_ref
from broker.queueing import leases
from broker.queueing.leases import LeasedItem
from sits_worker.model.source import check_unchanged
from sits_worker.serving import batch_trace, drain_report
from sits_worker.serving.context import WorkerContext
from sits_worker.serving.execution import (
    ack_written,
    among_last_chunks,
    check_visible,
    chunk_ids,
    commit_chunk,
    passed_on,
    settle_failure,
    written_before,
)
from sits_worker.tenancy.usage_meter import Work

log = logging.getLogger(__name__)


@dataclass
class _Chunk:
    """A chunk of the unit read and ready to share a run: its rows' feed, and its outputs once run."""

    item: LeasedItem
    job: JobRecord
    feed: dict[str, np.ndarray]
    results: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return int(self.item.payload["stop"]) - int(self.item.payload["start"])

    def shape_key(self) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        """What must match for two chunks' rows to share a mini-batch: every input's name, type and row shape."""
        return tuple(sorted((name, array.dtype.str, tuple(array.shape[1:])) for name, array in self.feed.items()))


def run_unit(ctx: WorkerContext, items: Sequence[LeasedItem], ticket: str,
             run_alone: Callable[[LeasedItem], None]) -> None:
    """Run the job chunks of one lease: those that can share mini-batches together, by their inputs'
    shapes, every other one with `run_alone` (after them, their leases kept alive meanwhile)."""
    for _ in items:
        drain_report.note_chunk()
    alone: list[LeasedItem] = []
    with ctx.lease_keeper.holding(items, ticket):
        if ctx.faults is not None:
            alone = list(items)
        else:
            ready = _read_all(ctx, items, alone)
            groups: dict[tuple[tuple[str, str, tuple[int, ...]], ...], list[_Chunk]] = defaultdict(list)
            for chunk in ready:
                groups[chunk.shape_key()].append(chunk)
            for group in groups.values():
                if len(group) == 1:
                    alone.append(group[0].item)
                    continue
                try:
                    _run_shared(ctx, group)
                except Exception as err:  # each runs again alone, and settles its own failure by its class
                    log.info("a shared run of %d chunks of %s failed (%s); each runs alone", len(group),
                             group[0].item.model_ref, err)
                    alone += [chunk.item for chunk in group]
        for item in alone:
            run_alone(item)


def _read_all(ctx: WorkerContext, items: Sequence[LeasedItem], alone: list[LeasedItem]) -> list[_Chunk]:
    """Each item's rows, where it is to run now and they read as one block; an item that is not to run
    now is settled here as a chunk run alone settles it (passed on, dropped, acked as written before, or
    its failure by its class); one whose rows do not read as one block goes to `alone`."""
    ready: list[_Chunk] = []
    for item in items:
        job_id = item.payload["job"]
        if passed_on(ctx, item):
            continue
        if job_progress.start_item(ctx.store, job_id, now=time.time(), chunk=True) != "running":
            leases.finish_item(ctx.store, item, job_id, now=time.time())
            continue
        try:
            job = jobs.get_job(ctx.store, job_id, now=time.time())
            check_visible(ctx, job, item)
            if written_before(job, item):
                ack_written(ctx, item)
                continue
            feed = _whole_chunk(ctx, job, item)
        except Exception as err:
            settle_failure(ctx, item, err)
            continue
        if feed is None:
            alone.append(item)
        else:
            ready.append(_Chunk(item, job, feed))
    return ready


def _whole_chunk(ctx: WorkerContext, job: JobRecord, item: LeasedItem) -> dict[str, np.ndarray] | None:
    """The chunk's rows as one feed, or None when they do not come as one block in row order (or a row
    fails to read: alone, its rows are read in pieces and the bad ones quarantined)."""
    start, stop = int(item.payload["start"]), int(item.payload["stop"])
    input_path = Path(job.input_batch)
    check_unchanged(input_path, job.input_stat)
    try:
        batches = list(ctx.job_input(job).iter_batches(start, stop, stop - start))
    except Exception:  # noqa: BLE001 - the chunk alone reads it again and settles what it finds
        return None
    if len(batches) != 1:
        return None
    row_indices, feed = batches[0]
    if len(row_indices) != stop - start or int(row_indices[0]) != start or int(row_indices[-1]) != stop - 1:
        return None
    check_unchanged(input_path, job.input_stat)  # (rows read while the file was rewritten in place do not count)
    return {name: np.asarray(array) for name, array in feed.items()}


@batch_trace.traced_batch(lambda ctx, group: [chunk.item for chunk in group])
def _run_shared(ctx: WorkerContext, group: Sequence[_Chunk]) -> None:
    """Run the group's rows in mini-batches of the first chunk's job batch size (its memory was admitted
    by it), each job's tenant billed for its rows of each run; then hand each chunk to a commit thread,
    waiting for those among their job's last (as a chunk alone does, `execution.among_last_chunks`). One
    `sits.batch` span, linked to every chunk, each chunk's `sits.item_run` in its own trace; their acks are its
    children."""
    model_ref = group[0].item.model_ref
    record = ctx.model(model_ref)
    wanted = {name for chunk in group for name in chunk.job.output_names}
    names = [name for name in record.output_names if name in wanted]
    feed = {name: np.concatenate([chunk.feed[name] for chunk in group]) for name in group[0].feed}
    bounds = np.cumsum([0] + [chunk.rows for chunk in group])
    total, batch = int(bounds[-1]), max(1, int(group[0].job.batch_size))
    session = ctx.session(model_ref)
    started, token = time.monotonic(), ctx.slot_overlap.begin(split_model_ref(model_ref)[1] or "")
    try:
        runs: list[list[np.ndarray]] = []
        for lo in range(0, total, batch):
            hi = min(lo + batch, total)
            with ctx.usage.billing(model_ref, _payers(group, bounds, lo, hi)):
                runs.append(ctx.run(model_ref, {name: array[lo:hi] for name, array in feed.items()}, names, session))
        outputs = {name: np.concatenate([run[index] for run in runs]) for index, name in enumerate(names)}
    finally:
        beside = ctx.slot_overlap.end(token)
    elapsed = time.monotonic() - started
    for chunk, lo, hi in zip(group, bounds[:-1], bounds[1:], strict=True):
        chunk.results = {name: outputs[name][lo:hi] for name in chunk.job.output_names}
    last: list[Future[object]] = []
    for chunk in group:  # (each chunk's share of the unit's slot time, by its rows, beside each neighbour too)
        share = chunk.rows / total
        commit = ctx.commits.submit(partial(
            commit_chunk, ctx, chunk.job, chunk.item, chunk.results, elapsed * share, (),
            {model: seconds * share for model, seconds in beside.items()}, chunk_ids(ctx, chunk.job, chunk.item, ())))
        if among_last_chunks(chunk.job, chunk.item.payload["chunk"], ctx.streams):
            last.append(commit)
    for commit in last:
        commit.result()


def _payers(group: Sequence[_Chunk], bounds: np.ndarray, lo: int, hi: int) -> list[Work]:
    """Each tenant's and owner's rows among rows [lo, hi) of the unit."""
    rows: dict[tuple[str, str], int] = defaultdict(int)
    for chunk, first, last in zip(group, bounds[:-1], bounds[1:], strict=True):
        if (overlap := min(hi, int(last)) - max(lo, int(first))) > 0:
            rows[(str(chunk.job.tenant or ""), str(chunk.job.owner or ""))] += overlap
    return [Work(tenant, owner, count) for (tenant, owner), count in rows.items()]
