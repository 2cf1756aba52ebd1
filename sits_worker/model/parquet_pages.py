"""A Parquet column chunk's page headers, walked as pyarrow reads them, and what they say the pages hold.

pyarrow allocates a page's uncompressed size as its header claims, whatever the footer's totals: a forged
header of 2**31 - 1 bytes takes 2 GiB before the page is found damaged. So a job's Parquet file has its page
headers read at open (a small reader of thrift's compact protocol, the headers' encoding) and their totals
bounded as the footer's are (`parquet_reader.ParquetReader.check_sizes`).
"""

from __future__ import annotations

import re

import pyarrow as pa
import pyarrow.parquet as pq

from broker.errors import BadInput

PAGE_HEADER_BYTES = 16 << 20
"""Most bytes a Parquet page header may take (pyarrow's own limit)."""
_THRIFT_DEPTH = 32
"""Most thrift structs nested in a page header read by `_thrift_struct` (a real one nests 3)."""


def page_totals(file: pa.NativeFile, column: pq.ColumnChunkMetaData, group: int, old_writer: bool) -> tuple[int, int]:
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


def pads_column_chunks(created_by: str) -> bool:
    """Whether pyarrow reads 100 bytes past the column chunks of a file written by `created_by`: parquet-mr
    before 1.2.9 (or a version it cannot read) left the dictionary page's header out of their sizes."""
    found = re.match(r"\s*parquet-mr\s*(?:version\s*(\d+)\.(\d+)\.(\d+))?", created_by, re.IGNORECASE)
    if found is None:
        return False
    return found.group(1) is None or tuple(int(part) for part in found.groups()) < (1, 2, 9)
