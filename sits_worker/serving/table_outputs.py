"""A Parquet job's outputs: one Arrow IPC part per chunk, merged in row order into `outputs.parquet`.

A job with `output_format: parquet` writes, for each chunk, `.parts/<job id>/outputs.<chunk:06d>.arrow`:
the chunk's ids (the input's `id_column`, or `row`: the row numbers) and one column per output, a vector
output as a fixed-size list (its row shape in the field's metadata). The part is written as `.npy` parts
are (`outputs.write_part_files`: atomically, its quarantined rows first), and the same rows give the same
bytes, so a chunk run twice rewrites an identical part. Arrow IPC costs no encoding on the commit thread;
the merge encodes Parquet once, part by part through one `ParquetWriter`, so it holds one part at a time.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as pa_ipc
import pyarrow.parquet as pq

from broker.errors import FileMissing, SitsError
from broker.jobs.output_layout import TABLE_OUTPUT_NAME, TABLE_ROW_COLUMN, table_part_name
from sits_worker.model.safe_files import Folder
from sits_worker.serving.outputs import Layout, Merged, _open_job_parts, _open_output_dir, _temp_name, write_part_files

GROUP_ROWS = 65_536
"""Rows per row group of `outputs.parquet`: a reader of a few rows decodes no more than this."""
_HASH_BLOCK_BYTES = 16 * 2**20


def id_column_name(input_options: Mapping[str, Any] | None) -> str:
    """The id column of a Parquet job's outputs: its input's `id_column`, else `TABLE_ROW_COLUMN`."""
    return str((input_options or {}).get("id_column") or TABLE_ROW_COLUMN)


def table_part(outputs: Mapping[str, np.ndarray], start: int, ids: pa.Array | None, id_column: str) -> pa.Table:
    """One chunk's outputs as a table: the id column, then one column per output in order."""
    rows = len(next(iter(outputs.values()))) if outputs else 0
    fields, columns = [pa.field(id_column, ids.type if ids is not None else pa.int64())], []
    columns.append(ids if ids is not None else pa.array(np.arange(start, start + rows, dtype=np.int64)))
    for name, values in outputs.items():
        values = np.ascontiguousarray(values)
        flat = pa.array(values.reshape(-1))
        row_shape = list(values.shape[1:])
        column = flat if not row_shape else pa.FixedSizeListArray.from_arrays(flat, math.prod(row_shape))
        fields.append(pa.field(name, column.type, metadata={"shape": json.dumps(row_shape)}))
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=pa.schema(fields))


def write_table_part(output_dir: Path, chunk_index: int, outputs: Mapping[str, np.ndarray], *, start: int,
                     ids: pa.Array | None, id_column: str, job_id: str,
                     quarantined: Sequence[tuple[int, str]] = (),
                     quarantine_ids: Mapping[int, Any] | None = None) -> None:
    """Write a chunk's part (`table_part`) and its quarantined rows, atomically and durably."""
    table = table_part(outputs, start, ids, id_column)

    def write(handle: IO[bytes]) -> None:
        with pa_ipc.new_file(handle, table.schema) as writer:
            writer.write_table(table)

    write_part_files(output_dir, chunk_index, {table_part_name(chunk_index): write}, job_id=job_id,
                     quarantined=quarantined, quarantine_ids=quarantine_ids)


def _read_part(parts: Folder, chunk_index: int, chunk: tuple[int, int], *, merging: bool = False) -> pa.Table:
    """A chunk's part, read (never mapped), checked to hold the chunk's rows (`merging`: its first rows, as
    `outputs._load_part` takes them). A part lies in the tenant's folder: one cut short under a mapping would
    kill the worker (SIGBUS) at the first page read past its new end, where a short read is an error."""
    name = table_part_name(chunk_index)
    try:
        handle = parts.read_file(name)
    except FileNotFoundError as err:
        raise FileMissing(f"output part '{name}' of chunk {chunk_index} (rows [{chunk[0]}, {chunk[1]})) is missing; "
                          "run that chunk again before finalizing") from err
    with handle:
        try:
            with pa.OSFile(f"/proc/self/fd/{handle.fileno()}") as file:  # (the file opened, not the path)
                table = pa_ipc.open_file(file).read_all()
            table.validate(full=True)  # (a part is a file in the tenant's own folder: its batches are checked
            # against their buffers before a value is read, as an Arrow input's are)
        except (pa.ArrowInvalid, OSError) as err:
            raise SitsError(f"output part '{parts.path / name}' is unreadable ({err}); delete it and run chunk "
                            f"{chunk_index} again") from err
    if merging and table.num_rows > chunk[1] - chunk[0]:  # (written before its chunk was split: its rows first)
        table = table.slice(0, chunk[1] - chunk[0])
    if table.num_rows != chunk[1] - chunk[0]:
        raise SitsError(f"output part '{parts.path / name}' has {table.num_rows} rows but chunk {chunk_index} covers "
                        f"rows [{chunk[0]}, {chunk[1]}); delete it and run the chunk again")
    return table


def table_chunk_written(output_dir: Path, chunk_index: int, chunk: tuple[int, int], *, job_id: str) -> bool:
    """Whether chunk `chunk_index`'s part is on disk, whole (`outputs.chunk_written` for a Parquet job)."""
    try:
        with _open_output_dir(Path(output_dir)) as out, _open_job_parts(out, job_id) as opened:
            _read_part(opened.folder, chunk_index, chunk)
    except (SitsError, OSError):
        return False
    return True


def merge_table_parts(parts: Folder, output_names: Sequence[str], layout: Layout,
                      total: int, keep_alive: Callable[[], None], merged: Merged) -> None:
    """The `outputs.Merge` of a Parquet job: every part, in row order, appended to one temp file that becomes
    `outputs.parquet`; each output's manifest entry names its column, row shape, dtype and the file's checksum."""
    temp = _temp_name(TABLE_OUTPUT_NAME)
    schema: pa.Schema | None = None
    try:
        with parts.create_new(temp) as handle:
            writer: pq.ParquetWriter | None = None
            try:
                for index, chunk in layout:
                    table = _read_part(parts, index, chunk, merging=True)
                    if schema is None:
                        schema = table.schema
                        writer = pq.ParquetWriter(handle, schema, use_dictionary=False)
                    elif not table.schema.equals(schema, check_metadata=True):
                        raise SitsError(f"output part of chunk {index} has columns {table.schema} unlike chunk "
                                        f"{layout[0][0]}'s "
                                        f"{schema}; delete it and run the chunk again")
                    assert writer is not None
                    writer.write_table(table, row_group_size=GROUP_ROWS)
                    keep_alive()
            finally:
                if writer is not None:
                    writer.close()
            handle.flush()
            os.fsync(handle.fileno())
        checksum = _checksum(parts, temp, keep_alive)
    except BaseException:
        parts.unlink(temp)
        raise
    assert schema is not None
    for name in output_names:
        field = schema.field(name)
        value_type = field.type.value_type if pa.types.is_fixed_size_list(field.type) else field.type
        row_shape = json.loads((field.metadata or {}).get(b"shape", b"[]"))
        merged[name] = (temp, {"file": TABLE_OUTPUT_NAME, "column": name, "shape": [total, *row_shape],
                               "dtype": np.dtype(value_type.to_pandas_dtype()).name, "checksum": checksum})


def _checksum(parts: Folder, name: str, keep_alive: Callable[[], None]) -> str:
    """"sha256:<hex>" of a file in `parts`, read back in blocks (from the page cache: it was just written)."""
    digest = hashlib.sha256()
    with parts.read_file(name) as handle:
        while block := handle.read(_HASH_BLOCK_BYTES):
            digest.update(block)
            keep_alive()
    return f"sha256:{digest.hexdigest()}"


def quarantine_ids(ids: pa.Array | None, quarantined: Sequence[tuple[int, str]], start: int) -> dict[int, Any] | None:
    """Job row -> its id, for each quarantined row of a chunk starting at row `start` (None without ids)."""
    if ids is None or not quarantined:
        return None
    return {row: ids[row - start].as_py() for row, _ in quarantined}
