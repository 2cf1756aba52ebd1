"""Per-chunk output parts and their merge into a job's final outputs and manifest.

Workers write one `.npy` part per output and chunk under `<output_dir>/.parts/<job id>/` (a
cancelled job's chunk still running when a new job takes the folder writes into its own job's parts,
never over the new job's); when every chunk is
done one worker merges the parts, in row order, into `<output_dir>/<name>.npy` and writes
`manifest.json` last, then removes its job's parts. Nothing here touches another job's parts folder:
a cancelled job's parts are its resumable work. Every file appears atomically (temp file in the same
folder, fsync, `os.replace`), so readers and a restarted merge never see half a file. Outputs are a
pure function of model version and rows, so a chunk re-run after a lost ack rewrites identical bytes.
A chunk's quarantined rows (docs/failures.md, "Bad-row quarantine") are one more part, a `.jsonl`
written before its `.npy` parts, and merged into `quarantine.jsonl` before the manifest.
The folders are opened afresh at each use without following symbolic links, and every file is opened,
made, renamed and removed relative to them (`sits_worker/model/safe_files.py`): an output folder swapped
for a link after submit fails the job (PathNotAllowed), and nothing outside it is touched.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import secrets
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, Any, BinaryIO, TypeVar

import numpy as np

from broker.errors import BadInput, Conflict, FileMissing, PathNotAllowed, SitsError
from broker.failures import quarantine
from broker.jobs import cuts
from broker.jobs.output_layout import (
    MANIFEST_NAME,
    PARTS_DIR,
    QUARANTINE_NAME,
    output_file_name,
    parse_manifest,
    part_name,
    quarantine_part_name,
    storage_error,
)
from sits_worker.model.inputs import ShortRead, StoredArray, read_into
from sits_worker.model.safe_files import Entry, Folder, open_folder
from sits_worker.model.tensors import NpyHeader, read_npy_header

log = logging.getLogger(__name__)

_RESERVED_KEYS = ("rows", "outputs", "chunks", "quarantined_rows", "quarantined_ids", "quarantine")
_COPY_BLOCK_BYTES = 64 * 2**20
"""The kernel copies parts in blocks of this size, and the merge calls `keep_alive` after each (a part may be GBs)."""
_READ_BYTES = 2**20
"""A merge reads a part (to hash it, or to copy it where the kernel cannot) this many bytes at a time, into one
buffer it reuses, calling `keep_alive` after each block it copies. 1 MiB hashes a 256 MiB part as fast as its
mapping did (170 ms); 64 MiB took 300 ms, its buffer too big for the CPU's cache."""
_WAIT_SLICE_SECONDS = 1.0
"""How often a merge calls its `keep_alive` while it waits for its fsync and its hash."""
_T = TypeVar("_T")
_FIX = ("replace the link with a real folder inside the output roots and resume the job, or submit the job "
        "again into another output_dir")


def _open_output_dir(output_dir: Path, *, create: bool = False) -> Folder:
    """The job's output folder, opened afresh without following a link anywhere on its path."""
    return open_folder(output_dir, what="output folder", fix=_FIX, create=create)


@dataclass
class _JobParts:
    """A job's opened parts folders: `.parts/` (`root`) and `.parts/<job id>/` (`folder`; `.parts/` for job '')."""

    root: Folder
    folder: Folder

    def __enter__(self) -> _JobParts:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.folder.close()
        self.root.close()


def _open_job_parts(out: Folder, job_id: str, *, create: bool = False) -> _JobParts:
    """The job's parts folders in the opened output folder `out`, made first if missing and `create`."""
    root = out.sub(PARTS_DIR, create=create)
    try:
        return _JobParts(root, root.sub(job_id, create=create) if job_id else root)
    except BaseException:
        root.close()
        raise


def _temp_name(final_name: str) -> str:
    # A unique name per writer: two workers finishing the same chunk (or merge) never share a temp.
    return f".{final_name}.{secrets.token_hex(6)}.tmp"


def _write_atomically(target: Entry, write: Callable[[IO[bytes]], object]) -> None:
    """Write a file so it appears whole or not at all; the folder entry is fsynced by the caller."""
    folder, temp = target.folder, _temp_name(target.name)
    try:
        with folder.create_new(temp) as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        folder.replace(temp, folder, target.name)
    except BaseException:
        folder.unlink(temp)
        raise


def write_part(output_dir: Path, chunk_index: int, outputs: Mapping[str, np.ndarray], *, job_id: str = "",
               quarantined: Sequence[tuple[int, str]] = (), quarantine_ids: Mapping[int, Any] | None = None) -> None:
    """Write one chunk's outputs, one `.parts/<job_id>/<name>.<chunk_index:06d>.npy` file per output,
    and its `quarantined` rows (job row, error) as `quarantine.<chunk_index:06d>.jsonl` (with each row's
    id from `quarantine_ids`, job row -> id, for a table input with an id column).

    Each part is written atomically and in C order, so writing the same data again (a chunk re-run
    after a lost ack) gives byte-identical files, and `part_exists` never sees half a part. The
    quarantine part is durable before the first `.npy` part appears: a chunk whose parts exist has
    its quarantined rows on disk too.
    """
    arrays = {name: np.ascontiguousarray(values) for name, values in outputs.items()}
    for name, arr in arrays.items():
        if arr.dtype.hasobject:
            raise BadInput(
                f"output '{name}' holds Python objects (dtype {arr.dtype}), which cannot be stored as .npy; "
                "use a model whose outputs are numeric tensors"
            )
    files = {part_name(name, chunk_index): partial(np.lib.format.write_array, array=arr, allow_pickle=False)
             for name, arr in arrays.items()}
    write_part_files(output_dir, chunk_index, files, job_id=job_id, quarantined=quarantined,
                     quarantine_ids=quarantine_ids)


def write_part_files(output_dir: Path, chunk_index: int, files: Mapping[str, Callable[[IO[bytes]], object]], *,
                     job_id: str = "", quarantined: Sequence[tuple[int, str]] = (),
                     quarantine_ids: Mapping[int, Any] | None = None) -> None:
    """Write one chunk's part files (file name -> what writes it) atomically into `.parts/<job_id>/`, its
    quarantined rows first (`write_part`); durable, with the folders above them, when this returns."""
    output_dir = Path(output_dir)
    ids = quarantine_ids or {}
    try:
        with _open_output_dir(output_dir, create=True) as out, _open_job_parts(out, job_id, create=True) as opened:
            parts = opened.folder
            rejected = parts / quarantine_part_name(chunk_index)
            if quarantined:
                text = "".join(quarantine.entry_line(row, error, ids.get(row)) for row, error in quarantined).encode()
                _write_atomically(rejected, lambda handle: handle.write(text))
                parts.fsync()
            else:
                parts.unlink(rejected.name)  # (a run of the chunk that quarantined rows it no longer does)
            for file_name, write in files.items():
                _write_atomically(parts / file_name, write)
            parts.fsync()
            # The folders above it every time, not only by the commit that made them: a commit beside it
            # (another commit thread, another worker) that found them made must not ack before their entries
            # are durable. (A clean folder's fsync takes about 40 us.)
            for above in (opened.root, out) if job_id else (out,):
                above.fsync()
    except OSError as err:
        raise storage_error(output_dir, err) from err


def chunk_written(output_dir: Path, chunk_index: int, chunk: tuple[int, int], output_names: Sequence[str], *,
                  job_id: str) -> bool:
    """Whether every output's part of chunk `chunk_index` (rows `chunk`, [start, stop)) is on disk, whole:
    an earlier run wrote them and its ack was lost (a Redis failover can drop one) or failed. Parts appear
    atomically, each checked for the chunk's rows as the merge checks it; a link, or anything else
    amiss, counts as not written (the chunk then runs and writes it again)."""
    try:
        with _open_output_dir(Path(output_dir)) as out, _open_job_parts(out, job_id) as opened:
            for name in output_names:
                with _load_part(opened.folder, name, chunk_index, chunk):
                    pass
    except (SitsError, OSError):
        return False
    return True


Layout = Sequence[tuple[int, tuple[int, int]]]
"""A job's chunks as (index, (start, stop)), in the order of their rows (`broker.jobs.cuts.in_row_order`):
a chunk split as it ran has a new chunk after the job's last index for the rest of its rows."""


def _rows_covered(layout: Layout) -> int:
    """Check the chunks tile [0, total) in row order, without gaps or empty chunks; return total."""
    expected_start = 0
    for _, (start, stop) in layout:
        if start != expected_start or stop <= start:
            raise ValueError(f"chunk ranges must tile [0, total) in order, got {list(layout)}")
        expected_start = stop
    if expected_start == 0:
        raise ValueError("a job has at least one chunk")
    return expected_start


@dataclass
class _Part:
    """One part's first `rows` rows, in its file opened without following a link: read (`_part_bytes`),
    never mapped, since a part cut short under a mapping kills the worker (SIGBUS) at the first page read
    past its new end. Leaving its `with` closes the file: one part at a time is held."""

    path: Path
    chunk_index: int
    header: NpyHeader
    rows: int
    handle: BinaryIO

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.header.shape[1:]

    @property
    def nbytes(self) -> int:
        return self.rows * math.prod(self.row_shape) * self.header.dtype.itemsize

    @property
    def in_row_order(self) -> bool:
        """Whether the rows' bytes lie in the file as the merged file holds them, from `header.data_offset`
        (a Fortran-order part's values lie by column: its bytes must be reordered)."""
        return not self.header.fortran_order or math.prod(self.row_shape) <= 1

    def unreadable(self, err: Exception) -> SitsError:
        return SitsError(f"output part '{self.path}' is unreadable (cut short while the merge read it: {err}); "
                         f"delete it and run chunk {self.chunk_index} again")

    def __enter__(self) -> _Part:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.handle.close()


def _part_missing(name: str, chunk_index: int, chunk: tuple[int, int]) -> FileMissing:
    return FileMissing(
        f"output part '{part_name(name, chunk_index)}' of chunk {chunk_index} (rows [{chunk[0]}, {chunk[1]})) is "
        "missing; run that chunk again before finalizing"
    )


def _parts_gone(folder: Path) -> FileMissing:
    return FileMissing(f"'{folder}' is missing, and with it every chunk's output parts; resume the job to run its "
                       "chunks again before finalizing")


def _load_part(parts: Folder, name: str, chunk_index: int, chunk: tuple[int, int], *, merging: bool = False) -> _Part:
    """Open one part and check its header: it holds the chunk's rows. `merging`: a part longer than its chunk
    holds the chunk's rows first (a run that read the chunk before another run split it, broker/jobs/cuts.py,
    wrote it, and rows are computed alike by every run): its first rows are taken. Elsewhere (is a chunk's
    part written?) only the chunk's own rows count."""
    path = parts.path / part_name(name, chunk_index)
    try:
        handle = parts.read_file(path.name)
    except FileNotFoundError as err:
        raise _part_missing(name, chunk_index, chunk) from err
    try:
        fix = f"delete it and run chunk {chunk_index} again"
        try:
            header = read_npy_header(handle, os.fstat(handle.fileno()).st_size, f"output part '{path}'", fix)
        except BadInput as err:  # (not the job's input: the part is to be written again)
            raise SitsError(err.message) from err
        rows = chunk[1] - chunk[0]
        if not header.shape or header.shape[0] < rows or (header.shape[0] > rows and not merging):
            raise SitsError(
                f"output part '{path}' has shape {list(header.shape)} but chunk {chunk_index} covers rows "
                f"[{chunk[0]}, {chunk[1]}); delete it and run the chunk again"
            )
    except BaseException:
        handle.close()
        raise
    return _Part(path, chunk_index, header, rows, handle)


def _merge_output(parts: Folder, name: str, layout: Layout, total: int,
                  keep_alive: Callable[[], None]) -> tuple[str, dict[str, Any]]:
    """Merge one output's parts into a temp file in the job's parts folder `parts`; return its name and
    its manifest entry (the caller renames it to the entry's `file` when the merge is to be published).

    The parts are copied into a temp file in row order (`_copy_part`) while a second thread hashes
    the same bytes: the copy and SHA-256 both release the GIL, so the copy, its fsync and the hash
    overlap instead of adding up. Each side opens one part at a time, so thousands of chunks neither
    exhaust file handles nor memory. `keep_alive` is called (on the calling thread) after every block
    copied and every second of the waits for the fsync (run on a third thread) and the hash, so a
    merge of GBs keeps its item's lease.
    """
    with _load_part(parts, name, *layout[0], merging=True) as first:
        dtype, row_shape = first.header.dtype, first.row_shape
    final = output_file_name(name)
    temp = _temp_name(final)  # in the job's parts folder: removed with its parts if we crash
    shape = [total, *row_shape]
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": tuple(shape)}
    )
    stop, buffer = threading.Event(), np.empty(_READ_BYTES, np.uint8)
    with ThreadPoolExecutor(2, thread_name_prefix="sits-merge") as helpers:
        hashed = helpers.submit(_hash_parts, parts, name, layout, header.getvalue(), stop)
        try:
            with parts.create_new(temp) as handle:
                handle.write(header.getvalue())
                for index, chunk in layout:
                    with _load_part(parts, name, index, chunk, merging=True) as part:
                        if part.header.dtype != dtype or part.row_shape != row_shape:
                            raise BadInput(
                                f"output '{name}' has dtype {dtype} and rows of shape {list(row_shape)} in chunk "
                                f"{layout[0][0]} but {part.header.dtype} {list(part.row_shape)} in chunk {index}; "
                                "outputs whose rows vary in shape cannot be merged into one .npy"
                            )
                        _copy_part(handle, part, buffer, keep_alive)
                handle.flush()
                _wait(helpers.submit(os.fsync, handle.fileno()), keep_alive)
            checksum = f"sha256:{_wait(hashed, keep_alive)}"
        except BaseException:
            stop.set()
            parts.unlink(temp)
            raise
    return temp, {"file": final, "shape": shape, "dtype": dtype.name, "checksum": checksum}


def _part_bytes(part: _Part, buffer: np.ndarray, start: int = 0) -> Iterator[memoryview]:
    """The part's rows' bytes as the merged file holds them, from byte `start` of them (a part `in_row_order`
    only), a block at a time: read with `os.preadv` into `buffer`, reused, so each block is valid until the
    next. A Fortran-order part is read by rows (`StoredArray`) and reordered a block at a time."""
    header = part.header
    try:
        if part.in_row_order:
            for offset in range(start, part.nbytes, len(buffer)):
                block = buffer[: min(len(buffer), part.nbytes - offset)]
                read_into(part.handle.fileno(), block, header.data_offset + offset)
                yield block.data
            return
        stored = StoredArray(header.data_offset, header.dtype, header.shape, header.fortran_order)
        step = max(1, len(buffer) // max(1, part.nbytes // part.rows))
        for lo in range(0, part.rows if part.nbytes else 0, step):
            rows = np.ascontiguousarray(stored.read(part.handle.fileno(), lo, min(lo + step, part.rows)))
            yield memoryview(rows.data).cast("B")
    except ShortRead as err:  # (its size was checked at open: it was cut short since)
        raise part.unreadable(err) from err


def _copy_part(handle: IO[bytes], part: _Part, buffer: np.ndarray, keep_alive: Callable[[], None]) -> None:
    """Append the part's rows to `handle`, calling `keep_alive` after every block. On Linux the kernel copies a
    part `in_row_order` from its file (`os.copy_file_range`, `_COPY_BLOCK_BYTES` a call): no pass through this
    process, which took a 40 MB merge from about 43 to 32 ms on two cores. Where the call is missing or the
    file system refuses it, the rest is read into `buffer` (`_part_bytes`). The kernel's copy of a part cut
    short ends early, and so does the read that follows it: an error, not a crash."""
    copy_range = getattr(os, "copy_file_range", None)
    copied = 0
    if copy_range is not None and part.in_row_order:
        handle.flush()  # the kernel writes at the descriptor's position: nothing may wait in the buffer
        source, target = part.handle.fileno(), handle.fileno()
        while copied < part.nbytes:
            try:
                count = copy_range(source, target, min(part.nbytes - copied, _COPY_BLOCK_BYTES),
                                   part.header.data_offset + copied)
            except OSError:  # EXDEV, EINVAL, ENOSYS...: the rest through this process
                break
            if not count:  # (the end of a part cut short, or a file system that copies nothing)
                break
            copied += count
            keep_alive()
    if copied < part.nbytes:
        for block in _part_bytes(part, buffer, copied):
            handle.write(block)
            keep_alive()


def _wait(future: Future[_T], keep_alive: Callable[[], None]) -> _T:
    """The future's result, calling `keep_alive` every `_WAIT_SLICE_SECONDS` until it is done."""
    while not wait([future], timeout=_WAIT_SLICE_SECONDS).done:
        keep_alive()
    return future.result()


def _keep_nothing_alive() -> None:
    """The `keep_alive` of a merge that holds no lease."""


def _always_publish() -> bool:
    """The `may_publish` of a merge that nothing can stop."""
    return True


def _hash_parts(parts: Folder, name: str, layout: Layout, header: bytes,
                stop: threading.Event) -> str:
    """SHA-256 hex digest of `header` followed by the parts' bytes in row order (the merged file)."""
    digest, buffer = hashlib.sha256(header), np.empty(_READ_BYTES, np.uint8)
    for index, chunk in layout:
        if stop.is_set():
            break
        with _load_part(parts, name, index, chunk, merging=True) as part:
            for block in _part_bytes(part, buffer):
                digest.update(block)
    return digest.hexdigest()


Merged = dict[str, tuple[str, dict[str, Any]]]
"""Output name -> (its temp file in the parts folder, its manifest entry, whose `file` the temp becomes);
outputs merged into one file share its temp."""
Merge = Callable[[Folder, Sequence[str], Layout, int, Callable[[], None], Merged], None]
"""How a job's parts are merged: (parts folder, output names, chunks in row order, total rows, keep_alive, merged so
far), adding each temp file to `merged` as soon as it exists (so a failure removes it)."""


def merge_npy_outputs(parts: Folder, output_names: Sequence[str], layout: Layout,
                      total: int, keep_alive: Callable[[], None], merged: Merged) -> None:
    """The `Merge` of `.npy` parts: each output into its `<name>.npy` (`_merge_output`)."""
    for name in output_names:
        merged[name] = _merge_output(parts, name, layout, total, keep_alive)


def _merge_outputs(out: Folder, parts: Folder, output_names: Sequence[str], layout: Layout,
                   total: int, keep_alive: Callable[[], None],
                   may_publish: Callable[[], bool], merge: Merge) -> Merged | None:
    """Merge the outputs into temp files in `parts` (`merge`), then ask `may_publish`: output
    name -> (temp file, manifest entry) to rename and publish, or None. Unless they are handed back, the
    temp files are removed (stopped, or failed: a merge of a later output, `may_publish` raising, a link
    in the output folder `out` where a published file goes)."""
    merged: Merged = {}
    publish = False
    try:
        merge(parts, output_names, layout, total, keep_alive, merged)
        publish = may_publish()
        if publish:  # (a rename would replace a link, not follow it: refused all the same, before any rename)
            for published in (*(entry["file"] for _, entry in merged.values()), QUARANTINE_NAME, MANIFEST_NAME):
                out.refuse_link(published)
        return merged if publish else None
    except BaseException:
        publish = False
        raise
    finally:
        if not publish:
            for temp in {temp for temp, _ in merged.values()}:
                parts.unlink(temp)


def finalize_outputs(
    output_dir: Path,
    chunk_ranges: Sequence[tuple[int, int]],
    output_names: Sequence[str],
    manifest_extra: Mapping[str, Any],
    *,
    job_id: str = "",
    keep_alive: Callable[[], None] = _keep_nothing_alive,
    may_publish: Callable[[], bool] = _always_publish,
    bad_row_limit: int | None = None,
    quarantine_fill: float = math.nan,
    merge: Merge = merge_npy_outputs,
) -> dict[str, Any] | None:
    """Merge every output's parts (those `write_part` wrote for `job_id`) into `<output_dir>/<name>.npy`
    and write `manifest.json`; None when `may_publish` stopped it.

    Idempotent: once the manifest exists it is returned as is; after a crash halfway the parts are
    still there and the merge simply runs again. The manifest is written last, so its presence
    means every output file is complete. `manifest_extra` (job id, model name and version, input
    file and checksum) is stored alongside rows, outputs and chunks. The parts stay: the caller
    drops them with `remove_parts` once the job is recorded as done, so the job does not wait on
    unlinking them. The merge calls `keep_alive` as it goes (after each block it copies, and about
    every second while it waits on the disk): a caller holding a lease on the finalize step extends
    it there, rate-limited on its side, so a long merge is not taken for a dead one.

    Every output is merged into a temp file first; `may_publish` is called once they all are, and
    only if it returns True do they become `<name>.npy` and the manifest follows. So a caller can
    stop a merge whose job was cancelled meanwhile (or raise, e.g. for an input that changed) and
    leave the folder as it was: the parts, and no output of a job that did not finish.

    The chunks' quarantined rows are merged into `quarantine.jsonl` (row order) before the manifest,
    which lists them as `quarantined_rows` with each output's fill value (`quarantine`). More of them
    than `bad_row_limit` is a BadInput naming them, before anything is merged. `merge` merges the parts
    (`.npy` parts by default; `table_outputs.merge_table_parts` for a Parquet job). `chunk_ranges` are by chunk
    index; the merge takes them in row order (a chunk split as it ran has its rest numbered after the last).
    """
    output_dir = Path(output_dir)
    layout = cuts.in_row_order(chunk_ranges)  # (a split chunk's rest is numbered after the job's last chunk)
    total = _rows_covered(layout)
    if clash := set(_RESERVED_KEYS) & set(manifest_extra):
        raise ValueError(f"manifest_extra may not set {sorted(clash)}")
    try:
        out = _open_output_dir(output_dir)
    except FileNotFoundError as err:  # (as when a part is missing)
        raise _parts_gone(output_dir) from err
    except OSError as err:
        raise storage_error(output_dir, err) from err
    with out:
        manifest = _read_manifest(out)
        if manifest is None:
            try:
                manifest = _merge_and_publish(out, layout, output_names, manifest_extra, total=total,
                                              job_id=job_id, keep_alive=keep_alive, may_publish=may_publish,
                                              bad_row_limit=bad_row_limit, quarantine_fill=quarantine_fill,
                                              merge=merge)
                if manifest is None:
                    return None
            except (FileMissing, OSError) as err:
                # Another worker may have finished the same merge and removed the parts meanwhile.
                manifest = _read_manifest(out)
                if manifest is None and isinstance(err, OSError):
                    raise storage_error(output_dir, err) from err
                if manifest is None:
                    raise
    _check_same_job(output_dir, manifest, total, output_names, manifest_extra)
    return manifest


def _merge_and_publish(out: Folder, layout: Layout, output_names: Sequence[str],
                       manifest_extra: Mapping[str, Any], *, total: int, job_id: str,
                       keep_alive: Callable[[], None], may_publish: Callable[[], bool], bad_row_limit: int | None,
                       quarantine_fill: float, merge: Merge) -> dict[str, Any] | None:
    """`finalize_outputs`' merge in the opened output folder `out`, and its outputs, quarantine and manifest
    published; the manifest, or None when `may_publish` stopped it."""
    try:
        opened = _open_job_parts(out, job_id)
    except FileNotFoundError as err:  # (as when a part is missing)
        raise _parts_gone(out.path / PARTS_DIR / job_id) from err
    with opened:
        parts = opened.folder
        rejected = _read_quarantine(parts)
        if bad_row_limit is not None and len(rejected) > bad_row_limit:
            raise BadInput(quarantine.too_many_message([int(entry["row"]) for entry in rejected],
                                                       str(rejected[0]["error"]), limit=bad_row_limit,
                                                       rows_total=total))
        merged = _merge_outputs(out, parts, output_names, layout, total, keep_alive, may_publish, merge)
        if merged is None:
            return None
        for temp, file in {temp: entry["file"] for temp, entry in merged.values()}.items():
            parts.replace(temp, out, file)
        out.fsync()  # (the outputs' names are durable before the manifest can be: POSIX orders no two
        # renames, so a crash must not leave a manifest whose outputs' entries were lost)
        outputs = {name: entry for name, (_, entry) in merged.items()}
        manifest = {"rows": total, "outputs": outputs, "chunks": len(layout), **manifest_extra,
                    **_publish_quarantine(out, rejected, outputs, quarantine_fill)}
        text = json.dumps(manifest, indent=2).encode()
        _write_atomically(out / MANIFEST_NAME, lambda handle: handle.write(text))
        out.fsync()
        return manifest


def _read_manifest(out: Folder) -> dict[str, Any] | None:
    """The opened output folder's manifest.json as a dict (a link there is PathNotAllowed); None when
    there is none or it is unreadable (`output_layout.read_manifest`)."""
    try:
        return parse_manifest(out.read_bytes(MANIFEST_NAME))
    except OSError:
        return None


def read_quarantine(output_dir: Path, job_id: str = "") -> list[dict[str, Any]]:
    """Every chunk's quarantined rows (`write_part`), in row order, from one listing of the parts folder."""
    try:
        with _open_output_dir(output_dir) as out, _open_job_parts(out, job_id) as opened:
            return _read_quarantine(opened.folder)
    except FileNotFoundError:
        return []
    except OSError as err:
        raise storage_error(Path(output_dir), err) from err


def _read_quarantine(parts: Folder) -> list[dict[str, Any]]:
    """`read_quarantine` from the opened parts folder `parts`."""
    names = sorted(name for name in parts.names() if name.startswith("quarantine.") and name.endswith(".jsonl"))
    entries = [entry for name in names for entry in quarantine.read_entries(parts.read_bytes(name).decode())]
    # (one row per entry: a part longer than its split chunk lists rows its chunk's rest lists again)
    once = {int(entry["row"]): entry for entry in reversed(entries)}
    return sorted(once.values(), key=lambda entry: int(entry["row"]))


def _publish_quarantine(out: Folder, rejected: Sequence[dict[str, Any]], outputs: Mapping[str, Any],
                        fill: float) -> dict[str, Any]:
    """Write `quarantine.jsonl` (removing a stale one when no row was quarantined); the manifest's keys for it."""
    if not rejected:
        out.unlink(QUARANTINE_NAME)
        return {"quarantined_rows": []}
    text = "".join(quarantine.entry_line(int(entry["row"]), str(entry["error"]), entry.get("id"))
                   for entry in rejected).encode()
    _write_atomically(out / QUARANTINE_NAME, lambda handle: handle.write(text))
    fills = {name: quarantine.json_number(quarantine.fill_value(np.dtype(entry["dtype"]), fill))
             for name, entry in outputs.items()}
    with_ids = any("id" in entry for entry in rejected)  # (a table input with an id column)
    listed = {"quarantined_ids": [entry.get("id") for entry in rejected]} if with_ids else {}
    return {"quarantined_rows": [int(entry["row"]) for entry in rejected], **listed,
            "quarantine": {"file": QUARANTINE_NAME, "rows": len(rejected), "fill_values": fills}}


def remove_parts(output_dir: Path, *, job_id: str = "") -> None:
    """Drop a finalized job's part files (and temp files of its merges that crashed): `.parts/<job_id>/`,
    then `.parts/` itself if that left it empty.

    Only `job_id`'s: another job's parts in the same folder (a cancelled job's, to be resumed) are its
    work, not leftovers. Only call it once `manifest.json` exists: the merged outputs are durable then,
    and parts left behind by a crash before this call are harmless (running the finalize step again
    removes them). With `job_id` '' (parts written without a job id) the files directly in `.parts/`
    are the job's, its subfolders other jobs'.
    """
    try:
        with _open_output_dir(output_dir) as out:
            try:
                parts = out.sub(PARTS_DIR)
            except FileNotFoundError:
                return
            with parts:
                if job_id:
                    parts.remove_tree(job_id)
                else:
                    for name in parts.names():
                        if not parts.is_folder(name):
                            parts.unlink(name)
            out.remove_if_empty(PARTS_DIR)  # not if another job's parts are there
    except (OSError, PathNotAllowed) as err:  # the job's results are published: its leftovers wait
        log.warning("could not remove the parts of job %r under '%s': %s", job_id, output_dir, err)


def _check_same_job(
    output_dir: Path,
    manifest: dict[str, Any],
    total: int,
    output_names: Sequence[str],
    manifest_extra: Mapping[str, Any],
) -> None:
    """Refuse to hand back a manifest that another job left in the same folder."""
    expected_extra = json.loads(json.dumps(dict(manifest_extra)))  # compare as stored (tuples -> lists)
    same = (
        manifest.get("rows") == total
        and list(manifest.get("outputs", {})) == list(output_names)
        and all(manifest.get(key) == value for key, value in expected_extra.items())
    )
    if not same:
        raise Conflict(
            f"'{output_dir}' already holds results of another job ({MANIFEST_NAME}); "
            "choose an empty output folder or remove the old results"
        )
