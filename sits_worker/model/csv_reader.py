"""CSV files read in row ranges: a streaming parse from the start of the file (it has no index), kept from one
range to the next, and values parsed from text a slab at a time, so that a value of another type fails its own
row."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import BinaryIO

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv

from sits_worker.model.table_readers import SLAB_ROWS, TableReader


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


class CsvReader(TableReader):
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
