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
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import mmap
import os
import secrets
import shutil
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import partial
from pathlib import Path
from typing import IO, Any, TypeVar

import numpy as np

from broker.errors import BadInput, Conflict, FileMissing, SitsError
from broker.failures import quarantine
from broker.jobs.output_layout import (
    MANIFEST_NAME,
    PARTS_DIR,
    QUARANTINE_NAME,
    output_path,
    part_path,
    parts_folder,
    quarantine_part_path,
    read_manifest,
    storage_error,
)
from sits_worker.model.tensors import NPY_HEADER_LOCK

_RESERVED_KEYS = ("rows", "outputs", "chunks", "quarantined_rows", "quarantine")
_COPY_BLOCK_BYTES = 64 * 2**20
"""A merge copies parts in blocks of this size and calls its `keep_alive` after each (a part may be GBs)."""
_WAIT_SLICE_SECONDS = 1.0
"""How often a merge calls its `keep_alive` while it waits for its fsync and its hash."""
_T = TypeVar("_T")


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_path(folder: Path, final_name: str) -> Path:
    # A unique name per writer: two workers finishing the same chunk (or merge) never share a temp.
    return folder / f".{final_name}.{secrets.token_hex(6)}.tmp"


def _write_atomically(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Write a file so it appears whole or not at all; the folder entry is fsynced by the caller."""
    temp = _temp_path(path.parent, path.name)
    try:
        # os.open with 0o666 so the final file gets the process umask, unlike mkstemp's 0o600.
        with os.fdopen(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def write_part(output_dir: Path, chunk_index: int, outputs: Mapping[str, np.ndarray], *, job_id: str = "",
               quarantined: Sequence[tuple[int, str]] = ()) -> None:
    """Write one chunk's outputs, one `.parts/<job_id>/<name>.<chunk_index:06d>.npy` file per output,
    and its `quarantined` rows (job row, error) as `quarantine.<chunk_index:06d>.jsonl`.

    Each part is written atomically and in C order, so writing the same data again (a chunk re-run
    after a lost ack) gives byte-identical files, and `part_exists` never sees half a part. The
    quarantine part is durable before the first `.npy` part appears: a chunk whose parts exist has
    its quarantined rows on disk too.
    """
    output_dir = Path(output_dir)
    arrays = {name: np.ascontiguousarray(values) for name, values in outputs.items()}
    for name, arr in arrays.items():
        if arr.dtype.hasobject:
            raise BadInput(
                f"output '{name}' holds Python objects (dtype {arr.dtype}), which cannot be stored as .npy; "
                "use a model whose outputs are numeric tensors"
            )
    try:
        folder = parts_folder(output_dir, job_id)
        folder.mkdir(parents=True, exist_ok=True)
        rejected = quarantine_part_path(output_dir, chunk_index, job_id)
        if quarantined:
            text = "".join(quarantine.entry_line(row, error) for row, error in quarantined).encode()
            _write_atomically(rejected, lambda handle: handle.write(text))
            _fsync_dir(folder)
        else:
            rejected.unlink(missing_ok=True)  # (a run of the chunk that quarantined rows it no longer does)
        for name, arr in arrays.items():
            path = part_path(output_dir, name, chunk_index, job_id)
            _write_atomically(path, partial(np.lib.format.write_array, array=arr, allow_pickle=False))
        _fsync_dir(folder)
        # The folders above it every time, not only by the commit that made them: a commit beside it (another
        # commit thread, another worker) that found them made must not ack before their entries are durable.
        # (A clean folder's fsync takes about 40 us.)
        for above in dict.fromkeys((folder.parent, output_dir)):
            _fsync_dir(above)
    except OSError as err:
        raise storage_error(output_dir, err) from err


def _rows_covered(chunk_ranges: Sequence[tuple[int, int]]) -> int:
    """Check the chunks tile [0, total) in order, without gaps or empty chunks; return total."""
    expected_start = 0
    for start, stop in chunk_ranges:
        if start != expected_start or stop <= start:
            raise ValueError(f"chunk ranges must tile [0, total) in order, got {list(chunk_ranges)}")
        expected_start = stop
    if expected_start == 0:
        raise ValueError("a job has at least one chunk")
    return expected_start


def _load_part(output_dir: Path, name: str, chunk_index: int, chunk: tuple[int, int], job_id: str) -> np.ndarray:
    """Map one part read-only and check it holds exactly the chunk's rows."""
    path = part_path(output_dir, name, chunk_index, job_id)
    try:
        with NPY_HEADER_LOCK:
            part = np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError as err:
        raise FileMissing(
            f"output part '{path.name}' of chunk {chunk_index} (rows [{chunk[0]}, {chunk[1]})) is missing; "
            "run that chunk again before finalizing"
        ) from err
    except (ValueError, EOFError) as err:
        raise SitsError(
            f"output part '{path}' is unreadable ({err}); delete it and run chunk {chunk_index} again"
        ) from err
    if part.ndim == 0 or part.shape[0] != chunk[1] - chunk[0]:
        raise SitsError(
            f"output part '{path}' has shape {list(part.shape)} but chunk {chunk_index} covers rows "
            f"[{chunk[0]}, {chunk[1]}); delete it and run the chunk again"
        )
    return part


def _merge_output(output_dir: Path, name: str, chunk_ranges: Sequence[tuple[int, int]], total: int,
                  job_id: str, keep_alive: Callable[[], None]) -> tuple[Path, dict[str, Any]]:
    """Merge one output's parts into a temp file in the job's parts folder; return it and its manifest
    entry (the caller renames it to the entry's `file` when the merge is to be published).

    The parts are copied into a temp file in row order (`_copy_part`) while a second thread hashes
    the same bytes: the copy and SHA-256 both release the GIL, so the copy, its fsync and the hash
    overlap instead of adding up. Each side opens one part at a time, so thousands of chunks neither
    exhaust file handles nor memory. `keep_alive` is called (on the calling thread) after every block
    copied and every second of the waits for the fsync (run on a third thread) and the hash, so a
    merge of GBs keeps its item's lease.
    """
    first = _load_part(output_dir, name, 0, chunk_ranges[0], job_id)
    dtype, row_shape = first.dtype, first.shape[1:]
    del first
    final = output_path(output_dir, name)
    temp = _temp_path(parts_folder(output_dir, job_id), final.name)  # removed with the job's parts if we crash
    shape = [total, *row_shape]
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": tuple(shape)}
    )
    stop = threading.Event()
    with ThreadPoolExecutor(2, thread_name_prefix="sits-merge") as helpers:
        hashed = helpers.submit(_hash_parts, output_dir, name, chunk_ranges, header.getvalue(), stop, job_id)
        try:
            with open(temp, "wb") as handle:
                handle.write(header.getvalue())
                for index, chunk in enumerate(chunk_ranges):
                    part = _load_part(output_dir, name, index, chunk, job_id)
                    if part.dtype != dtype or part.shape[1:] != row_shape:
                        raise BadInput(
                            f"output '{name}' has dtype {dtype} and rows of shape {list(row_shape)} in chunk 0 "
                            f"but {part.dtype} {list(part.shape[1:])} in chunk {index}; outputs whose rows vary "
                            "in shape cannot be merged into one .npy"
                        )
                    _copy_part(handle, part, keep_alive)
                    del part
                handle.flush()
                _wait(helpers.submit(os.fsync, handle.fileno()), keep_alive)
            checksum = f"sha256:{_wait(hashed, keep_alive)}"
        except BaseException:
            stop.set()
            temp.unlink(missing_ok=True)
            raise
    return temp, {"file": final.name, "shape": shape, "dtype": dtype.name, "checksum": checksum}


def _copy(handle: IO[bytes], data: memoryview, keep_alive: Callable[[], None]) -> None:
    """Write `data` in blocks of `_COPY_BLOCK_BYTES`, calling `keep_alive` after each."""
    for offset in range(0, len(data), _COPY_BLOCK_BYTES):
        handle.write(data[offset : offset + _COPY_BLOCK_BYTES])
        keep_alive()


def _copy_part(handle: IO[bytes], part: np.ndarray, keep_alive: Callable[[], None]) -> None:
    """Append a mapped part's data to `handle`, in blocks of `_COPY_BLOCK_BYTES` with a `keep_alive`
    after each. On Linux the kernel copies it (`os.copy_file_range`): no page faults on the mapping and
    no pass through this process, which took a 40 MB merge from about 43 to 32 ms on two cores. Where
    the call is missing or the file system refuses it, the bytes go through `_copy`."""
    copy_range = getattr(os, "copy_file_range", None)
    mapped = _mapped_from(part)
    if copy_range is None or mapped is None or not part.nbytes:
        _copy(handle, _raw_bytes(part), keep_alive)
        return
    handle.flush()  # the kernel writes at the descriptor's position: nothing may wait in the buffer
    file_name, first = mapped
    offset, end = first, first + part.nbytes
    with open(file_name, "rb") as source:
        while offset < end:
            try:
                copied = copy_range(source.fileno(), handle.fileno(), min(end - offset, _COPY_BLOCK_BYTES), offset)
            except OSError:  # EXDEV, EINVAL, ENOSYS...: the rest through this process
                copied = 0
            if not copied:
                _copy(handle, _raw_bytes(part)[offset - first :], keep_alive)
                return
            offset += copied
            keep_alive()


def _mapped_from(part: np.ndarray) -> tuple[str, int] | None:
    """(File, offset of the data in it) of a whole mapped part in C order, whose bytes in the file are
    those of the merged rows; None for anything else (a view of a mapping carries its base's offset, not
    its own; a Fortran-order part's bytes must be reordered)."""
    if (isinstance(part, np.memmap) and isinstance(part.base, mmap.mmap) and part.filename is not None
            and part.flags.c_contiguous):
        return str(part.filename), int(part.offset)
    return None


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


def _raw_bytes(part: np.ndarray) -> memoryview:
    """A part's bytes as they lie in its file (parts are C order), without a copy."""
    return memoryview(np.ascontiguousarray(part).data).cast("B")


def _hash_parts(output_dir: Path, name: str, chunk_ranges: Sequence[tuple[int, int]], header: bytes,
                stop: threading.Event, job_id: str) -> str:
    """SHA-256 hex digest of `header` followed by the parts' bytes in row order (the merged file)."""
    digest = hashlib.sha256(header)
    for index, chunk in enumerate(chunk_ranges):
        if stop.is_set():
            break
        part = _load_part(output_dir, name, index, chunk, job_id)
        digest.update(_raw_bytes(part))
        del part
    return digest.hexdigest()


def _merge_outputs(output_dir: Path, output_names: Sequence[str], chunk_ranges: Sequence[tuple[int, int]],
                   total: int, job_id: str, keep_alive: Callable[[], None],
                   may_publish: Callable[[], bool]) -> dict[str, tuple[Path, dict[str, Any]]] | None:
    """Merge every output into its temp file (`_merge_output`), then ask `may_publish`: output name ->
    (temp file, manifest entry) to rename and publish, or None. Unless they are handed back, the temp
    files are removed (stopped, or failed: a merge of a later output, `may_publish` raising)."""
    merged: dict[str, tuple[Path, dict[str, Any]]] = {}
    publish = False
    try:
        for name in output_names:
            merged[name] = _merge_output(output_dir, name, chunk_ranges, total, job_id, keep_alive)
        publish = may_publish()
        return merged if publish else None
    finally:
        if not publish:
            for temp, _ in merged.values():
                temp.unlink(missing_ok=True)


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
    than `bad_row_limit` is a BadInput naming them, before anything is merged.
    """
    output_dir = Path(output_dir)
    total = _rows_covered(chunk_ranges)
    if clash := set(_RESERVED_KEYS) & set(manifest_extra):
        raise ValueError(f"manifest_extra may not set {sorted(clash)}")
    manifest = read_manifest(output_dir)
    if manifest is None:
        try:
            rejected = read_quarantine(output_dir, job_id)
            if bad_row_limit is not None and len(rejected) > bad_row_limit:
                raise BadInput(quarantine.too_many_message([int(entry["row"]) for entry in rejected],
                                                           str(rejected[0]["error"]), limit=bad_row_limit,
                                                           rows_total=total))
            merged = _merge_outputs(output_dir, output_names, chunk_ranges, total, job_id, keep_alive, may_publish)
            if merged is None:
                return None
            for temp, entry in merged.values():
                os.replace(temp, output_dir / entry["file"])
            _fsync_dir(output_dir)  # (the outputs' names are durable before the manifest can be: POSIX orders
            # no two renames, so a crash must not leave a manifest whose outputs' entries were lost)
            outputs = {name: entry for name, (_, entry) in merged.items()}
            manifest = {"rows": total, "outputs": outputs, "chunks": len(chunk_ranges), **manifest_extra,
                        **_publish_quarantine(output_dir, rejected, outputs, quarantine_fill)}
            text = json.dumps(manifest, indent=2).encode()
            _write_atomically(output_dir / MANIFEST_NAME, lambda handle: handle.write(text))
            _fsync_dir(output_dir)
        except (FileMissing, OSError) as err:
            # Another worker may have finished the same merge and removed the parts meanwhile.
            manifest = read_manifest(output_dir)
            if manifest is None and isinstance(err, OSError):
                raise storage_error(output_dir, err) from err
            if manifest is None:
                raise
    _check_same_job(output_dir, manifest, total, output_names, manifest_extra)
    return manifest


def read_quarantine(output_dir: Path, job_id: str = "") -> list[dict[str, Any]]:
    """Every chunk's quarantined rows (`write_part`), in row order, from one listing of the parts folder."""
    folder = parts_folder(Path(output_dir), job_id)
    try:
        names = sorted(entry.name for entry in os.scandir(folder)
                       if entry.name.startswith("quarantine.") and entry.name.endswith(".jsonl"))
        entries = [entry for name in names for entry in quarantine.read_entries((folder / name).read_text())]
    except FileNotFoundError:
        return []
    except OSError as err:
        raise storage_error(Path(output_dir), err) from err
    return sorted(entries, key=lambda entry: int(entry["row"]))


def _publish_quarantine(output_dir: Path, rejected: Sequence[dict[str, Any]], outputs: Mapping[str, Any],
                        fill: float) -> dict[str, Any]:
    """Write `quarantine.jsonl` (removing a stale one when no row was quarantined); the manifest's keys for it."""
    path = output_dir / QUARANTINE_NAME
    if not rejected:
        path.unlink(missing_ok=True)
        return {"quarantined_rows": []}
    text = "".join(quarantine.entry_line(int(entry["row"]), str(entry["error"])) for entry in rejected).encode()
    _write_atomically(path, lambda handle: handle.write(text))
    fills = {name: quarantine.json_number(quarantine.fill_value(np.dtype(entry["dtype"]), fill))
             for name, entry in outputs.items()}
    return {"quarantined_rows": [int(entry["row"]) for entry in rejected],
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
    parts = Path(output_dir) / PARTS_DIR
    if job_id:
        shutil.rmtree(parts_folder(output_dir, job_id), ignore_errors=True)
    elif parts.is_dir():
        for entry in parts.iterdir():
            if not entry.is_dir():
                entry.unlink(missing_ok=True)
    try:
        parts.rmdir()
    except OSError:  # not empty (another job's parts), or already gone
        pass


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
