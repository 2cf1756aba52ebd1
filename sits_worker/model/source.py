"""What every reader of a job's input file is: an `InputSource`, its row count and its batches.

The readers themselves are in `inputs.py` (array formats) and `jsonl_source.py` (.jsonl).
"""

from __future__ import annotations

import abc
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from broker.errors import BadInput, FileMissing, RetryableError, SitsError
from sits_worker.model.safe_files import open_folder, symlink_found

Batch = tuple[np.ndarray, dict[str, np.ndarray]]
"""(Absolute int64 row numbers, input name -> array): one batch of an input file's rows."""
INPUT_FIX = "put the submitted file back at that path and resume the job, or submit a new job"
"""What to do about an input found to be a symbolic link (`safe_files.symlink_found`)."""


def file_error(path: Path, err: OSError) -> SitsError:
    """The SITS error for an OSError reading `path`: missing, unreadable, or worth a retry."""
    if isinstance(err, FileNotFoundError):
        return FileMissing(f"file '{path}' does not exist; check the path as the server sees it")
    if isinstance(err, PermissionError | IsADirectoryError | NotADirectoryError):
        return BadInput(f"cannot read '{path}' ({err.strerror or err}); it must be a readable regular file")
    return RetryableError(f"reading '{path}' failed ({err}); try again later")


def file_identity(path: Path) -> dict[str, int]:
    """What tells a file's bytes changed without reading them: size, modification time, inode (of a
    symbolic link at `path` itself, not of what it points to). Its folder is reached without following a
    link on the way (`safe_files.open_folder`): the path was checked resolved, so a link on it was swapped
    in since, and the identity of whatever it leads to would let that file pass for the one checked
    (PathNotAllowed instead)."""
    path = Path(path)
    try:
        with open_folder(path.parent, what="input", fix=INPUT_FIX) as folder:
            status = os.stat(path.name, dir_fd=folder.fd, follow_symlinks=False)
    except OSError as err:
        raise file_error(path, err) from err
    return _identity_of(status)


def _identity_of(status: os.stat_result) -> dict[str, int]:
    return {"size": status.st_size, "mtime_ns": status.st_mtime_ns, "inode": status.st_ino}


def check_unchanged(path: Path, identity: dict[str, int] | None, *, opened: os.stat_result | None = None) -> None:
    """BadInput when the file is no longer the one a job was submitted with (`file_identity`); the file
    at `path`, or the one already opened from it (`opened`: its `os.fstat`). PathNotAllowed when `path`
    is a symbolic link now (the path was resolved at submit: one was swapped in since).

    Workers check before and after every chunk and at each open: a job whose input was rewritten would
    mix old and new rows under the old checksum, one whose input was cut short would read short (an error to
    retry, which this check then names), and one whose path leads to another file would read that
    file's rows. No device number is compared: a network file system's differs from host to host.
    None (a job from before identities were kept) checks nothing.
    """
    if identity is None:
        return
    if opened is None:
        try:
            opened = os.stat(path, follow_symlinks=False)
        except OSError as err:
            raise file_error(path, err) from err
        if stat.S_ISLNK(opened.st_mode):
            raise symlink_found(path, "input", path, INPUT_FIX)
    now = _identity_of(opened)
    if now != identity:
        raise BadInput(
            f"input '{path}' changed after the job was submitted (size {identity['size']:,} -> {now['size']:,} "
            "bytes, or its modification time or inode); if its data are the same, resume the job (resume "
            "checks the checksum), else submit a new job"
        )


class InputSource(abc.ABC):
    """An opened input file: its row count and a reader of row ranges as model-ready batches.

    `iter_batches` yields `(row_indices, feed)`: absolute int64 row numbers, and for every input
    name a C-contiguous array of the model's dtype and one uniform shape, ready for onnxruntime.
    Treat feed arrays as read-only: they may be views of one read shared by several batches. Use it as a context
    manager or call `close()`.
    """

    def __init__(self, path: Path, fmt: str, input_names: Sequence[str], rows: int) -> None:
        if rows == 0:
            raise BadInput(f"input file '{path.name}' has no rows; submit a file with at least one row")
        self.path, self.format, self.input_names, self.rows = path, fmt, tuple(input_names), rows
        self._closed = False

    @abc.abstractmethod
    def iter_batches(self, start: int, stop: int, max_batch: int) -> Iterator[Batch]:
        """Yield batches of at most `max_batch` rows covering rows [start, stop) exactly once."""

    def row_ids(self, start: int, stop: int) -> Any:
        """The ids of rows [start, stop) (a pyarrow array: a table's `id_column`); None for a file without ids."""
        return None

    def reads_rows_cheaply(self) -> bool:
        """Whether reading a few rows costs little (False where the first read loads a whole array: a
        compressed npz member), so the API may read the first row at submit to check it."""
        return True

    def close(self) -> None:
        """Release file handles; batches already yielded stay valid (each holds its own memory)."""
        self._closed = True

    def __enter__(self) -> InputSource:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_range(self, start: int, stop: int, max_batch: int) -> None:
        if self._closed or max_batch < 1 or not 0 <= start <= stop:
            raise ValueError(f"cannot read rows [{start}, {stop}) by {max_batch} (closed: {self._closed})")
        if stop > self.rows:
            raise BadInput(
                f"rows [{start}, {stop}) lie past the end of '{self.path.name}' ({self.rows} rows); "
                "the file changed after the job was submitted, resubmit the job"
            )
