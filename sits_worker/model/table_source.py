"""Reading a table as a job's input: Parquet, Arrow IPC or CSV through pyarrow, in row ranges.

Named columns map onto the model's inputs (`columns`: input -> column names, stacked in that order into
each row), or every numeric column but the id column goes into the model's one input. A chunk reads only
its own rows, a slab of at most `SLAB_ROWS` rows and `SLAB_BYTES` at a time, so a file larger than memory
runs in bounded memory: Parquet reads only the row groups that overlap the range (from its footer's row
counts), Arrow IPC maps the file (its batches checked against their buffers at open) and slices its
batches, CSV streams from the start of the file (it has no index: seeking costs a parse of the rows before
the range, so a reader kept from the last range goes on where it stopped). Values are cast to the model's
dtype with pyarrow's safe cast: a value that would change (1.5 to an integer, 2**24 + 1 to float32) or a
null is a BadInput naming the column and the row.

The file is read through the handle `inputs.open_input` opened without following a link, re-opened through
`/proc/self/fd` so that every reader has its own file position (Linux).
"""

from __future__ import annotations

import math
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.ipc as pa_ipc
import pyarrow.parquet as pq

from broker.errors import BadInput
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

    @abstractmethod
    def read(self, start: int, stop: int, columns: Sequence[str], slab_rows: int = SLAB_ROWS,
             row_bytes: int = 0) -> Iterator[pa.RecordBatch]:
        """Yield batches of `columns` covering rows [start, stop) exactly, in order, each at most `slab_rows`
        (`row_bytes`: what a row of them takes once read, from the schema; 0: not known)."""

    def close(self) -> None:
        """Close the file."""
        self._handle.close()


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
        claims: a list of millions of zeros compresses to a few bytes but decodes whole."""
        leaves = [self._metadata.schema.column(index).path for index in range(self._metadata.num_columns)]
        owners = [_field_of(path, self.schema.names) for path in leaves]
        for group in range(self._metadata.num_row_groups):
            meta = self._metadata.row_group(group)
            held: dict[str, list[int]] = {}
            for index, owner in enumerate(owners):
                column = meta.column(index)
                counts = held.setdefault(owner, [0, 0])
                counts[0] += column.total_uncompressed_size
                counts[1] += column.num_values
            for name, each in row_bytes.items():
                size, values = held.get(name, [0, 0])
                if size > FOOTER_SLACK * each * meta.num_rows + (1 << 20) or \
                        values > FOOTER_SLACK * row_values.get(name, 1) * meta.num_rows + 1024:
                    raise BadInput(f"row group {group} of the Parquet file holds {size:,} bytes and {values:,} values "
                                   f"of column '{name}' for {meta.num_rows:,} rows, more than their values take "
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


class _IpcReader(_Reader):
    """Arrow IPC (the file format; Feather v2): the file is mapped, its record batches sliced without a copy."""

    def __init__(self, handle: BinaryIO) -> None:
        super().__init__(handle)
        self._reader = pa_ipc.open_file(pa.memory_map(self._path))
        self.schema = self._reader.schema
        counts = []
        for index in range(self._reader.num_record_batches):
            batch = self._reader.get_batch(index)
            # pyarrow reads a mapped batch as its message says, unchecked: a length past its buffers would read
            # the memory beyond them (or crash the worker). Checked whole here, before any value is read.
            batch.validate(full=True)
            counts.append(batch.num_rows)
        self.rows = int(sum(counts))
        self._batch_starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])

    def read(self, start: int, stop: int, columns: Sequence[str], slab_rows: int = SLAB_ROWS,
             row_bytes: int = 0) -> Iterator[pa.RecordBatch]:
        """The record batches overlapping [start, stop), sliced."""
        first = int(np.searchsorted(self._batch_starts, start, side="right")) - 1
        last = int(np.searchsorted(self._batch_starts, stop, side="left"))
        batches = (self._reader.get_batch(index).select(list(columns)) for index in range(first, last))
        yield from _clip(batches, int(self._batch_starts[first]), start, stop, slab_rows)

    def close(self) -> None:
        """Drop the mapping (batches already handed out keep it alive) and close the file."""
        self._reader = None  # type: ignore[assignment]
        super().close()


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
    or before it (a worker's chunks of one job mostly come in row order)."""

    def __init__(self, handle: BinaryIO) -> None:
        super().__init__(handle)
        stream = _CsvStream(self._path, None, None)
        try:
            self.schema = stream.reader.schema
        finally:
            stream.close()
        # The types the first block gave, kept for every block (a later block alone may look otherwise).
        self._types = {field.name: field.type for field in self.schema}
        stream = _CsvStream(self._path, [self.schema.names[0]], None)
        try:
            self.rows = sum(batch.num_rows for batch in stream.reader)
        finally:
            stream.close()
        self._lock = threading.Lock()
        self._kept: _CsvStream | None = None

    def read(self, start: int, stop: int, columns: Sequence[str], slab_rows: int = SLAB_ROWS,
             row_bytes: int = 0) -> Iterator[pa.RecordBatch]:
        """Batches of [start, stop), parsed from the kept stream when it stands at or before `start` (a parse
        takes a block of the file at a time, 1 MiB, whatever its rows)."""
        with self._lock:
            stream, self._kept = self._kept, None
        if stream is None or stream.row > start or stream.columns != tuple(columns):
            if stream is not None:
                stream.close()
            stream = _CsvStream(self._path, columns, {name: self._types[name] for name in columns})
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
                    yield batch.slice(first - row, min(slab_rows, hi - first))
            with self._lock:  # it stands at `stop`, where the next chunk often starts
                if self._kept is None:
                    self._kept, kept = stream, True
        finally:
            if not kept:
                stream.close()

    def close(self) -> None:
        """Close the kept stream and the file."""
        with self._lock:
            stream, self._kept = self._kept, None
        if stream is not None:
            stream.close()
        super().close()


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
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowIndexError, IndexError) as err:
            raise BadInput(f"cannot read rows [{start}, {stop}) of '{self.path.name}' ({err}); fix the file or "
                           "submit a new one") from err
        except OSError as err:
            raise file_error(self.path, err) from err

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
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowIndexError, IndexError) as err:
            raise BadInput(f"cannot read the ids of rows [{start}, {stop}) of '{self.path.name}' ({err}); fix the "
                           "file or submit a new one") from err

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
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as err:
        handle.close()
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

