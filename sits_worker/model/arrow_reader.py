"""Arrow IPC files (Feather v2) read in row ranges: read, never mapped, a range's columns of the record batches it
overlaps, each checked as it is read."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.ipc as pa_ipc

from broker.errors import BadInput
from sits_worker.model.table_readers import SLAB_BYTES, SLAB_ROWS, TableReader, clip

IPC_BATCH_BYTES = 32 * SLAB_BYTES
"""Most bytes of the values read that one Arrow IPC record batch may hold (512 MiB: 65,536 rows, write_feather's
batches, of 2,000 float32 values): a chunk reads the whole batches its rows lie in, so one of more is refused."""

class IpcReader(TableReader):
    """Arrow IPC (the file format; Feather v2): read, never mapped, a range's columns of the record batches it
    overlaps, each checked as it is read. A mapped file cut short after open kills the worker (SIGBUS) at
    the first page read past its new end; a read there is an error. The last batch read is kept: a
    worker's chunks mostly come in row order, several to a batch."""

    def __init__(self, handle: BinaryIO) -> None:
        super().__init__(handle)
        with pa.OSFile(self._path) as file:
            self.schema = pa_ipc.open_file(file).schema
            # Row counts only: the first column of each batch is read (a reader's schema is its fields).
            reader = pa_ipc.open_file(file, options=pa_ipc.IpcReadOptions(included_fields=[0]))
            counts = [_checked_batch(reader, index).num_rows for index in range(reader.num_record_batches)]
        self.rows = int(sum(counts))
        self._batch_starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self._lock = threading.Lock()
        self._kept: tuple[int, tuple[str, ...], pa.RecordBatch] | None = None

    def check_sizes(self, row_bytes: int) -> None:
        """Refuse a file with a record batch of more than `IPC_BATCH_BYTES` of the values read (`row_bytes` a
        row): a chunk reads the whole batches its rows lie in."""
        counts = np.diff(self._batch_starts)
        biggest = int(np.argmax(counts)) if len(counts) else 0
        if len(counts) and int(counts[biggest]) * row_bytes > IPC_BATCH_BYTES:
            most = max(1, IPC_BATCH_BYTES // row_bytes)
            raise BadInput(f"record batch {biggest} of the Arrow file holds {int(counts[biggest]):,} rows, "
                           f"{int(counts[biggest]) * row_bytes:,} bytes of the columns read; write batches of at "
                           f"most {most:,} rows (pyarrow.feather.write_feather's chunksize)")

    def read(self, start: int, stop: int, columns: Sequence[str], slab_rows: int = SLAB_ROWS,
             row_bytes: int = 0) -> Iterator[pa.RecordBatch]:
        """The record batches overlapping [start, stop), sliced (a file of its own per call: callers run in
        parallel)."""
        first = int(np.searchsorted(self._batch_starts, start, side="right")) - 1
        last = int(np.searchsorted(self._batch_starts, stop, side="left"))
        yield from clip(self._batches(range(first, last), tuple(columns)), int(self._batch_starts[first]),
                         start, stop, slab_rows)

    def _batches(self, indexes: range, columns: tuple[str, ...]) -> Iterator[pa.RecordBatch]:
        fields = sorted(self.schema.get_field_index(name) for name in columns)
        with pa.OSFile(self._path) as file:
            reader = None
            for index in indexes:
                with self._lock:
                    kept = self._kept
                if kept is not None and kept[:2] == (index, columns):
                    yield kept[2]
                    continue
                if reader is None:
                    reader = pa_ipc.open_file(file, options=pa_ipc.IpcReadOptions(included_fields=fields))
                batch = _checked_batch(reader, index).select(list(columns))
                rows = int(self._batch_starts[index + 1] - self._batch_starts[index])
                if batch.num_rows != rows:  # (rewritten in place since it was opened)
                    raise pa.ArrowInvalid(f"record batch {index} holds {batch.num_rows} rows now, {rows} when "
                                          "the file was opened")
                with self._lock:
                    self._kept = (index, columns, batch)
                yield batch

    def close(self) -> None:
        """Drop the kept batch and close the file."""
        with self._lock:
            self._kept = None
        super().close()


def _checked_batch(reader: pa_ipc.RecordBatchFileReader, index: int) -> pa.RecordBatch:
    """Record batch `index`, checked against its buffers: pyarrow reads a batch as its message says,
    unchecked, so a length past its buffers would read the memory beyond them (or crash the worker)."""
    batch = reader.get_batch(index)
    batch.validate(full=True)
    return batch
