"""What a reader of one table file format gives a `TableSource` (`sits_worker/model/table_source.py`): its rows'
count, its schema, and the record batches of a row range, in slabs of bounded rows and bytes.

A reader reads through its own path to the file the job's handle has open (`fd_path`), so that each has its
own file position, and tells whether the file changed since it was opened (`changed`): a read that fails on
a file changed meanwhile is retried, and the retry's check of the file names the change.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import BinaryIO

import pyarrow as pa

SLAB_ROWS = 65_536
"""Most rows read at a time: one slab of 64 float32 columns is 16 MiB, whatever the file's size."""
SLAB_BYTES = 16 << 20
"""Most bytes of values read at a time, counted from the schema (`_row_bytes`): rows of wide list columns
(an image a row) come fewer to a slab, so that a small file that holds much once decoded (zeros compress
to nothing) never takes more memory than a slab's worth."""
def fd_path(handle: BinaryIO) -> str:
    """A path that opens the very file `handle` has open, with a file position of its own (Linux)."""
    return f"/proc/self/fd/{handle.fileno()}"


def is_numeric(kind: pa.DataType) -> bool:
    return bool(pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind))


def is_list(kind: pa.DataType) -> bool:
    return bool(pa.types.is_fixed_size_list(kind) or pa.types.is_list(kind) or pa.types.is_large_list(kind))


class TableReader(ABC):
    """One table file's rows: their count, schema, and record batches covering a row range (one subclass a
    format)."""

    rows: int
    schema: pa.Schema

    def __init__(self, handle: BinaryIO) -> None:
        self._handle = handle
        self._path = fd_path(handle)
        self._opened = size_and_time(handle)

    @abstractmethod
    def read(self, start: int, stop: int, columns: Sequence[str], slab_rows: int = SLAB_ROWS,
             row_bytes: int = 0) -> Iterator[pa.RecordBatch]:
        """Yield batches of `columns` covering rows [start, stop) exactly, in order, each at most `slab_rows`
        (`row_bytes`: what a row of them takes once read, from the schema; 0: not known)."""

    def changed(self) -> bool:
        """Whether the file's size or modification time differs from when it was opened (cut short, or
        rewritten in place)."""
        return size_and_time(self._handle) != self._opened

    def close(self) -> None:
        """Close the file."""
        self._handle.close()


def size_and_time(handle: BinaryIO) -> tuple[int, int]:
    status = os.fstat(handle.fileno())
    return status.st_size, status.st_mtime_ns


def clip(batches: Iterator[pa.RecordBatch], first_row: int, start: int, stop: int,
          slab_rows: int) -> Iterator[pa.RecordBatch]:
    """The parts of `batches` (the first at row `first_row`) that lie in [start, stop), in slabs of at most
    `slab_rows` rows."""
    row = first_row
    for batch in batches:
        lo, hi = max(start, row), min(stop, row + batch.num_rows)
        for first in range(lo, hi, slab_rows):
            yield batch.slice(first - row, min(slab_rows, hi - first))
        row += batch.num_rows
        if row >= stop:
            return
