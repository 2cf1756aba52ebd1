"""Ending a running job chunk early, its rest queued as a new chunk (`jobs.split_chunks`).

The decision is `broker.jobs.granularity.split_row`, the split one atomic step (`broker.jobs.cuts.split_chunk`);
here is what a running chunk asks after each mini-batch (`Splitting`), and whether a commit must read its
chunk's stop again (`may_be_split`).
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np

from broker.jobs import cuts, granularity
from broker.jobs.job_record import JobRecord
from broker.queueing.leases import LeasedItem
from sits_worker.serving.context import WorkerContext

log = logging.getLogger(__name__)


def may_be_split(ctx: WorkerContext, job: JobRecord) -> bool:
    """Whether a chunk of `job` may have been split since it was read: this fleet splits chunks, or the job's
    were split already. Else a commit saves the round trip that reads the chunk's stop (a worker of a fleet
    whose settings differ is still safe: the merge takes a longer part's first rows)."""
    return ctx.settings.jobs.split_chunks or int(job.chunks_total) > math.ceil(
        int(job.rows_total) / max(1, int(job.chunk_size)))


class Splitting:
    """Whether a running chunk should end early, its rest queued as a new chunk (`granularity.split_row`,
    `cuts.split_chunk`), asked after each mini-batch. Only while its rows come in row order (a JSON Lines
    file's come grouped by length: such a chunk runs to its end). Another run of the same chunk (its lease
    was reaped, and it runs twice) may have split it already: this run then ends where that split it."""

    def __init__(self, ctx: WorkerContext, job: JobRecord, item: LeasedItem) -> None:
        self._store, self._item = ctx.store, item
        self._seconds, self._batch = float(ctx.settings.jobs.chunk_seconds), max(1, int(job.batch_size))
        self._began, self._next = time.monotonic(), int(item.payload["start"])
        self.end: int | None = None
        """Where another run of the chunk split it, as this run found out."""
        self._on = True

    def after(self, read: np.ndarray) -> int | None:
        """After the mini-batch of rows `read`: the row to end the chunk at, or None to go on."""
        in_order = len(read) and int(read[0]) == self._next and int(read[-1]) - int(read[0]) + 1 == len(read)
        if not self._on or not in_order:
            self._on = False
            return None
        self._next = int(read[-1]) + 1
        if self.end is not None:
            return self.end if self._next >= self.end else None
        payload = self._item.payload
        row = granularity.split_row(start=int(payload["start"]), stop=int(payload["stop"]), next_row=self._next,
                                    elapsed=time.monotonic() - self._began, chunk_seconds=self._seconds,
                                    batch_rows=self._batch)
        if row is None:
            return None
        stop = int(payload["stop"])
        done = cuts.split_chunk(self._store, self._item, row=row)
        if done.split:
            log.info("chunk %s ended at row %d after %.2f s; rows [%d, %d) queued as chunk %s", self._item.item_id,
                     row, time.monotonic() - self._began, row, stop, done.new_index)
            return row
        if 0 < done.stop < int(payload["stop"]):  # another run split it: end there
            payload["stop"], self.end = done.stop, done.stop
            return done.stop if self._next >= done.stop else None
        self._on = False  # not leased any more, or its job stopped: its commit finds out
        return None
