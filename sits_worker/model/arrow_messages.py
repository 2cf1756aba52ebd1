"""An Arrow IPC file's footer and messages, read as flatbuffers without reading any batch's buffers: each record
batch's rows, where it lies, and what its buffers take once decompressed.

pyarrow allocates what a message claims (a body, a decompressed buffer) before it checks it, so a reader of a
tenant's file learns these sizes first (`arrow_reader.IpcReader`), from the footer's blocks and each message's
metadata, and refuses what would not fit.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple

import pyarrow as pa

from broker.errors import BadInput

_DICTIONARY_BATCH, RECORD_BATCH = 2, 3
"""Message.header_type of a dictionary and of a record batch (Arrow's Message.fbs)."""
_DICTIONARY_BUFFERS = 65_536
"""Most buffers the dictionaries of a file may hold (a string dictionary holds 3): each is read to size it."""



class Block(NamedTuple):
    """A record batch of an Arrow IPC file: where its message lies, and its rows (from its metadata)."""

    offset: int
    metadata_bytes: int
    body_bytes: int
    rows: int


def record_batches(file: pa.NativeFile, batches: int, dictionary_bytes: int) -> list[Block]:
    """The record batches of an Arrow IPC file, from its footer's blocks and each batch's message metadata
    (flatbuffers, Arrow's File.fbs and Message.fbs): pyarrow reads a batch's buffers to count its rows, a wide
    column's hundreds of MiB at submit. pa.ArrowInvalid when they are damaged; a count that differs from what
    pyarrow reads fails that batch's read (`IpcReader._batches`). Its dictionaries are bounded here: pyarrow
    reads every one of them with the first batch a reader reads, whatever the columns."""
    size = file.size()
    tail = file.read_at(10, size - 10) if size >= 10 else b""
    footer_bytes = int.from_bytes(tail[:4], "little", signed=True)
    if tail[4:] != b"ARROW1" or not 0 < footer_bytes <= size - 10:
        raise pa.ArrowInvalid("the Arrow file's footer is damaged")
    footer = _FlatTable.root(file.read_at(footer_bytes, size - 10 - footer_bytes))
    dictionaries = [footer.struct_at(2, index, "<qi4xq") for index in range(footer.length(2))]  # Footer.dictionaries
    blocks = [footer.struct_at(3, index, "<qi4xq") for index in range(footer.length(3))]  # Footer.recordBatches
    if len(blocks) != batches or sum(length + body for _, length, body in dictionaries + blocks) > size:
        raise pa.ArrowInvalid("the blocks of the Arrow file's footer are damaged")  # (real ones never overlap)
    held = buffers = 0
    for index, (offset, length, body) in enumerate(dictionaries):
        data = message_header(file, offset, length, body, _DICTIONARY_BATCH, f"dictionary {index}").table(1)
        if data is None:  # (DictionaryBatch.data)
            raise pa.ArrowInvalid(f"dictionary {index} of the Arrow file holds no values")
        buffers += data.length(2)
        if buffers > _DICTIONARY_BUFFERS:
            raise pa.ArrowInvalid(f"the Arrow file's dictionaries hold over {_DICTIONARY_BUFFERS:,} buffers")
        held += _buffers_bytes(file, offset + length, data, range(data.length(2)))
    if held > dictionary_bytes:
        raise BadInput(f"the dictionaries of the Arrow file take {held:,} bytes, more than {dictionary_bytes:,}; "
                       "pyarrow reads them whole with every batch: write it without dictionary-encoded columns")
    found = []
    for index, (offset, length, body) in enumerate(blocks):
        rows = message_header(file, offset, length, body, RECORD_BATCH, f"record batch {index}").scalar(0, "<q")
        if rows < 0:  # (RecordBatch.length)
            raise pa.ArrowInvalid(f"record batch {index} of the Arrow file holds {rows} rows")
        found.append(Block(offset, length, body, rows))
    return found


def message_header(file: pa.NativeFile, offset: int, length: int, body: int, kind: int, name: str) -> _FlatTable:
    """The header (a table of Message.fbs) of the IPC message of `kind` at `offset`: its metadata of `length`
    bytes (a continuation marker, its length, the flatbuffer; before Arrow 0.15, no marker), then a body of
    `body` bytes, as the footer says."""
    if offset < 0 or length < 8 or body < 0 or offset + length + body > file.size():
        raise pa.ArrowInvalid(f"{name} of the Arrow file lies outside it")
    metadata = file.read_at(length, offset)
    message = _FlatTable.root(metadata[8:] if metadata[:4] == b"\xff\xff\xff\xff" else metadata[4:])
    if message.scalar(3, "<q") != body:  # (pyarrow allocates the body its message claims, then checks it)
        raise pa.ArrowInvalid(f"the body of {name} of the Arrow file is not as its footer says")
    header = message.table(2) if message.scalar(1, "<B") == kind else None  # Message.header_type, header
    if header is None:
        raise pa.ArrowInvalid(f"the metadata of {name} of the Arrow file is damaged")
    return header


def fields_bytes(file: pa.NativeFile, body: int, batch: _FlatTable, schema: pa.Schema,
                  fields: Sequence[int]) -> int | None:
    """The bytes of `fields` of a record batch (its RecordBatch table `batch`, its body at byte `body`) once
    decompressed (`_buffers_bytes`); None when a field up to the last of `fields` has a layout not followed
    here."""
    starts = [0]
    for kind in schema.types[: max(fields, default=-1) + 1]:
        count = _buffer_count(kind)
        if count is None:
            return None
        starts.append(starts[-1] + count)
    return sum(_buffers_bytes(file, body, batch, range(starts[field], starts[field + 1])) for field in fields)


def _buffers_bytes(file: pa.NativeFile, body: int, batch: _FlatTable, buffers: range) -> int:
    """The bytes of `buffers` (their indexes) of a record batch, once decompressed: their lengths, or, in a
    compressed batch, each one's first 8 bytes (its length decompressed; -1: not compressed)."""
    compressed = batch.table(3) is not None  # RecordBatch.compression
    held = 0
    for buffer in buffers:
        offset, length = batch.struct_at(2, buffer, "<qq")  # RecordBatch.buffers
        if offset < 0 or length < 0:
            raise pa.ArrowInvalid("a buffer of the Arrow file lies outside its batch")
        if compressed and length >= 8:
            prefix = int.from_bytes(file.read_at(8, body + offset), "little", signed=True)
            length = length - 8 if prefix == -1 else prefix
        held += max(0, length)
    return held


def _buffer_count(kind: pa.DataType) -> int | None:
    """The buffers an IPC record batch holds for a column of `kind`, its children's included (Arrow's columnar
    format); None for a layout not followed here (unions, views, run-end encoding)."""
    if isinstance(kind, pa.ExtensionType):
        return _buffer_count(kind.storage_type)
    if pa.types.is_null(kind):
        return 0
    if pa.types.is_dictionary(kind):
        return 2  # (its indices: a dictionary comes in a batch of its own)
    if pa.types.is_binary(kind) or pa.types.is_string(kind) or pa.types.is_large_binary(kind) or \
            pa.types.is_large_string(kind):
        return 3  # validity, offsets, data
    children: list[pa.DataType]
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        own, children = 2, [kind.value_type]
    elif pa.types.is_map(kind):
        own, children = 3, [kind.key_type, kind.item_type]  # (validity, offsets; its entries' validity)
    elif pa.types.is_fixed_size_list(kind):
        own, children = 1, [kind.value_type]
    elif pa.types.is_struct(kind):
        own, children = 1, [kind.field(index).type for index in range(kind.num_fields)]
    elif pa.types.is_nested(kind) or pa.types.is_binary_view(kind) or pa.types.is_string_view(kind):
        return None
    else:
        return 2  # validity, values: any fixed width
    counts = [_buffer_count(child) for child in children]
    return None if any(count is None for count in counts) else own + sum(count for count in counts if count)


class _FlatTable:
    """A flatbuffers table in `data` at `at`: its fields read by slot, every offset checked against `data`
    (pa.ArrowInvalid past its end)."""

    def __init__(self, data: bytes, at: int) -> None:
        self._data, self._at = data, at
        self._vtable = at - _unpack(data, at, "<i")
        self._vtable_bytes = _unpack(data, self._vtable, "<H")

    @classmethod
    def root(cls, data: bytes) -> _FlatTable:
        return cls(data, _unpack(data, 0, "<I"))

    def scalar(self, slot: int, kind: str) -> int:
        """Field `slot`, a scalar of struct format `kind`; 0 when absent (flatbuffers' default)."""
        at = self._field(slot)
        return _unpack(self._data, at, kind) if at else 0

    def table(self, slot: int) -> _FlatTable | None:
        at = self._field(slot)
        return _FlatTable(self._data, at + _unpack(self._data, at, "<I")) if at else None

    def length(self, slot: int) -> int:
        """How many elements vector field `slot` holds (0 when absent)."""
        at = self._field(slot)
        return _unpack(self._data, at + _unpack(self._data, at, "<I"), "<I") if at else 0

    def struct_at(self, slot: int, index: int, kind: str) -> tuple[int, ...]:
        """Element `index` of vector field `slot`, structs of format `kind`."""
        if not 0 <= index < self.length(slot):
            raise pa.ArrowInvalid(f"the Arrow file's metadata lacks element {index} of a list")
        at = self._field(slot)
        at += _unpack(self._data, at, "<I") + 4 + index * struct.calcsize(kind)
        if at + struct.calcsize(kind) > len(self._data):
            raise pa.ArrowInvalid("the Arrow file's metadata points past its end")
        return struct.unpack_from(kind, self._data, at)

    def _field(self, slot: int) -> int:
        """Where field `slot` lies in `data`; 0 when it is absent."""
        entry = 4 + 2 * slot
        if entry + 2 > self._vtable_bytes:
            return 0
        offset = _unpack(self._data, self._vtable + entry, "<H")
        return self._at + offset if offset else 0


def _unpack(data: bytes, at: int, kind: str) -> int:
    if at < 0 or at + struct.calcsize(kind) > len(data):
        raise pa.ArrowInvalid("the Arrow file's metadata points past its end")
    value: int = struct.unpack_from(kind, data, at)[0]
    return value
