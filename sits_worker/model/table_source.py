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
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from broker.errors import BadInput, SitsError
from sits_worker.model.arrow_reader import IpcReader
from sits_worker.model.csv_reader import CsvReader
from sits_worker.model.parquet_reader import ParquetReader
from sits_worker.model.source import Batch, InputSource, file_error
from sits_worker.model.table_readers import SLAB_BYTES, SLAB_ROWS, TableReader, is_list, is_numeric
from sits_worker.model.tensors import InputSpec

TABLE_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow", ".csv": "csv"}
"""File suffix -> table format; a job's `input_format` names the format of a file with another suffix."""
ID_ROW_BYTES = 64
"""The bytes a row of a string or binary id column is counted as when slabs are sized; a Parquet row group
whose ids take more than `parquet_reader.FOOTER_SLACK` times this on average is refused."""
CONVERT_ROWS = 8_192
"""Rows turned from columns into row-major arrays at a time: small enough to stay in cache (1.4x faster
than 64K rows at a time for 64 float32 columns)."""
_IDS_KEPT = 16
"""Id columns of the last ranges read, kept for `row_ids` (the chunk's commit asks right after its read)."""

_READ_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowIndexError, pa.ArrowKeyError, pa.ArrowMemoryError,
                IndexError, OSError)
"""What reading a range of a table may raise: the file's bytes are wrong (a forged compressed buffer's length
asks for more memory than there is), or it could not be read."""
_READERS: dict[str, type[ParquetReader] | type[IpcReader] | type[CsvReader]] = {
    "parquet": ParquetReader, "arrow": IpcReader, "csv": CsvReader}


class TableSource(InputSource):
    """A table file read in row ranges: each model input from its columns (`columns`), cast to its dtype.

    `row_ids(start, stop)` gives the id column's values of a range (None without an id column), for the
    outputs and the quarantine listing.
    """

    def __init__(self, path: Path, fmt: str, reader: TableReader, specs: Sequence[InputSpec],
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
        if isinstance(reader, ParquetReader):
            reader.check_sizes(each, {name: math.prod(self._row_shapes[spec.name])
                                      for spec in specs for name in columns[spec.name]
                                      if is_list(reader.schema.field(name).type)})
        self._row_bytes = max(1, sum(each.values()))
        if isinstance(reader, IpcReader):
            reader.check_sizes(self._row_bytes)
        if isinstance(reader, CsvReader):
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
        if len(names) == 1 and is_list(slab.schema.field(names[0]).type):
            column = slab.column(names[0])
            _refuse_nulls(column, names[0], first_row, self.path)
            if not pa.types.is_fixed_size_list(column.type):
                _refuse_ragged(column, names[0], math.prod(row_shape), first_row, self.path, spec)
            flat = column.flatten()
            if flat.null_count:  # (a null inside a row's list: fed as NaN otherwise)
                nulls = flat.is_null().to_numpy(zero_copy_only=False)
                at = int(np.flatnonzero(nulls)[0]) // max(1, math.prod(row_shape))
                raise BadInput(f"column '{names[0]}' of '{self.path.name}' has a null in the list of row "
                               f"{first_row + at}; fill it (a model reads no nulls)")
            values = _cast(flat, target, names[0], first_row, self.path, math.prod(row_shape))
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
            if is_list(kind):
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


def _cast(column: pa.Array, target: pa.DataType, name: str, first_row: int, path: Path,
          row_values: int = 1) -> pa.Array:
    """`column` as `target`, changing no value (pyarrow's safe cast); BadInput naming the column otherwise. A safe
    cast lets a finite float become infinite (1e300 to float32), so that is checked here. `column` holds
    `row_values` values a row (a list column's, flattened: every row holds as many)."""
    if column.type == target:
        return column
    try:
        cast = column.cast(target, safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
        raise BadInput(f"column '{name}' of '{path.name}' (rows from {first_row}) does not fit {target} "
                       f"({err}); convert that column or fix its values") from err
    if pa.types.is_floating(column.type) and pa.types.is_floating(target) and (
            pc.sum(pc.is_inf(cast)).as_py() or 0) > (pc.sum(pc.is_inf(column)).as_py() or 0):
        at = int(pc.index(pc.and_(pc.is_inf(cast), pc.invert(pc.is_inf(column))), True).as_py())
        raise BadInput(f"row {first_row + at // row_values} of column '{name}' of '{path.name}' holds "
                       f"{column[at].as_py()!r}, beyond what {target} holds; scale that column or fix its values")
    return cast


def _row_shape(spec: InputSpec, names: Sequence[str], schema: pa.Schema, path: Path) -> tuple[int, ...]:
    """The shape each row of input `spec` takes from `names`: one list column's values, or one value per
    column; BadInput when that does not fit the input."""
    kinds = {name: schema.field(name).type for name in names}
    for name, kind in kinds.items():
        inner = kind.value_type if is_list(kind) else kind
        if not is_numeric(inner) or (is_list(kind) and len(names) > 1):
            raise BadInput(
                f"column '{name}' of '{path.name}' is {kind}; input '{spec.name}' reads numeric columns (or one "
                "column of numeric lists): leave it out of `columns`, or convert it")
    if len(names) == 1 and is_list(kinds[names[0]]):
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
                                    if field.name != id_column and is_numeric(field.type)))
        lists = [field.name for field in schema if field.name != id_column and is_list(field.type)]
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
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, pa.ArrowKeyError, pa.ArrowMemoryError,
            UnicodeDecodeError, OSError) as err:
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
    except UnicodeDecodeError as err:  # (a column name of bytes that are no text)
        reader.close()
        raise BadInput(f"'{path.name}' names a column in bytes that are not UTF-8 ({err}); name its columns in "
                       "text") from err
    except BaseException:
        reader.close()
        raise
    return source


_WRITERS = {"parquet": "pyarrow.parquet.write_table", "arrow": "pyarrow.feather.write_feather",
            "csv": "pyarrow.csv.write_csv"}


def table_format(suffix: str) -> str | None:
    """The table format of a file suffix ('.parquet' -> 'parquet'), None for another suffix."""
    return TABLE_SUFFIXES.get(suffix.lower())
