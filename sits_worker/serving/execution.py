"""Running leased items: a chunk of an offline job, or a job's finalize step.

Plain functions over a `WorkerContext`, no Celery here: the
task is thin glue over them. A chunk's outputs are written atomically as a part file
before its ack, so a chunk re-run after a lost ack rewrites identical bytes
and is counted once. The writing and the ack happen on the worker's commit
thread (`sits_worker.serving.chunk_commits`), so the stream slot computes its next batch
while the disk works.
"""

from __future__ import annotations

import json
import logging
import operator
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from broker.errors import BadInput, Cancelled, SitsError, StorageUnavailable
from broker.failures import quarantine, retries
from broker.failures.retry_policy import classify, describe, retry_delays
from broker.jobs import cuts
from broker.jobs import progress as job_progress
from broker.jobs import records as jobs
from broker.jobs import stops as job_stops
from broker.jobs.job_record import JobRecord
from broker.jobs.settings import JobSettings
from broker.models.registry import split_model_ref
from broker.queueing import leases
from broker.queueing.leases import LeasedItem
from sits_worker.model.source import check_unchanged
from sits_worker.serving import batch_trace, chunk_splits
from sits_worker.serving.context import WorkerContext
from sits_worker.serving.outputs import chunk_written, finalize_outputs, merge_npy_outputs, remove_parts, write_part
from sits_worker.serving.request_runs import give_back, rows_to_fill, run_requests, run_with_riders
from sits_worker.serving.table_outputs import (
    id_column_name,
    merge_table_parts,
    quarantine_ids,
    table_chunk_written,
    write_table_part,
)
from sits_worker.tenancy.usage_meter import Work

log = logging.getLogger(__name__)


class MiniBatchHook(Protocol):
    """What a running item calls as it goes (`sits_worker.serving.between_minibatches.BetweenBatches`)."""

    def __call__(self, feed: Mapping[str, np.ndarray]) -> Sequence[LeasedItem]:
        """Called with each mini-batch's feed before it runs: keeps the chunk's lease alive, may run
        urgent work first, and returns the online requests that ride in the mini-batch."""
        ...

    def keep_alive(self) -> None:
        """Extend the item's lease when due, cheap otherwise (a finalize merge calls it as it goes)."""
        ...

    def running(self) -> AbstractContextManager[object]:
        """Held while a mini-batch runs: one `session.run` may outlast the lease, and between mini-batches
        is the only place `__call__` extends it."""
        ...

    def run_early(self) -> None:
        """Called after a mini-batch that no `__call__` follows at once: runs the urgent work leased while
        it ran (a boundary would have), so it does not wait for the chunk's end."""
        ...


@batch_trace.traced_batch(lambda ctx, item, *_, **__: [item])
def process_item(ctx: WorkerContext, item: LeasedItem, between: MiniBatchHook) -> str:
    """Run one leased item; returns what happened ('committing': a chunk computed, its outputs handed
    to a commit thread, which writes them and acks it; for one of the job's last chunks what that
    commit did, 'acked' or how it failed, since the slot waits for it (`among_last_chunks`);
    'finalized', 'dropped', 'failed', 'retry'; 'passed': put back in its queue for a worker whose host sees
    the job's files, `passed_on`).

    A failure is settled by its class (`settle_failure`; a chunk's commit settles its own): retried
    after its backoff while the class has attempts left, else its job fails with the error's message.
    """
    job_id = item.payload["job"]
    if passed_on(ctx, item):
        return "passed"
    now = time.time()
    if job_progress.start_item(ctx.store, job_id, now=now, chunk=item.payload["kind"] == "chunk") != "running":
        leases.finish_item(ctx.store, item, job_id, now=now)
        return "dropped"
    try:
        job = jobs.get_job(ctx.store, job_id, now=now)
        check_visible(ctx, job, item)
        if item.payload["kind"] == "finalize":
            manifest = finalize_job(job, keep_alive=_tolerant(between.keep_alive),
                                    may_publish=partial(_may_publish, ctx, job), settings=ctx.settings.jobs,
                                    ranges=cuts.chunk_layout(ctx.store, job.id, rows_total=job.rows_total,
                                                             chunk_size=job.chunk_size,
                                                             chunks_total=int(job.chunks_total)))
            if manifest is None:  # stopped while it merged: its parts stay, a resume merges again
                leases.finish_item(ctx.store, item, job_id, now=time.time())
                return "dropped"
            # A stop that landed since `_may_publish` looked does not keep this status away: the folder
            # holds the job's results now (finish_item.lua).
            leases.finish_item(ctx.store, item, job_id, now=time.time(), job_status="succeeded",
                               job_fields={"manifest": json.dumps(manifest),
                                           "rows_quarantined": str(len(manifest.get("quarantined_rows") or []))})
            # after the job is done: its outputs need not wait for this; only its own parts (a cancelled
            # job's in the same folder are that job's resumable work)
            remove_parts(Path(job.output_dir), job_id=job_id)
            return "finalized"
        if written_before(job, item):
            return ack_written(ctx, item)
        started, token = time.monotonic(), ctx.slot_overlap.begin(split_model_ref(item.model_ref)[1] or "")
        try:
            results, quarantined = run_chunk(ctx, job, item, between)
            ids = chunk_ids(ctx, job, item, quarantined)
        finally:
            beside = ctx.slot_overlap.end(token)
        commit = ctx.commits.submit(partial(commit_chunk, ctx, job, item, results, time.monotonic() - started,
                                            quarantined, beside, ids))
        if among_last_chunks(job, item.payload["chunk"], ctx.streams):
            return str(commit.result())
        return "committing"
    except Exception as err:
        return settle_failure(ctx, item, err)


def chunk_ids(ctx: WorkerContext, job: JobRecord, item: LeasedItem, quarantined: Sequence[tuple[int, str]]) -> Any:
    """The ids of a chunk's rows (a table input's `id_column`, `InputSource.row_ids`) where its commit needs
    them: for a Parquet job's part, or to list its quarantined rows by id; else None."""
    if job.output_format != "parquet" and not quarantined:
        return None
    return ctx.job_input(job).row_ids(item.payload["start"], item.payload["stop"])


def written_before(job: JobRecord, item: LeasedItem) -> bool:
    """Whether the chunk's parts are on disk already (`outputs.chunk_written`): a run before this lease wrote
    them, and its ack never reached Redis (the ack failed while Redis was away, or a failover lost it)."""
    payload = item.payload
    if job.output_format == "parquet":
        return table_chunk_written(Path(job.output_dir), payload["chunk"], (payload["start"], payload["stop"]),
                                   job_id=job.id)
    return chunk_written(Path(job.output_dir), payload["chunk"], (payload["start"], payload["stop"]),
                         job.output_names, job_id=job.id)


def ack_written(ctx: WorkerContext, item: LeasedItem) -> str:
    """Ack a chunk whose parts an earlier run wrote, as that run's commit would have: it is not run and
    written again. Its parts are its checkpoint, as they are a resume's (docs/operations.md, "Redis
    Sentinel")."""
    log.warning("chunk %s: its parts were on disk already (the ack of the run that wrote them was lost); "
                "acked without running it again", item.item_id)
    job_progress.ack_chunk(ctx.store, item, now=time.time(), worker=ctx.name)
    return "acked"


UNSEEN_MEMORY_SECONDS = 3.0
"""How long a worker that found a job's file missing passes the job's other items on uncounted."""
UNSEEN_PAUSE_SECONDS = 0.5
"""How long a slot rests after passing an item on, so that a worker on the wrong host does not spin."""
_SEEN_MISSING_BY = re.compile(r"is missing on workers? \[([^\]]*)\]")


def check_visible(ctx: WorkerContext, job: JobRecord, item: LeasedItem) -> None:
    """StorageUnavailable (transient: retried, by the retry matrix) when this host cannot see the job's
    input, output folder or model file, naming the path, this worker and the workers that found it missing
    before; this worker then passes the job's items on for a moment (`passed_on`).

    Every host of a fleet must see them at the same real path: the one missing here may be on the other
    hosts, whose workers then run the item. One missing everywhere fails its job once the item used up its
    transient attempts. Only a missing entry counts: a symbolic link, a changed file and a folder that
    cannot be read are the checks' after this one. An output folder counts as missing with the folder
    above it: the API made it at submit, and a chunk makes it again where it alone was removed.
    """
    output_dir, chunk = Path(job.output_dir), item.payload["kind"] == "chunk"
    needed: list[tuple[str, Path, Path | None]] = [("output folder", output_dir, output_dir.parent)]
    if job.input_stat is not None:  # (a job from before identities were kept: `check_unchanged` reads none)
        needed.insert(0, ("input", Path(job.input_batch), None))
    if chunk:  # (a finalize step runs no model)
        needed.append(("model file", Path(ctx.model(job.model_ref).path), None))
    for what, path, above in needed:
        if _exists(path) or (above is not None and _exists(above)):
            continue
        ctx.note_unseen(job.id, UNSEEN_MEMORY_SECONDS)
        workers = [ctx.name]
        earlier = (job.retries.get("transient") or {}).get("last_error") or ""
        if f"'{path}' of job {job.id} is missing on" in earlier and (found := _SEEN_MISSING_BY.search(earlier)):
            workers = sorted({*found.group(1).split(", "), ctx.name})
        kind = "chunk" if chunk else "finalize step"
        raise StorageUnavailable(
            f"{what} '{path}' of job {job.id} is missing on worker{'s' if len(workers) > 1 else ''} "
            f"[{', '.join(workers)}]: every worker's host must see inputs, outputs and models at the same real "
            f"path (mount the shared folder there); the {kind} is retried on the workers that see it, until its "
            "transient attempts are used")


def _exists(path: Path) -> bool:
    """Whether `path` names an entry here, a link included (only ENOENT is an answer: the other errors are
    the later checks')."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return True


def passed_on(ctx: WorkerContext, item: LeasedItem) -> bool:
    """Whether this worker put `item` straight back in its queue, its attempt not counted: a file of its
    job was missing here a moment ago (`check_visible`), so another worker should take it. The slot rests
    a moment after, so that it does not lease the item again at once."""
    if not ctx.unseen(item.payload["job"]):
        return False
    leases.return_unrun(ctx.store, [item])
    time.sleep(UNSEEN_PAUSE_SECONDS)
    return True


def among_last_chunks(job: JobRecord, chunk: int, streams: int) -> bool:
    """Whether chunk number `chunk` of `job` (as read when it was leased) may be the last to be acked: one
    of its last `streams` chunks (chunks are leased in row order), or no more chunks were left than the
    slots that could be running them (a resumed job's). Such a chunk's slot waits for its commit before
    it leases again: the last ack queues the job's finalize step, which this slot then leases first,
    where a slot gone on to a chunk of other work would leave the finalize waiting for a whole chunk
    (about a second on a CPU) while the job's deadline runs."""
    total, slots = int(job.chunks_total), max(1, streams)
    return chunk >= total - slots or total - int(job.chunks_done) <= slots


def _may_publish(ctx: WorkerContext, job: JobRecord) -> bool:
    """Whether a finished merge may publish the job's outputs and manifest: not if the job was stopped
    (cancelled) while it merged, so a cancelled job's folder holds its parts, not results, and a
    resume merges again. Its input must still be the one submitted (else BadInput fails the job):
    the manifest names that file's checksum. A stat and one Redis call, as late as can be."""
    check_unchanged(Path(job.input_batch), job.input_stat)
    return job_progress.start_item(ctx.store, job.id, now=time.time()) == "running"


def _tolerant(keep_alive: Callable[[], None]) -> Callable[[], None]:
    """`keep_alive` for a merge: a Redis hiccup while extending the lease must not throw away a merge
    of GBs (at worst the lease runs out and another worker merges again, which is safe)."""
    def call() -> None:
        try:
            keep_alive()
        except Exception as err:
            log.warning("could not extend the finalize step's lease: %s", err)

    return call


def settle_failure(ctx: WorkerContext, item: LeasedItem, err: Exception) -> str:
    """What a failed job item leaves behind, by the retry matrix (`broker/failures/retry_policy.py`): its
    failure is recorded by class on its job, and while the class has retries left the item waits out
    its backoff in Redis ('retry', `broker/failures/retries.py`); else its job fails with the error, and its
    other items leave their queue ('failed').
    'dropped': the item was no longer this worker's (reaped, or its job stopped).
    A chunk that stopped because its job was stopped (`Cancelled`) is no failure of its own: it leaves
    its queue without a record, and the job keeps the status it was stopped with."""
    job_id = item.payload["job"]
    if isinstance(err, Cancelled):
        leases.finish_item(ctx.store, item, job_id, now=time.time())
        return "dropped"
    failure_class = classify(err)
    delays = retry_delays(ctx.settings.retry_policy(failure_class), ctx.jitter.random)
    message = describe(err)
    outcome = retries.retry_later(ctx.store, item, failure_class=failure_class, error=message, delays=delays,
                                  now=time.time())
    if outcome.retried:
        log.warning("item %s of job %s failed (%s, %d so far), retried at %.3f: %s", item.item_id, job_id,
                    failure_class, outcome.failures, outcome.retry_at or 0.0, message,
                    exc_info=err if failure_class == "transient" and not isinstance(err, SitsError) else None)
        return "retry"
    if outcome.gone:
        return "dropped"
    error = message if outcome.failures <= 1 else (
        f"{item.item_id} failed {outcome.failures} times ({failure_class}); last error: {message}")
    log.warning("job %s failed on %s: %s", job_id, item.item_id, error)
    # As the reaper fails a job whose item went dead: its other items leave their queue too.
    job_stops.stop_job(ctx.store, job_id, status="failed", error=error, now=time.time())
    return "failed"


def commit_chunk(ctx: WorkerContext, job: JobRecord, item: LeasedItem, results: Mapping[str, np.ndarray],
                 run_seconds: float = 0.0, quarantined: Sequence[tuple[int, str]] = (),
                 beside: Mapping[str, float] | None = None, ids: Any = None) -> str:
    """Write a computed chunk's part files (durably, its `quarantined` rows with them), then ack it with
    the `run_seconds` its slot spent on it and how many of them it ran `beside` each model on the other
    slots (`sits_worker/serving/slot_overlap.py`); on a commit thread (`sits_worker.serving.chunk_commits`). A
    Parquet job's part holds the rows' `ids` (`chunk_ids`), as its quarantined rows' listing does. Returns
    'acked', or how the failure was settled."""
    try:
        leases.extend_lease(ctx.store, item, "", now=time.time(), lease_seconds=ctx.settings.scheduler.lease_timeout)
        if job_progress.start_item(ctx.store, job.id, now=time.time()) != "running":
            # Cancelled, failed, or finished by another run of this chunk meanwhile: no part to
            # leave behind in a folder nobody merges any more.
            leases.finish_item(ctx.store, item, job.id, now=time.time())
            return "dropped"
        held = int(item.payload["start"]) + next((len(array) for array in results.values()),
                                                 int(item.payload["stop"]) - int(item.payload["start"]))
        stop = cuts.stored_stop(ctx.store, job.id, int(item.payload["chunk"]), rows_total=int(job.rows_total),
                                chunk_size=int(job.chunk_size)) if chunk_splits.may_be_split(ctx, job) else held
        if 0 < stop < held:  # another run of it split it since this run read it: its part holds the chunk's rows
            keep = stop - int(item.payload["start"])
            results = {name: array[:keep] for name, array in results.items()}
            quarantined = [(row, error) for row, error in quarantined if row < stop]
            ids = None if ids is None else ids[:keep]
            item.payload["stop"] = stop
        start, listed = item.payload["start"], quarantine_ids(ids, quarantined, item.payload["start"])
        if job.output_format == "parquet":
            write_table_part(Path(job.output_dir), item.payload["chunk"], results, start=start, ids=ids,
                             id_column=id_column_name(job.input_options), job_id=job.id, quarantined=quarantined,
                             quarantine_ids=listed)
        else:
            write_part(Path(job.output_dir), item.payload["chunk"], results, job_id=job.id, quarantined=quarantined,
                       quarantine_ids=listed)
        job_progress.ack_chunk(ctx.store, item, now=time.time(), worker=ctx.name, run_seconds=run_seconds,
                               beside=beside)
        return "acked"
    except Exception as err:
        return settle_failure(ctx, item, err)


def run_chunk(ctx: WorkerContext, job: JobRecord, item: LeasedItem,
              between: MiniBatchHook) -> tuple[dict[str, np.ndarray], list[tuple[int, str]]]:
    """Run rows [start, stop) of a job in mini-batches; returns every output's rows and the rows
    quarantined (job row, error), for `commit_chunk`.

    Online requests that `between_minibatches` hands over ride in a mini-batch: the first rows of the
    mini-batch fill their batch's empty rows (as many as `request_runs.rows_to_fill` allows), one run for
    both, the rest of the mini-batch runs after; they are completed right after their run, long
    before the chunk's ack. A mini-batch that fails for its input is split until its bad rows stand
    alone (`ChunkRows`); so is the rest of the chunk when reading its rows fails so.
    """
    start, stop = item.payload["start"], item.payload["stop"]
    input_path, input_stat = Path(job.input_batch), job.input_stat
    check_unchanged(input_path, input_stat)  # a stat: before its rows are read
    source = ctx.job_input(job)
    chunk = ChunkRows(ctx, job, start, stop, ctx.session(job.model_ref))  # the session: once per chunk
    batches = source.iter_batches(start, stop, job.batch_size)
    split = chunk_splits.Splitting(ctx, job, item) if ctx.settings.jobs.split_chunks else None
    while True:
        try:
            row_indices, feed = next(batches)
        except StopIteration:
            break
        except BadInput:  # a row that cannot be read or fails its checks: the rest is read in pieces
            if not chunk.quarantines:
                raise
            chunk.read_apart(source, between)
            break
        read = row_indices
        riders = between(feed)
        with between.running():
            if riders:
                row_indices, feed = _run_riders(ctx, chunk, riders, row_indices, feed)
            if len(row_indices):
                chunk.run_batch(row_indices, feed)
        if split is not None and (end := split.after(read)) is not None:
            chunk.truncate(end)
            break
    if split is not None and split.end is not None and chunk.stop > split.end:  # (rows read apart past it)
        chunk.truncate(split.end)
    between.run_early()
    # And after: rows read while the file was rewritten in place (same size, same inode) must not count
    # as done under the checksum of the file as submitted.
    check_unchanged(input_path, input_stat)
    return chunk.outputs(), chunk.quarantined


class ChunkRows:
    """One chunk's outputs as its mini-batches run, and its quarantined rows (docs/failures.md,
    "Bad-row quarantine"): a run or a read that fails as BadInput is bisected (`broker.failures.quarantine`)
    until each bad row failed alone; every other row gets its outputs, each bad row the fill value.
    More bad rows than the job's `jobs.max_bad_rows` is a BadInput naming them: the job fails."""

    def __init__(self, ctx: WorkerContext, job: JobRecord, start: int, stop: int, session: Any) -> None:
        self._ctx, self.job, self.session = ctx, job, session
        self.start, self.stop = start, stop
        self.output_names: list[str] = job.output_names
        self.results: dict[str, np.ndarray] = {}
        self.quarantined: list[tuple[int, str]] = []
        self._done = np.zeros(stop - start, dtype=bool)
        self._limit = quarantine.bad_row_limit(ctx.settings.jobs.max_bad_rows, int(job.rows_total))
        self.quarantines = self._limit > 0
        """False where the job may quarantine no row: its first failing batch fails it with its own error."""

    def store(self, row_indices: np.ndarray, outputs: Sequence[np.ndarray]) -> None:
        """Keep a run's outputs for its rows."""
        start, stop, results = self.start, self.stop, self.results
        for name, array in zip(self.output_names, outputs, strict=True):
            if name not in results:
                results[name] = np.empty((stop - start, *array.shape[1:]), dtype=array.dtype)
            elif results[name].shape[1:] != array.shape[1:]:
                raise BadInput(f"output '{name}' has rows of shape {list(results[name].shape[1:])} and "
                               f"{list(array.shape[1:])} within rows [{start}, {stop}); outputs whose rows vary in "
                               "shape cannot be stored in one .npy")
            first = int(row_indices[0]) - start
            if int(row_indices[-1]) - start - first + 1 == len(row_indices):  # contiguous: a cheap slice copy
                results[name][first : first + len(row_indices)] = array
            else:  # jsonl rows grouped by length
                results[name][row_indices - start] = array
        self._done[row_indices - start] = True

    def run_batch(self, row_indices: np.ndarray, feed: dict[str, np.ndarray]) -> None:
        """Run one mini-batch and keep its outputs; bisect it when it fails for its input."""
        failure = self._attempt(row_indices, feed)
        if failure is not None:
            self._isolate(len(row_indices), failure,
                          lambda lo, hi: self._attempt(row_indices[lo:hi], _rows(feed, lo, hi)),
                          lambda offset: int(row_indices[offset]))

    def payer(self, rows: int) -> Work:
        """What `rows` of this job bring to a run's bill: its tenant's and its owner's rows."""
        return Work(str(self.job.tenant or ""), str(self.job.owner or ""), rows)

    def _attempt(self, row_indices: np.ndarray, feed: dict[str, np.ndarray]) -> BadInput | None:
        ctx = self._ctx
        try:
            if ctx.faults is not None:
                ctx.faults.check_rows(row_indices)
            with ctx.usage.billing(self.job.model_ref, [self.payer(len(row_indices))]):
                outputs = ctx.run(self.job.model_ref, feed, self.output_names, self.session)
        except BadInput as err:
            return err
        self.store(row_indices, outputs)
        return None

    def read_apart(self, source: Any, between: MiniBatchHook) -> None:
        """Read and run the chunk's rows not done yet in pieces of at most a mini-batch (each read bisected
        when it fails as BadInput): a failed read ends its batch iterator, so which rows failed is unknown."""
        pending = np.flatnonzero(~self._done) + self.start
        batch_size = int(self.job.batch_size)
        pieces: list[tuple[int, int]] = []
        for run in np.split(pending, np.flatnonzero(np.diff(pending) != 1) + 1) if len(pending) else []:
            first, last = int(run[0]), int(run[-1]) + 1
            pieces += [(lo, min(lo + batch_size, last)) for lo in range(first, last, batch_size)]

        for first, last in pieces:
            def read(lo: int, hi: int, first: int = first) -> BadInput | None:
                try:
                    batches = list(source.iter_batches(first + lo, first + hi, batch_size))
                except BadInput as err:
                    return err
                for row_indices, feed in batches:
                    self.run_batch(row_indices, feed)
                return None

            between.keep_alive()
            with between.running():
                failure = read(0, last - first)
                if failure is not None:
                    self._isolate(last - first, failure, read, partial(operator.add, first))
            between.run_early()

    def _isolate(self, count: int, failure: BadInput, attempt: Callable[[int, int], BadInput | None],
                 row_of: Callable[[int], int]) -> None:
        if not self.quarantines:
            raise failure
        found = quarantine.isolate_bad_rows(count, failure, attempt,
                                            allowed=max(0, self._limit - len(self.quarantined)))
        for offset, error in found.bad:
            row = row_of(offset)
            self.quarantined.append((row, describe(error)))
            self._done[row - self.start] = True
        log.info("job %s: %d of rows [%d, %d) quarantined in %d runs", self.job.id, len(found.bad),
                 row_of(0), row_of(count - 1) + 1, found.runs)
        if len(self.quarantined) > self._limit:
            self.quarantined.sort()
            raise BadInput(quarantine.too_many_message([row for row, _ in self.quarantined], self.quarantined[0][1],
                                                       limit=self._limit, rows_total=int(self.job.rows_total)))

    def truncate(self, stop: int) -> None:
        """End the chunk at row `stop` (it was split there, `chunk_splits.Splitting`): rows past it are another
        chunk's."""
        keep = stop - self.start
        self.results = {name: array[:keep] for name, array in self.results.items()}
        self._done = self._done[:keep]
        self.quarantined = [(row, error) for row, error in self.quarantined if row < stop]
        self.stop = stop

    def outputs(self) -> dict[str, np.ndarray]:
        """Every output's rows, quarantined rows holding `jobs.quarantine_fill` (`quarantine.fill_value`)."""
        if not self.quarantined:
            return self.results
        self.quarantined.sort()
        fill = float(self._ctx.settings.jobs.quarantine_fill)
        rows = np.asarray([row for row, _ in self.quarantined], dtype=np.int64) - self.start
        for output in self._ctx.model(self.job.model_ref).signature["outputs"]:
            name = output["name"]
            if name in self.output_names and name not in self.results:  # no row of the chunk ran
                dims = output.get("shape") or []
                if not all(isinstance(dim, int) for dim in dims[1:]):
                    raise BadInput(f"every row of rows [{self.start}, {self.stop}) failed, and output '{name}' "
                                   f"has no fixed row shape ({dims}) to fill them; first: {self.quarantined[0][1]}")
                row_shape = tuple(int(dim) for dim in dims[1:])
                self.results[name] = np.empty((self.stop - self.start, *row_shape), dtype=np.dtype(output["dtype"]))
        for array in self.results.values():
            array[rows] = quarantine.fill_value(array.dtype, fill)
        return self.results


def _run_riders(ctx: WorkerContext, chunk: ChunkRows, riders: Sequence[LeasedItem], row_indices: np.ndarray,
                feed: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Run online requests that ride in a mini-batch with the rows `request_runs.rows_to_fill` allows (none
    fit, or those rows fail for their input: as a batch of their own); returns the mini-batch's rows
    still to run. Riders are given back to their queue if this fails before their run completed them."""
    model_ref = chunk.job.model_ref
    try:
        fill = rows_to_fill(ctx, model_ref, riders, len(row_indices))
        if fill and ctx.faults is not None:
            try:
                ctx.faults.check_rows(row_indices[:fill])
            except BadInput:  # the job's rows would fail the riders' run: theirs is bisected apart
                fill = 0
        if not fill:
            run_requests(ctx, riders)
            return row_indices, feed
        output_names = ctx.model(model_ref).output_names
        outputs = run_with_riders(ctx, model_ref, _rows(feed, 0, fill), output_names, riders, chunk.session,
                                  payer=chunk.payer(fill))
    except Exception as err:
        give_back(ctx, riders, err)  # a no-op for those already completed
        raise
    if outputs is None:  # the job's rows failed for their input, the riders are answered
        return row_indices, feed
    chunk.store(row_indices[:fill], outputs)
    return row_indices[fill:], _rows(feed, fill, len(row_indices))


def _rows(feed: Mapping[str, np.ndarray], first: int, last: int) -> dict[str, np.ndarray]:
    """Rows [first, last) of a mini-batch (views)."""
    return {name: array[first:last] for name, array in feed.items()}


def finalize_job(job: JobRecord, *, keep_alive: Callable[[], None], may_publish: Callable[[], bool],
                 settings: JobSettings | None = None,
                 ranges: Sequence[tuple[int, int]] | None = None) -> dict[str, Any] | None:
    """Merge the job's part files into its outputs and manifest (idempotent), calling `keep_alive`
    as the merge goes: a merge of GBs may outlast the lease, and a reaped finalize item would be
    merged again by a second worker, at the cost of an attempt. None when `may_publish`, asked once
    the merge is done, stopped it (`outputs.finalize_outputs`). More quarantined rows than the job's
    `jobs.max_bad_rows` (`settings`) is a BadInput naming them: the job fails. `ranges`: its chunks by index
    as they are now (`cuts.chunk_layout`: some may have been split as they ran); by default as cut at submit."""
    ranges = ranges if ranges is not None else jobs.chunk_ranges(job.rows_total, job.chunk_size)
    extra = {
        "job": job.id,
        "model": job.model,
        "model_version": job.model_version,
        "input_batch": job.input_batch,
        "input_checksum": job.input_checksum,
    }
    table = job.output_format == "parquet"
    if table:
        extra |= {"output_format": "parquet", "id_column": id_column_name(job.input_options)}
    settings = settings or JobSettings()
    return finalize_outputs(Path(job.output_dir), ranges, job.output_names, extra, job_id=job.id,
                            keep_alive=keep_alive, may_publish=may_publish,
                            bad_row_limit=quarantine.bad_row_limit(settings.max_bad_rows, int(job.rows_total)),
                            quarantine_fill=float(settings.quarantine_fill),
                            merge=merge_table_parts if table else merge_npy_outputs)
