"""Parquet files read in row ranges: rows counted from the footer, a range read from the row groups that overlap
it, and, at open, each column's sizes checked against what its rows' values take, as the footer and as the
page headers say (`parquet_pages.py`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from broker.errors import BadInput
from sits_worker.model.parquet_pages import PageWalk, pads_column_chunks
from sits_worker.model.table_readers import SLAB_BYTES, SLAB_ROWS, TableReader, clip

WHOLE_GROUP_ROWS = 4 * SLAB_ROWS
"""A Parquet row group of at most this many rows, and four slabs' bytes, is read whole (twice as fast as
streaming it in slabs)."""
FOOTER_SLACK = 4
"""How many times the bytes its rows' values take a Parquet column chunk may hold uncompressed (levels,
page headers, ids longer than `table_source.ID_ROW_BYTES`), plus 1 MiB; one holding more is refused at open."""

class ParquetReader(TableReader):
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
        says, then as the columns' page headers say, chunk by chunk (pyarrow allocates what a page's header
        claims); a walk stops at the first page past the bound, and at `parquet_pages.FILE_PAGES` pages."""
        leaves = [self._metadata.schema.column(index).path for index in range(self._metadata.num_columns)]
        owners = [_field_of(path, self.schema.names) for path in leaves]
        with pa.OSFile(self._path) as file:
            walk = PageWalk(file, pads_column_chunks(self._metadata.created_by or ""))
            for group in range(self._metadata.num_row_groups):
                meta = self._metadata.row_group(group)
                read = [(owner, meta.column(index)) for index, owner in enumerate(owners) if owner in row_bytes]
                footer = _by_owner((owner, column.total_uncompressed_size, column.num_values) for owner, column in read)
                self._refuse_oversized(group, meta.num_rows, footer, row_bytes, row_values)
                pages: dict[str, tuple[int, int]] = {}
                for owner, column in read:  # (the footer's counts, bounded first, bound the pages walked)
                    most_bytes, most_values = _most_held(meta.num_rows, row_bytes[owner], row_values.get(owner, 1))
                    held_bytes, held_values = pages.get(owner, (0, 0))
                    size, values = walk.chunk_totals(column, group, most_bytes - held_bytes, most_values - held_values)
                    pages[owner] = (held_bytes + size, held_values + values)
                    self._refuse_oversized(group, meta.num_rows, pages, row_bytes, row_values)

    @staticmethod
    def _refuse_oversized(group: int, rows: int, held: Mapping[str, tuple[int, int]], row_bytes: Mapping[str, int],
                          row_values: Mapping[str, int]) -> None:
        for name, each in row_bytes.items():
            size, values = held.get(name, (0, 0))
            most_bytes, most_values = _most_held(rows, each, row_values.get(name, 1))
            if size > most_bytes or values > most_values:
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
            yield from clip(self._groups(opened, groups, list(columns), slab_rows, row_bytes),
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


def _most_held(rows: int, row_bytes: int, row_values: int) -> tuple[int, int]:
    """The most bytes (uncompressed) and values a row group of `rows` may hold of a column whose rows take
    `row_bytes` and `row_values`."""
    return FOOTER_SLACK * row_bytes * rows + (1 << 20), FOOTER_SLACK * row_values * rows + 1024


def _by_owner(leaves: Iterable[tuple[str, int, int]]) -> dict[str, tuple[int, int]]:
    """(field, bytes, values) of leaf columns -> bytes and values summed by field."""
    held: dict[str, tuple[int, int]] = {}
    for owner, size, values in leaves:
        before = held.get(owner, (0, 0))
        held[owner] = (before[0] + size, before[1] + values)
    return held


def _field_of(path: str, names: Sequence[str]) -> str:
    """The top-level field a Parquet leaf column's dotted `path` belongs to: the longest of `names` that is the
    path or begins it before a dot (a field's own name may hold dots: `img.data.list.element`)."""
    owners = [name for name in names if path == name or path.startswith(name + ".")]
    return max(owners, key=len) if owners else path
