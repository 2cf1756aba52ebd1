"""A Parquet column chunk's page headers, walked as pyarrow reads them, and what they say the pages hold.

pyarrow allocates a page's uncompressed size as its header claims, whatever the footer's totals: a forged
header of 2**31 - 1 bytes takes 2 GiB before the page is found damaged. So a job's Parquet file has its page
headers read at open (a small reader of thrift's compact protocol, the headers' encoding) and their totals
bounded as the footer's are (`parquet_reader.ParquetReader.check_sizes`). The walk runs in an API thread at
submit, so its own cost is bounded too: the bytes of a header, the thrift items in it, the pages of a file.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TypeAlias

import pyarrow as pa
import pyarrow.parquet as pq

from broker.errors import BadInput

PAGE_HEADER_BYTES = 16 << 20
"""Most bytes a Parquet page header may take (pyarrow's own limit: it reads no longer one)."""
HEADER_ITEMS = 65_536
"""Most thrift fields and list, set or map elements a page header may hold. A real one holds about 15 and no
list; each costs a Python step here (parquet-cpp allows a million elements a list, in C++)."""
FILE_PAGES = 100_000
"""Most pages of the columns read that a Parquet file may hold, all row groups together: each costs about 5 us
of the API's time at submit. pyarrow's writer closes a page at 1 MiB or 20,000 rows (`data_page_size`,
`max_rows_per_page`), so this covers 2 billion rows of one column, or 20 million rows of 100 columns."""
_THRIFT_DEPTH = 32
"""Most thrift structs nested in a page header (a real one nests 3)."""
_PADDING = 100
"""Bytes pyarrow reads past the column chunks of an old parquet-mr file (`pads_column_chunks`)."""
_DATA_PAGE, _DATA_PAGE_V2 = 0, 3
"""PageHeader.type of the pages whose values pyarrow counts (field 5 or 8 holds their header)."""

_Fields: TypeAlias = "Mapping[int, _Fields | None]"
"""The fields of a thrift struct that are kept: an i32 (None) or a struct of its own kept fields."""
_PAGE_HEADER: _Fields = {1: None, 2: None, 3: None, 5: {1: None}, 8: {1: None}}
"""PageHeader's type, uncompressed and compressed sizes, and the num_values of its data page header (v1: 5,
v2: 8); every other field is skipped."""
_SKIPPED: _Fields = {}
"""What `_ThriftReader.struct` finds for a field it does not keep."""
_WIDTHS = {1: 1, 2: 1, 3: 1, 7: 8, 13: 16}
"""Bytes of a thrift value of fixed width by type: a bool element, an i8, a double, a uuid."""


class PageWalk:
    """The page headers of a Parquet file's column chunks, walked as pyarrow reads them, at most `FILE_PAGES`
    pages in all."""

    def __init__(self, file: pa.NativeFile, old_writer: bool) -> None:
        self._file, self._old_writer = file, old_writer
        self.pages = 0

    def chunk_totals(self, column: pq.ColumnChunkMetaData, group: int, most_bytes: int,
                     most_values: int) -> tuple[int, int]:
        """The bytes (headers and uncompressed pages) and values that the pages of a Parquet column chunk say
        they hold, walked from its first page; the walk stops early once they pass `most_bytes` or
        `most_values`. pyarrow allocates a page's uncompressed size as its header says, whatever the footer's
        totals. A page past the chunk's end, or a header that cannot be read, is a BadInput."""
        start = column.data_page_offset
        if column.has_dictionary_page and 0 < column.dictionary_page_offset < start:
            start = column.dictionary_page_offset
        end = start + column.total_compressed_size
        # pyarrow reads on past `end` while its pages hold fewer values than the footer says (old writers only).
        limit = min(end + _PADDING, self._file.size()) if self._old_writer else end
        size = values = 0
        at = start
        try:
            if start < 0 or end > self._file.size():
                raise ValueError(f"its column chunk [{start}, {end}) lies outside the file's {self._file.size()} bytes")
            while (at < end or (values < column.num_values and at < limit)) and \
                    size <= most_bytes and values <= most_values:
                self.pages += 1
                if self.pages > FILE_PAGES:
                    raise BadInput(f"the Parquet file holds more than {FILE_PAGES:,} pages of the columns read "
                                   f"(row group {group}, column '{column.path_in_schema}'); write it with larger "
                                   "pages (pyarrow.parquet.write_table's data_page_size and max_rows_per_page: "
                                   "1 MiB and 20,000 rows by default), or split it")
                header, length = _page_header(self._file, at, limit)
                uncompressed, compressed, page_values = _page_sizes(header, at)
                if at + length + compressed > limit:
                    raise ValueError(f"the page at byte {at} ({compressed:,} bytes) runs past its column chunk's end")
                size += length + uncompressed
                values += page_values
                at += length + compressed
        except (ValueError, IndexError) as err:
            raise BadInput(f"row group {group} of the Parquet file has a damaged page in column "
                           f"'{column.path_in_schema}' ({err}); write the file again") from err
        return size, values


def _page_sizes(header: Mapping[int, object], at: int) -> tuple[int, int, int]:
    """A page header's uncompressed and compressed sizes, and the values pyarrow counts it as holding (a data
    page's); its required fields checked as thrift and pyarrow check them."""
    kind, uncompressed, compressed = header.get(1), header.get(2), header.get(3)
    if not (isinstance(kind, int) and isinstance(uncompressed, int) and isinstance(compressed, int)):
        raise ValueError(f"the page header at byte {at} lacks its type or sizes")
    if uncompressed < 0 or compressed < 0:
        raise ValueError(f"the page at byte {at} has sizes {uncompressed} and {compressed}")
    values = 0
    for field, page in header.items():
        if isinstance(page, dict):  # (5, 8: a data page header, whose num_values thrift requires)
            if 1 not in page:
                raise ValueError(f"the data page header at byte {at} lacks its count of values")
            if field == (5 if kind == _DATA_PAGE else 8 if kind == _DATA_PAGE_V2 else None):
                values = page[1]
    if values < 0:
        raise ValueError(f"the page at byte {at} holds {values} values")
    return uncompressed, compressed, values


def _page_header(file: pa.NativeFile, at: int, limit: int) -> tuple[dict[int, object], int]:
    """The thrift PageHeader at byte `at` (its kept fields by id) and its length; read a few bytes at first,
    more while it runs on, up to `PAGE_HEADER_BYTES` and `limit`."""
    most = min(PAGE_HEADER_BYTES, limit - at)
    window = 1024
    while True:
        wanted = min(window, most)
        data = file.read_at(wanted, at)
        try:
            return _ThriftReader(data).struct(0, _PAGE_HEADER, 0)
        except IndexError:
            if len(data) >= most or len(data) < wanted:  # (the file ended early: it changed since it was opened)
                raise ValueError(f"the page header at byte {at} is longer than {len(data):,} bytes") from None
        window *= 16


class _ThriftReader:
    """Thrift's compact protocol in `data`, at most `HEADER_ITEMS` fields and elements of it. IndexError when
    `data` ends first; ValueError for bytes no thrift writer writes, or too many items."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._items_left = HEADER_ITEMS

    def struct(self, at: int, kept: _Fields, depth: int) -> tuple[dict[int, object], int]:
        """The struct at `at`: its `kept` fields by id (a repeated field: the last, as thrift reads it), every
        other field skipped, and where it ends."""
        if depth > _THRIFT_DEPTH:
            raise ValueError("the page header nests too deep")
        data = self._data
        fields: dict[int, object] = {}
        field = 0
        while True:
            byte = data[at]
            at += 1
            kind = byte & 0x0F
            if kind == 0:  # (thrift ends a struct at any byte of type 0)
                return fields, at
            self._items_left -= 1
            if self._items_left < 0:
                self._spend(0)
            if byte >> 4:
                field += byte >> 4
                if field > 0x7FFF:
                    field = _int16(field)
            else:
                raw, at = self._varint(at)
                field = _int16(_unzigzag(raw & 0xFFFFFFFF))
            inner = kept.get(field, _SKIPPED)
            if inner is _SKIPPED or kind != (5 if inner is None else 12):  # (thrift skips a field of another type)
                if kind > 2:  # (a bool field holds its value in its type)
                    at = self._skip(at, kind, depth + 1)
            elif inner is None:
                raw, at = self._varint(at)
                if raw >> 32:
                    raise ValueError(f"field {field} of the page header does not fit 32 bits")
                fields[field] = _unzigzag(raw)
            else:
                fields[field], at = self.struct(at, inner, depth + 1)

    def _skip(self, at: int, kind: int, depth: int) -> int:
        """Where a value of `kind` (an element, or a field's value other than a bool) at `at` ends."""
        if depth > _THRIFT_DEPTH:
            raise ValueError("the page header nests too deep")
        data = self._data
        if kind in (4, 5, 6):
            end = self._varint(at)[1]
        elif kind in _WIDTHS:
            end = at + _WIDTHS[kind]
        elif kind == 8:
            size, at = self._varint(at)
            end = at + size
        elif kind == 12:
            end = self.struct(at, {}, depth)[1]
        elif kind in (9, 10):
            byte, end = data[at], at + 1
            count = byte >> 4
            if count == 15:
                count, end = self._varint(end)
            self._spend(count)
            for _ in range(count):
                end = self._skip(end, byte & 0x0F, depth + 1)
        elif kind == 11:
            count, end = self._varint(at)
            if count:
                self._spend(2 * count)
                kinds, end = data[end], end + 1
                for _ in range(count):
                    end = self._skip(self._skip(end, kinds >> 4, depth + 1), kinds & 0x0F, depth + 1)
        else:
            raise ValueError(f"the page header holds a value of unknown thrift type {kind}")
        if end > len(data):
            raise IndexError("the page header runs past the bytes read")
        return end

    def _spend(self, items: int) -> None:
        self._items_left -= items
        if self._items_left < 0:
            raise ValueError(f"the page header holds more than {HEADER_ITEMS:,} fields and elements")

    def _varint(self, at: int) -> tuple[int, int]:
        data = self._data
        byte = data[at]
        if byte < 0x80:  # (most are one byte)
            return byte, at + 1
        value, shift = byte & 0x7F, 7
        while True:
            at += 1
            byte = data[at]
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value, at + 1
            shift += 7
            if shift > 63:
                raise ValueError("a varint of the page header is longer than 10 bytes")


def _unzigzag(value: int) -> int:
    return (value >> 1) ^ -(value & 1)


def _int16(value: int) -> int:
    """`value` as thrift holds a field id: an int16, wrapping (32,767 + 1 is -32,768)."""
    return ((value + 0x8000) & 0xFFFF) - 0x8000


def pads_column_chunks(created_by: str) -> bool:
    """Whether pyarrow reads 100 bytes past the column chunks of a file written by `created_by`: parquet-mr
    before 1.2.9 (or a version it cannot read) left the dictionary page's header out of their sizes."""
    found = re.match(r"\s*parquet-mr\s*(?:version\s*(\d+)\.(\d+)\.(\d+))?", created_by, re.IGNORECASE)
    if found is None:
        return False
    return found.group(1) is None or tuple(int(part) for part in found.groups()) < (1, 2, 9)
