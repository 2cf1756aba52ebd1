"""Reading a table as a job's input: Parquet, Arrow IPC or CSV through pyarrow, in row ranges.

Named columns map onto the model's inputs (`columns`: input -> column names, stacked in that order into
each row), or every numeric column but the id column goes into the model's one input. A chunk reads only
its own rows, a slab of at most `SLAB_ROWS` rows and `SLAB_BYTES` at a time, so a file larger than memory
runs in bounded memory: Parquet reads only the row groups that overlap the range (from its footer's row
counts; its footer and page headers checked at open against what the rows' values take), Arrow IPC reads
the batches that overlap it (read, not mapped: a mapped file cut short kills the process), CSV streams
from the start of the file (it has no index: seeking costs a parse of the rows before the range, so a
reader kept from the last range goes on where it stopped). Values are cast to the model's dtype with
pyarrow's safe cast: a value that would change (1.5 to an integer, 2**24 + 1 to float32; a CSV column of
integers feeding a float input is read as float64, and rounded as any decimal is) or a null is a BadInput
naming the column and the row. A read that fails on the file's bytes is a BadInput; one that
fails on a file changed since it was opened is retried, and the retry's check of the file names the change.

The file is read through the handle `inputs.open_input` opened without following a link, re-opened through
`/proc/self/fd` so that every reader has its own file position (Linux).
"""

from __future__ import annotations

import math
import os
import re
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.ipc as pa_ipc
import pyarrow.parquet as pq

from broker.errors import BadInput, SitsError
from sits_worker.model.source import Batch, InputSource, file_error
from sits_worker.model.tensors import InputSpec

TABLE_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow", ".csv": "csv"}
"""File suffix -> table format; a job's `input_format` names the format of a file with another suffix."""
SLAB_ROWS = 65_536
"""Most rows read at a time: one slab of 64 float32 columns is 16 MiB, whatever the file's size."""
SLAB_BYTES = 16 << 20
"""Most bytes of values read at a time, counted from the schema (`_row_bytes`): rows of wide list columns
(an image a row) come fewer to a slab, so that a small file that holds much once decoded (zeros compress
to nothing) never takes more memory than a slab's worth."""
WHOLE_GROUP_ROWS = 4 * SLAB_ROWS
"""A Parquet row group of at most this many rows, and four slabs' bytes, is read whole (twice as fast as
streaming it in slabs)."""
ID_ROW_BYTES = 64
"""The bytes a row of a string or binary id column is counted as when slabs are sized; a Parquet row group
whose ids take more than `FOOTER_SLACK` times this on average is refused."""
FOOTER_SLACK = 4
"""How many times the bytes its rows' values take a Parquet column chunk may hold uncompressed (levels,
page headers, ids longer than `ID_ROW_BYTES`), plus 1 MiB; one holding more is refused at open."""
CONVERT_ROWS = 8_192
"""Rows turned from columns into row-major arrays at a time: small enough to stay in cache (1.4x faster
than 64K rows at a time for 64 float32 columns)."""
IPC_BATCH_BYTES = 32 * SLAB_BYTES
"""Most bytes of the values read that one Arrow IPC record batch may hold (512 MiB: 65,536 rows, write_feather's
batches, of 2,000 float32 values): a chunk reads the whole batches its rows lie in, so one of more is refused."""
_IDS_KEPT = 16
"""Id columns of the last ranges read, kept for `row_ids` (the chunk's commit asks right after its read)."""


def _fd_path(handle: BinaryIO) -> str:
    """A path that opens the very file `handle` has open, with a file position of its own (Linux)."""
    return f"/proc/self/fd/{handle.fileno()}"


def _is_numeric(kind: pa.DataType) -> bool:
    return bool(pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind))


def _is_list(kind: pa.DataType) -> bool:
    return bool(pa.types.is_fixed_size_list(kind) or pa.types.is_list(kind) or pa.types.is_large_list(kind))


class _Reader(ABC):
    """One table file's rows: their count, schema, and record batches covering a row range (one subclass a
    format)."""

    rows: int
    schema: pa.Schema

    def __init__(self, handle: BinaryIO) -> None:
        self._handle = handle
        self._path = _fd_path(handle)
        self._opened = _size_and_time(handle)

    @abstractmethod
    def read(self, start: int, stop: int, columns: Sequence[str], slab_rows: int = SLAB_ROWS,
             row_bytes: int = 0) -> Iterator[pa.RecordBatch]:
        """Yield batches of `columns` covering rows [start, stop) exactly, in order, each at most `slab_rows`
        (`row_bytes`: what a row of them takes once read, from the schema; 0: not known)."""

    def changed(self) -> bool:
        """Whether the file's size or modification time differs from when it was opened (cut short, or
        rewritten in place)."""
        return _size_and_time(self._handle) != self._opened

    def close(self) -> None:
        """Close the file."""
        self._handle.close()


def _size_and_time(handle: BinaryIO) -> tuple[int, int]:
    status = os.fstat(handle.fileno())
    return status.st_size, status.st_mtime_ns


def _clip(batches: Iterator[pa.RecordBatch], first_row: int, start: int, stop: int,
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


class _ParquetReader(_Reader):
    """Parquet: rows counted from the footer; a range reads the row groups that overlap it, streamed."""

    def __init__(self, handle: BinaryIO) -> None:
        super().__init__(handle)
        self._metadata = pq.ParquetFile(pa.OSFile(self._path)).metadata
        self.schema = self._metadata.schema.to_arrow_schema()
        counts = [self._metadata.row_group(index).num_rows for index in range(self._metadata.num_row_groups)]
        self.rows = int(sum(counts))
        if self._metadata.num_rows != self.rows:  # (the footer's total; the groups' counts are what is read)
            raise BadInput(f"the footer of the Parquet file says {self._metadata.num_rows} rows, but its row groups "
                           f"hold {self.rows}; the file is damaged: write it again with pyarrow")
        self._group_starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])

    def check_sizes(self, row_bytes: Mapping[str, int], row_values: Mapping[str, int]) -> None:
        """Refuse a file whose row groups hold more of a column than `FOOTER_SLACK` times its rows take, plus 1
        MiB uncompressed or 1,024 values: `row_bytes` and `row_values` by column name (a list column's values
        are its leaves). What a reader decodes is then bounded by the rows' values, not by what the file
        claims: a list of millions of zeros compresses to a few bytes but decodes whole. Checked as the footer
        says, then as the columns' page headers say: pyarrow allocates what a page's header claims."""
        leaves = [self._metadata.schema.column(index).path for index in range(self._metadata.num_columns)]
        owners = [_field_of(path, self.schema.names) for path in leaves]
        old_writer = _pads_column_chunks(self._metadata.created_by or "")
        with pa.OSFile(self._path) as file:
            for group in range(self._metadata.num_row_groups):
                meta = self._metadata.row_group(group)
                read = [(owner, meta.column(index)) for index, owner in enumerate(owners) if owner in row_bytes]
                footer = _by_owner((owner, column.total_uncompressed_size, column.num_values) for owner, column in read)
                self._refuse_oversized(group, meta.num_rows, footer, row_bytes, row_values)
                # (the footer's counts, bounded first, bound the pages walked)
                pages = _by_owner((owner, *_page_totals(file, column, group, old_writer)) for owner, column in read)
                self._refuse_oversized(group, meta.num_rows, pages, row_bytes, row_values)

    @staticmethod
    def _refuse_oversized(group: int, rows: int, held: Mapping[str, tuple[int, int]], row_bytes: Mapping[str, int],
                          row_values: Mapping[str, int]) -> None:
        for name, each in row_bytes.items():
            size, values = held.get(name, (0, 0))
            if size > FOOTER_SLACK * each * rows + (1 << 20) or \
                    values > FOOTER_SLACK * row_values.get(name, 1) * rows + 1024:
                raise BadInput(f"row group {group} of the Parquet file holds {size:,} bytes and {values:,} values "
                               f"of column '{name}' for {rows:,} rows, more than their values take "
                               f"({each} bytes, {row_values.get(name, 1)} values a row); write the file again")

    def read(self, start: int, stop: int, columns: Sequence[str], slab_rows: int = SLAB_ROWS,
             row_bytes: int = 0) -> Iterator[pa.RecordBatch]:
        """Stream the row groups overlapping [start, stop) (a file of its own per call: callers run in parallel)."""
        first = int(np.searchsorted(self._group_starts, start, side="right")) - 1
        last = int(np.searchsorted(self._group_starts, stop, side="left"))
        groups = list(range(first, last))
        with pa.OSFile(self._path) as file:
            opened = pq.ParquetFile(file, metadata=self._metadata)
            yield from _clip(self._groups(opened, groups, list(columns), slab_rows, row_bytes),
                             int(self._group_starts[first]), start, stop, slab_rows)

    def _groups(self, opened: pq.ParquetFile, groups: Sequence[int], columns: list[str], slab_rows: int,
                row_bytes: int) -> Iterator[pa.RecordBatch]:
        for group in groups:
            rows = int(self._group_starts[group + 1] - self._group_starts[group])
            if rows <= WHOLE_GROUP_ROWS and rows * row_bytes <= 4 * SLAB_BYTES:
                yield from opened.read_row_group(group, columns=columns, use_threads=False).to_batches()
            else:
                yield from opened.iter_batches(batch_size=slab_rows, row_groups=[group], columns=columns,
                                               use_threads=False)


def _by_owner(leaves: Iterable[tuple[str, int, int]]) -> dict[str, tuple[int, int]]:
    """(field, bytes, values) of leaf columns -> bytes and values summed by field."""
    held: dict[str, tuple[int, int]] = {}
    for owner, size, values in leaves:
        before = held.get(owner, (0, 0))
        held[owner] = (before[0] + size, before[1] + values)
    return held


PAGE_HEADER_BYTES = 16 << 20
"""Most bytes a Parquet page header may take (pyarrow's own limit)."""
_THRIFT_DEPTH = 32
"""Most thrift structs nested in a page header read by `_thrift_struct` (a real one nests 3)."""


def _page_totals(file: pa.NativeFile, column: pq.ColumnChunkMetaData, group: int, old_writer: bool) -> tuple[int, int]:
    """The bytes (headers and uncompressed pages) and values that the pages of a Parquet column chunk say they
    hold: their thrift headers walked as pyarrow reads them, from the first page to the chunk's end. pyarrow
    allocates a page's uncompressed size as its header says, whatever the footer's totals (2 GiB for a
    header's 2**31 - 1). A page past the chunk's end, or a header that cannot be read, is a BadInput."""
    start = column.data_page_offset
    if column.has_dictionary_page and 0 < column.dictionary_page_offset < start:
        start = column.dictionary_page_offset
    end = start + column.total_compressed_size
    # Old parquet-mr left the dictionary page's header out of the total; pyarrow reads 100 bytes more.
    limit = min(end + 100, file.size()) if old_writer else end
    size = values = pages = 0
    at = start
    try:
        if start < 0 or end > file.size():
            raise ValueError(f"its column chunk [{start}, {end}) lies outside the file's {file.size()} bytes")
        while at < end:
            pages += 1
            if pages > column.num_values // 16 + 16:  # (a writer's page holds hundreds of values)
                raise ValueError(f"more than {pages - 1:,} pages for {column.num_values:,} values")
            header, length = _page_header(file, at, limit)
            uncompressed, compressed = header.get(2, 0), header.get(3, 0)
            if not (isinstance(uncompressed, int) and isinstance(compressed, int)) or min(uncompressed, compressed) < 0:
                raise ValueError(f"the page at byte {at} has sizes {uncompressed} and {compressed}")
            if at + length + compressed > limit:
                raise ValueError(f"the page at byte {at} ({compressed:,} bytes) runs past its column chunk's end")
            size += length + uncompressed
            for kind in (5, 8):  # data_page_header, data_page_header_v2: field 1 is their num_values
                page = header.get(kind)
                if isinstance(page, dict) and isinstance(page.get(1), int):
                    values += max(0, page[1])
            at += length + compressed
    except (ValueError, IndexError) as err:
        raise BadInput(f"row group {group} of the Parquet file has a damaged page in column "
                       f"'{column.path_in_schema}' ({err}); write the file again") from err
    return size, values


def _page_header(file: pa.NativeFile, at: int, limit: int) -> tuple[dict[int, object], int]:
    """The thrift PageHeader at byte `at` (its fields by id) and its length; read a few bytes at first, more
    while it runs on, up to `PAGE_HEADER_BYTES` and `limit`."""
    window = 1024
    while True:
        data = file.read_at(min(window, limit - at), at)
        try:
            header, length = _thrift_struct(data, 0, 0)
            if length <= len(data):
                return header, length
        except IndexError:
            pass
        if len(data) >= min(PAGE_HEADER_BYTES, limit - at):
            raise ValueError(f"the page header at byte {at} is longer than {len(data):,} bytes")
        window *= 16


def _thrift_struct(data: bytes, at: int, depth: int) -> tuple[dict[int, object], int]:
    """A thrift struct (compact protocol) at `at`: its integer and struct fields by id (a repeated field: the
    last, as thrift reads it), and where it ends. IndexError when `data` ends first."""
    if depth > _THRIFT_DEPTH:
        raise ValueError("the page header nests too deep")
    fields: dict[int, object] = {}
    field = 0
    while True:
        byte = data[at]
        at += 1
        if byte == 0:
            return fields, at
        kind, delta = byte & 0x0F, byte >> 4
        if delta:
            field += delta
        else:
            raw, at = _varint(data, at)
            field = _unzigzag(raw)
        if kind in (1, 2):  # a bool field holds its value in its type
            fields[field] = int(kind == 1)
        elif kind in (4, 5, 6):
            raw, at = _varint(data, at)
            fields[field] = _unzigzag(raw)
        elif kind == 12:
            fields[field], at = _thrift_struct(data, at, depth + 1)
        else:
            at = _thrift_skip(data, at, kind, depth + 1)


def _thrift_skip(data: bytes, at: int, kind: int, depth: int) -> int:
    """Where a thrift value of `kind` (an element, or a field's value other than a bool) at `at` ends."""
    if depth > _THRIFT_DEPTH:
        raise ValueError("the page header nests too deep")
    width = {1: 1, 2: 1, 3: 1, 7: 8, 13: 16}.get(kind)  # bool (an element), i8, double, uuid
    if width is not None:
        end = at + width
    elif kind in (4, 5, 6):
        end = _varint(data, at)[1]
    elif kind == 8:
        size, at = _varint(data, at)
        end = at + size
    elif kind == 12:
        end = _thrift_struct(data, at, depth)[1]
    elif kind in (9, 10):
        byte, end = data[at], at + 1
        count = byte >> 4
        if count == 15:
            count, end = _varint(data, end)
        for _ in range(count):  # (each element takes a byte at least: a false count runs out of data)
            end = _thrift_skip(data, end, byte & 0x0F, depth + 1)
    elif kind == 11:
        count, end = _varint(data, at)
        if count:
            kinds, end = data[end], end + 1
            for _ in range(count):
                end = _thrift_skip(data, _thrift_skip(data, end, kinds >> 4, depth + 1), kinds & 0x0F, depth + 1)
    else:
        raise ValueError(f"the page header holds a value of unknown thrift type {kind}")
    if end > len(data):
        raise IndexError("the page header runs past the bytes read")
    return end


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
        if shift > 63:
            raise ValueError("a varint of the page header is longer than 10 bytes")


def _unzigzag(value: int) -> int:
    return (value >> 1) ^ -(value & 1)


def _pads_column_chunks(created_by: str) -> bool:
    """Whether pyarrow reads 100 bytes past the column chunks of a file written by `created_by`: parquet-mr
    before 1.2.9 (or a version it cannot read) left the dictionary page's header out of their sizes."""
    found = re.match(r"\s*parquet-mr\s*(?:version\s*(\d+)\.(\d+)\.(\d+))?", created_by, re.IGNORECASE)
    if found is None:
        return False
    return found.group(1) is None or tuple(int(part) for part in found.groups()) < (1, 2, 9)


class _IpcReader(_Reader):
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
        yield from _clip(self._batches(range(first, last), tuple(columns)), int(self._batch_starts[first]),
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


class _CsvStream:
    """One streaming parse of a CSV file, with its own file position: the row it stands at, and the rest
    of the batch it parsed last (`pending`, from that row on)."""

    def __init__(self, path: str, columns: Sequence[str] | None, types: Mapping[str, pa.DataType] | None) -> None:
        self.file, self.row, self.columns = pa.OSFile(path), 0, tuple(columns or ())
        self.pending: pa.RecordBatch | None = None
        convert = pa_csv.ConvertOptions(include_columns=columns, column_types=types)
        try:
            self.reader = pa_csv.open_csv(self.file, convert_options=convert)
        except BaseException:
            self.file.close()
            raise

    def close(self) -> None:
        self.reader.close()
        self.file.close()


class _CsvReader(_Reader):
    """CSV: a header line, then one row per record. Rows are counted by a streaming pass at open; a range
    is reached by parsing the rows before it, or from where the last range's parse stopped when that is at
    or before it (a worker's chunks of one job mostly come in row order).

    The columns' types are those the first block gave (`read_as` widens some), kept for every block. The
    values are parsed as text and converted a slab at a time: a value that is not of its column's type
    fails its own row, named, not every row of the 1 MiB block of the file it was parsed with."""

    def __init__(self, handle: BinaryIO) -> None:
        super().__init__(handle)
        stream = _CsvStream(self._path, None, None)
        try:
            self.schema = stream.reader.schema
        finally:
            stream.close()
        self._types = {field.name: field.type for field in self.schema}
        # (counted as bytes: the first block's type for that column could fail a later block)
        stream = _CsvStream(self._path, [self.schema.names[0]], {self.schema.names[0]: pa.binary()})
        try:
            self.rows = sum(batch.num_rows for batch in stream.reader)
        finally:
            stream.close()
        self._lock = threading.Lock()
        self._kept: _CsvStream | None = None

    def read_as(self, types: Mapping[str, pa.DataType]) -> None:
        """Read these columns as these types (a column of integers that feeds a float input as float64: the
        first block's integers would fail a later block's 0.5)."""
        self._types.update(types)

    def read(self, start: int, stop: int, columns: Sequence[str], slab_rows: int = SLAB_ROWS,
             row_bytes: int = 0) -> Iterator[pa.RecordBatch]:
        """Batches of [start, stop), parsed from the kept stream when it stands at or before `start` (a parse
        takes a block of the file at a time, 1 MiB, whatever its rows)."""
        with self._lock:
            stream, self._kept = self._kept, None
        if stream is None or stream.row > start or stream.columns != tuple(columns):
            if stream is not None:
                stream.close()
            stream = _CsvStream(self._path, columns, {name: pa.string() for name in columns})
        kept = False
        try:
            while stream.row < stop:
                batch, stream.pending = stream.pending, None
                if batch is None:
                    try:
                        batch = stream.reader.read_next_batch()
                    except StopIteration:
                        break
                row = stream.row
                lo, hi = max(start, row), min(stop, row + batch.num_rows)
                if row + batch.num_rows > stop:
                    stream.pending, stream.row = batch.slice(stop - row), stop
                else:
                    stream.row += batch.num_rows
                for first in range(lo, hi, slab_rows):
                    yield self._typed(batch.slice(first - row, min(slab_rows, hi - first)), first)
            with self._lock:  # it stands at `stop`, where the next chunk often starts
                if self._kept is None:
                    self._kept, kept = stream, True
        finally:
            if not kept:
                stream.close()

    def _typed(self, slab: pa.RecordBatch, first_row: int) -> pa.RecordBatch:
        """A slab of text columns (rows from `first_row`) as their types (`_parsed`)."""
        arrays = []
        for name, column in zip(slab.schema.names, slab.columns, strict=True):
            kind = self._types[name]
            arrays.append(column if pa.types.is_string(kind) else _parsed(column, kind, name, first_row))
        return pa.RecordBatch.from_arrays(arrays, names=slab.schema.names)

    def close(self) -> None:
        """Close the kept stream and the file."""
        with self._lock:
            stream, self._kept = self._kept, None
        if stream is not None:
            stream.close()
        super().close()


_CSV_NULLS = pa.array(pa_csv.ConvertOptions().null_values, pa.string())
"""What pyarrow's CSV reader reads as a null in a column that is not text ('', 'NA', 'NaN', 'null' ...)."""


def _parsed(column: pa.Array, kind: pa.DataType, name: str, first_row: int) -> pa.Array:
    """CSV text as `kind`, as pyarrow's CSV reader parses it: trimmed, its null spellings as nulls;
    pa.ArrowInvalid naming the first value that is not of that type. Cast whole at first: text that casts,
    and holds no NaN (a null spelling), needs neither."""
    try:
        parsed = column.cast(kind)
        if not (pa.types.is_floating(kind) and pc.any(pc.is_nan(parsed)).as_py()):
            return parsed
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass
    column = pc.utf8_trim_whitespace(column)
    column = pc.if_else(pc.is_in(column, value_set=_CSV_NULLS), pa.scalar(None, pa.string()), column)
    try:
        return column.cast(kind)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
        at = _first_unparsed(column, kind)
        raise pa.ArrowInvalid(f"row {first_row + at} of column '{name}' holds {column[at].as_py()!r}, which is "
                              f"not {kind}") from err


def _first_unparsed(column: pa.Array, kind: pa.DataType) -> int:
    """The index of the first value of `column` (text, one at least) that does not cast to `kind`: halves
    that cast are skipped (a few casts of the whole, at most)."""
    lo, hi = 0, len(column)
    while hi - lo > 1:
        middle = (lo + hi) // 2
        try:
            column.slice(lo, middle - lo).cast(kind)
            lo = middle
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            hi = middle
    return lo


_READ_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowIndexError, IndexError, OSError)
"""What reading a range of a table may raise: the file's bytes are wrong, or it could not be read."""
_READERS: dict[str, type[_ParquetReader] | type[_IpcReader] | type[_CsvReader]] = {
    "parquet": _ParquetReader, "arrow": _IpcReader, "csv": _CsvReader}


class TableSource(InputSource):
    """A table file read in row ranges: each model input from its columns (`columns`), cast to its dtype.

    `row_ids(start, stop)` gives the id column's values of a range (None without an id column), for the
    outputs and the quarantine listing.
    """

    def __init__(self, path: Path, fmt: str, reader: _Reader, specs: Sequence[InputSpec],
                 columns: Mapping[str, Sequence[str]], id_column: str | None) -> None:
        super().__init__(path, f".{fmt}", [spec.name for spec in specs], reader.rows)
        self._reader, self._specs, self._columns, self.id_column = reader, list(specs), dict(columns), id_column
        self._row_shapes = {spec.name: _row_shape(spec, columns[spec.name], reader.schema, path) for spec in specs}
        needed = [name for spec in specs for name in columns[spec.name]]
        self._needed = list(dict.fromkeys([*needed, *([id_column] if id_column else [])]))
        self.id_type: pa.DataType | None = reader.schema.field(id_column).type if id_column else None
        if self.id_type is not None and pa.types.is_nested(self.id_type):
            raise BadInput(f"id_column '{id_column}' of '{path.name}' is {self.id_type}; an id column holds one "
                           "number or string a row")
        each = _column_bytes(reader.schema, specs, columns, self._row_shapes, id_column)
        if isinstance(reader, _ParquetReader):
            reader.check_sizes(each, {name: math.prod(self._row_shapes[spec.name])
                                      for spec in specs for name in columns[spec.name]
                                      if _is_list(reader.schema.field(name).type)})
        self._row_bytes = max(1, sum(each.values()))
        if isinstance(reader, _IpcReader):
            reader.check_sizes(self._row_bytes)
        if isinstance(reader, _CsvReader):
            reader.read_as({name: pa.float64() for spec in specs if np.issubdtype(spec.dtype, np.floating)
                            for name in columns[spec.name] if pa.types.is_integer(reader.schema.field(name).type)})
        self._ids: OrderedDict[tuple[int, int], pa.Array] = OrderedDict()
        self._lock = threading.Lock()

    def iter_batches(self, start: int, stop: int, max_batch: int) -> Iterator[Batch]:
        """Yield the range's rows in order, read a slab (`SLAB_ROWS`) at a time and cut into mini-batches."""
        self._check_range(start, stop, max_batch)
        ids: list[pa.Array] = []
        row = start
        piece_rows = max_batch * -(-CONVERT_ROWS // max_batch)  # whole mini-batches, at least CONVERT_ROWS
        for slab in self._read(start, stop):
            if self.id_column is not None:
                ids.append(slab.column(self.id_column))
                _refuse_nulls(ids[-1], self.id_column, row, self.path)
            for offset in range(0, slab.num_rows, piece_rows):
                piece = slab.slice(offset, piece_rows)
                feed = {spec.name: self._input(piece, spec, row) for spec in self._specs}
                rows = np.arange(row, row + piece.num_rows, dtype=np.int64)
                for first in range(0, piece.num_rows, max_batch):
                    yield rows[first : first + max_batch], {name: arr[first : first + max_batch]
                                                            for name, arr in feed.items()}
                row += piece.num_rows
        if self.id_column is not None and ids:
            self._keep_ids(start, stop, pa.concat_arrays(ids))

    def slab_rows(self) -> int:
        """Rows read at a time: at most `SLAB_ROWS`, and `SLAB_BYTES` of values."""
        return max(1, min(SLAB_ROWS, SLAB_BYTES // self._row_bytes))

    def _read(self, start: int, stop: int) -> Iterator[pa.RecordBatch]:
        try:
            yield from self._reader.read(start, stop, self._needed, self.slab_rows(), self._row_bytes)
        except _READ_ERRORS as err:
            raise self._read_error(f"rows [{start}, {stop})", err) from err

    def _read_error(self, what: str, err: Exception) -> SitsError:
        """BadInput for a read that failed on the file's bytes (pyarrow's own OSErrors carry no errno: a page
        smaller than its header says, a damaged footer). The error of `file_error` for a failing disk, or for
        a file that changed since it was opened: the retry's check names the change."""
        if isinstance(err, OSError) and err.errno is not None:
            return file_error(self.path, err)
        if self._reader.changed():
            return file_error(self.path, OSError(f"{err}; the file changed since it was opened"))
        return BadInput(f"cannot read {what} of '{self.path.name}' ({err}); fix the file or submit a new one")

    def _input(self, slab: pa.RecordBatch, spec: InputSpec, first_row: int) -> np.ndarray:
        """One input's rows of a slab: its columns cast to the input's dtype, stacked, in the input's row shape."""
        names, rows = self._columns[spec.name], slab.num_rows
        target = pa.from_numpy_dtype(spec.dtype)
        row_shape = self._row_shapes[spec.name]
        if len(names) == 1 and _is_list(slab.schema.field(names[0]).type):
            column = slab.column(names[0])
            _refuse_nulls(column, names[0], first_row, self.path)
            if not pa.types.is_fixed_size_list(column.type):
                _refuse_ragged(column, names[0], math.prod(row_shape), first_row, self.path, spec)
            values = _cast(column.flatten(), target, names[0], first_row, self.path)
            width = len(values) // rows if rows else 0
            if width * rows != len(values) or math.prod(row_shape) != width:
                raise BadInput(f"column '{names[0]}' of '{self.path.name}' holds lists of varying length or not "
                               f"{math.prod(row_shape)} values, near row {first_row}; input '{spec.name}' "
                               f"expects {spec.expected}")
            return np.ascontiguousarray(values.to_numpy(zero_copy_only=False)).reshape(rows, *row_shape)
        cast = []
        for name in names:
            column = slab.column(name)
            _refuse_nulls(column, name, first_row, self.path)
            cast.append(_cast(column, target, name, first_row, self.path))
        try:  # row-major in one pass in C++ (numeric types; a bool input takes the loop below)
            out = pa.RecordBatch.from_arrays(cast, names=list(names)).to_tensor(row_major=True).to_numpy()
        except (pa.ArrowNotImplementedError, pa.ArrowTypeError, pa.ArrowInvalid):
            out = np.empty((rows, len(names)), dtype=spec.dtype)
            for index, column in enumerate(cast):
                out[:, index] = column.to_numpy(zero_copy_only=False)
        return out.reshape(rows, *row_shape)

    def row_ids(self, start: int, stop: int) -> pa.Array | None:
        """The id column's values of rows [start, stop); None without an id column."""
        if self.id_column is None:
            return None
        with self._lock:
            kept = self._ids.get((start, stop))
        if kept is not None:
            return kept
        try:
            parts = [slab.column(self.id_column) for slab in self._reader.read(
                start, stop, [self.id_column], self.slab_rows(), self._row_bytes)]
            return pa.concat_arrays(parts) if parts else pa.array([], self.id_type)
        except _READ_ERRORS as err:
            raise self._read_error(f"the ids of rows [{start}, {stop})", err) from err

    def _keep_ids(self, start: int, stop: int, ids: pa.Array) -> None:
        with self._lock:
            self._ids[(start, stop)] = ids
            while len(self._ids) > _IDS_KEPT:
                self._ids.popitem(last=False)

    def close(self) -> None:
        """Close the reader."""
        self._reader.close()
        with self._lock:
            self._ids.clear()
        super().close()


def _refuse_nulls(column: pa.Array, name: str, first_row: int, path: Path) -> None:
    if column.null_count:
        row = first_row + int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
        raise BadInput(f"column '{name}' of '{path.name}' has a null in row {row}; fill it (a model reads no "
                       "nulls)")


def _field_of(path: str, names: Sequence[str]) -> str:
    """The top-level field a Parquet leaf column's dotted `path` belongs to: the longest of `names` that is the
    path or begins it before a dot (a field's own name may hold dots: `img.data.list.element`)."""
    owners = [name for name in names if path == name or path.startswith(name + ".")]
    return max(owners, key=len) if owners else path


def _refuse_ragged(column: pa.Array, name: str, width: int, first_row: int, path: Path, spec: InputSpec) -> None:
    """A list column's rows must each hold one row's `width` values: counted over all of them, lists of other
    lengths would be cut into rows at the wrong places, each row's outputs filed under another's id."""
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    wrong = np.flatnonzero(lengths != width)
    if wrong.size:
        raise BadInput(f"row {first_row + int(wrong[0])} of column '{name}' of '{path.name}' holds "
                       f"{int(lengths[wrong[0]])} values; input '{spec.name}' expects {spec.expected}, {width} a row")


def _column_bytes(schema: pa.Schema, specs: Sequence[InputSpec], columns: Mapping[str, Sequence[str]],
                  row_shapes: Mapping[str, tuple[int, ...]], id_column: str | None) -> dict[str, int]:
    """The bytes a row of each column read takes once read (variable lists at the width their input takes,
    which every row must have; string ids at `ID_ROW_BYTES`)."""
    each: dict[str, int] = {}
    for spec in specs:
        for name in columns[spec.name]:
            kind = schema.field(name).type
            if _is_list(kind):
                each[name] = math.prod(row_shapes[spec.name]) * _value_bytes(kind.value_type) + 8
            else:
                each[name] = _value_bytes(kind)
    if id_column is not None:
        kind = schema.field(id_column).type
        fixed = kind.bit_width // 8 if _has_bit_width(kind) else 0
        each[id_column] = fixed or ID_ROW_BYTES
    return each


def _has_bit_width(kind: pa.DataType) -> bool:
    try:
        return kind.bit_width > 0
    except ValueError:  # (variable width: strings, binary)
        return False


def _value_bytes(kind: pa.DataType) -> int:
    return max(1, kind.bit_width // 8) if _has_bit_width(kind) else 8


def _cast(column: pa.Array, target: pa.DataType, name: str, first_row: int, path: Path) -> pa.Array:
    if column.type == target:
        return column
    try:
        return column.cast(target, safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
        raise BadInput(f"column '{name}' of '{path.name}' (rows from {first_row}) does not fit {target} "
                       f"({err}); convert that column or fix its values") from err


def _row_shape(spec: InputSpec, names: Sequence[str], schema: pa.Schema, path: Path) -> tuple[int, ...]:
    """The shape each row of input `spec` takes from `names`: one list column's values, or one value per
    column; BadInput when that does not fit the input."""
    kinds = {name: schema.field(name).type for name in names}
    for name, kind in kinds.items():
        inner = kind.value_type if _is_list(kind) else kind
        if not _is_numeric(inner) or (_is_list(kind) and len(names) > 1):
            raise BadInput(
                f"column '{name}' of '{path.name}' is {kind}; input '{spec.name}' reads numeric columns (or one "
                "column of numeric lists): leave it out of `columns`, or convert it")
    if len(names) == 1 and _is_list(kinds[names[0]]):
        kind = kinds[names[0]]
        width = kind.list_size if pa.types.is_fixed_size_list(kind) else None
        if all(type(dim) is int for dim in spec.dims) and spec.dims:
            shape = tuple(int(dim) for dim in spec.dims)
            if width is None or width == math.prod(shape):
                return shape
        elif len(spec.dims) == 1 and width is not None:
            return (width,)
        raise BadInput(f"column '{names[0]}' of '{path.name}' ({kind}) cannot be shaped into input "
                       f"'{spec.name}' {spec.expected}; give it fixed-size lists of one row's values")
    width = len(names)
    if len(spec.dims) == 1 and (spec.dims[0] == width or type(spec.dims[0]) is not int):
        return (width,)
    if spec.dims and all(type(dim) is int for dim in spec.dims) and math.prod(spec.dims) == width:  # type: ignore[arg-type]
        return tuple(int(dim) for dim in spec.dims)
    raise BadInput(f"input '{spec.name}' expects {spec.expected}, but {width} column(s) map onto it "
                   f"({', '.join(names[:8])}{' ...' if width > 8 else ''}); map as many columns as one row's values")


def _column_map(specs: Sequence[InputSpec], schema: pa.Schema, columns: Mapping[str, Sequence[str]] | None,
                id_column: str | None, path: Path) -> dict[str, list[str]]:
    """Input name -> its columns: as given, or every numeric column but `id_column` for a one-input model."""
    names = set(schema.names)
    if id_column is not None and id_column not in names:
        raise BadInput(f"id_column '{id_column}' is not a column of '{path.name}' (columns: {_listed(schema)}); "
                       "name one of them")
    mapped = _mapped_columns(specs, schema, columns, id_column, path)
    for name in dict.fromkeys([*(column for listed in mapped.values() for column in listed),
                               *([id_column] if id_column else [])]):
        if len(schema.get_all_field_indices(name)) > 1:
            raise BadInput(f"'{path.name}' has {len(schema.get_all_field_indices(name))} columns named '{name}'; "
                           "give each column a name of its own")
    return mapped


def _mapped_columns(specs: Sequence[InputSpec], schema: pa.Schema, columns: Mapping[str, Sequence[str]] | None,
                    id_column: str | None, path: Path) -> dict[str, list[str]]:
    names = set(schema.names)
    if columns is None:
        if len(specs) != 1:
            raise BadInput(f"the model has inputs {[spec.name for spec in specs]}; map columns onto each with "
                           "`columns`: {\"<input>\": [\"<column>\", ...]}")
        chosen = list(dict.fromkeys(field.name for field in schema
                                    if field.name != id_column and _is_numeric(field.type)))
        lists = [field.name for field in schema if field.name != id_column and _is_list(field.type)]
        if not chosen and len(lists) == 1:
            chosen = lists
        if not chosen:
            raise BadInput(f"'{path.name}' has no numeric column besides the id column (columns: {_listed(schema)}); "
                           "name the columns to read with `columns`")
        return {specs[0].name: chosen}
    inputs = [spec.name for spec in specs]
    if set(columns) != set(inputs):
        raise BadInput(f"`columns` maps {sorted(columns)}, but the model's inputs are {inputs}; map every input "
                       "(an attention mask may be left out)")
    mapped: dict[str, list[str]] = {}
    for name, listed in columns.items():
        missing = [column for column in listed if column not in names]
        if missing:
            raise BadInput(f"column(s) {missing} for input '{name}' are not in '{path.name}' "
                           f"(columns: {_listed(schema)}); fix `columns`")
        if not listed:
            raise BadInput(f"`columns` maps no column onto input '{name}'; list at least one")
        repeated = sorted({column for column in listed if listed.count(column) > 1})
        if repeated:
            raise BadInput(f"`columns` lists {repeated} more than once for input '{name}'; list each column once")
        mapped[name] = list(listed)
    return mapped


def _listed(schema: pa.Schema) -> str:
    names = schema.names
    return ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")


def open_table(path: Path, handle: BinaryIO, specs: list[InputSpec], fmt: str, *,
               columns: Mapping[str, Sequence[str]] | None = None, id_column: str | None = None) -> TableSource:
    """The reader of the table file `path` (format `fmt`: parquet, arrow or csv), opened as `handle`
    (`inputs.open_input`); its columns are checked against the model's inputs here, its values as rows
    are read. The reader owns the handle and closes it: its readers open the file again through it."""
    try:
        reader = _READERS[fmt](handle)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OSError) as err:
        handle.close()
        if isinstance(err, OSError) and err.errno is not None:  # (the disk's; pyarrow's own carry none)
            raise
        raise BadInput(f"'{path.name}' is not a readable {fmt} file ({err}); write it with pyarrow "
                       f"({_WRITERS[fmt]}), or name its format with input_format") from err
    except BaseException:
        handle.close()
        raise
    try:
        source = TableSource(path, fmt, reader, specs, _column_map(specs, reader.schema, columns, id_column, path),
                             id_column)
    except BaseException:
        reader.close()
        raise
    return source


_WRITERS = {"parquet": "pyarrow.parquet.write_table", "arrow": "pyarrow.feather.write_feather",
            "csv": "pyarrow.csv.write_csv"}


def table_format(suffix: str) -> str | None:
    """The table format of a file suffix ('.parquet' -> 'parquet'), None for another suffix."""
    return TABLE_SUFFIXES.get(suffix.lower())

