"""Arrow IPC files (Feather v2) read in row ranges: read, never mapped, a range's columns of the record batches it
overlaps, each checked as it is read. Rows are counted at open from the file's footer and each batch's message
metadata, without reading any batch's buffers."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.ipc as pa_ipc

from broker.errors import BadInput
from sits_worker.model.arrow_messages import RECORD_BATCH, fields_bytes, message_header, record_batches
from sits_worker.model.table_readers import SLAB_BYTES, SLAB_ROWS, TableReader, clip

IPC_BATCH_BYTES = 8 * SLAB_BYTES
"""Most bytes of the values read that one Arrow IPC record batch may hold (128 MiB): a chunk reads the whole
batches its rows lie in, so one of more is refused. The API reads the first batch at submit, in a request
thread, so this is memory the API takes per submit in flight. write_feather's default batches of 65,536 rows
fit 512 float32 values a row; the refusal of wider rows names the most rows a batch may hold. The file's
dictionaries, all read with the first batch a reader reads, may take as much."""
BATCH_SLACK = 4
"""How many times the bytes its rows' values take the columns read of a record batch may hold once
decompressed (validity bitmaps, list offsets, ids longer than `table_source.ID_ROW_BYTES`), plus 1 MiB; a batch
holding more is refused before it is read."""

class IpcReader(TableReader):
    """Arrow IPC (the file format; Feather v2): read, never mapped, a range's columns of the record batches it
    overlaps, each checked as it is read. A mapped file cut short after open kills the worker (SIGBUS) at
    the first page read past its new end; a read there is an error. The last batch read is kept: a
    worker's chunks mostly come in row order, several to a batch."""

    def __init__(self, handle: BinaryIO) -> None:
        super().__init__(handle)
        with pa.OSFile(self._path) as file:
            reader = pa_ipc.open_file(file)
            self.schema = reader.schema
            self._blocks = record_batches(file, reader.num_record_batches, IPC_BATCH_BYTES)
        self.rows = sum(block.rows for block in self._blocks)
        self._batch_starts = np.concatenate([[0], np.cumsum([block.rows for block in self._blocks], dtype=np.int64)])
        self._lock = threading.Lock()
        self._kept: tuple[int, tuple[str, ...], pa.RecordBatch] | None = None

    def check_sizes(self, row_bytes: int) -> None:
        """Refuse a file with a record batch of more than `IPC_BATCH_BYTES` of the values read (`row_bytes` a
        row): a chunk reads the whole batches its rows lie in. Checked before any batch is read."""
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
        yield from clip(self._batches(range(first, last), tuple(columns), row_bytes), int(self._batch_starts[first]),
                         start, stop, slab_rows)

    def _batches(self, indexes: range, columns: tuple[str, ...], row_bytes: int) -> Iterator[pa.RecordBatch]:
        fields = sorted(self.schema.get_field_index(name) for name in columns)
        with pa.OSFile(self._path) as file:
            reader = None
            for index in indexes:
                with self._lock:
                    kept = self._kept
                if kept is not None and kept[:2] == (index, columns):
                    yield kept[2]
                    continue
                rows = self._blocks[index].rows
                if row_bytes:
                    self._refuse_oversized(file, index, fields, row_bytes)
                if reader is None:
                    reader = pa_ipc.open_file(file, options=pa_ipc.IpcReadOptions(included_fields=fields))
                batch = _checked_batch(reader, index).select(list(columns))
                if batch.num_rows != rows:  # (rewritten in place since it was opened)
                    raise pa.ArrowInvalid(f"record batch {index} holds {batch.num_rows} rows now, {rows} when "
                                          "the file was opened")
                with self._lock:
                    self._kept = (index, columns, batch)
                yield batch

    def _refuse_oversized(self, file: pa.NativeFile, index: int, fields: Sequence[int], row_bytes: int) -> None:
        """pa.ArrowInvalid for record batch `index` when `fields` of it take more than `BATCH_SLACK` times what
        its rows' values take (`row_bytes` a row) once decompressed, as its metadata says: pyarrow allocates
        what a buffer's length prefix claims (a 1 MB file of LZ4 took 256 MiB for one row), whatever the rows."""
        block = self._blocks[index]
        batch = message_header(file, block.offset, block.metadata_bytes, block.body_bytes, RECORD_BATCH,
                        f"record batch {index}")
        held = fields_bytes(file, block.offset + block.metadata_bytes, batch, self.schema, fields)
        if held is not None and held > BATCH_SLACK * block.rows * row_bytes + (1 << 20):
            raise pa.ArrowInvalid(f"record batch {index} holds {held:,} bytes of the columns read for "
                                  f"{block.rows:,} rows, more than their values take ({row_bytes} bytes a row, "
                                  "a string id counted as 64)")

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
