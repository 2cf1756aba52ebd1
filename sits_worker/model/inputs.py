"""Open a job's input file and read it in row ranges as ready-to-feed batches.

The API opens an input once to check it against the model signature and count its rows; workers
open it again and read only their chunk's rows [start, stop). Array formats (.npy, .bin and
uncompressed .npz members) read a chunk's rows as one byte range, never memory-mapped: a mapped file
cut short while a job runs kills the worker (SIGBUS) at the first page read past its new end, where a
short read is an error to retry. .jsonl keeps a byte-offset index of its lines. Values are never cast
silently: an array whose dtype is not the model's is rejected with a message saying how to convert it
(byte order alone is not a cast).
The file is opened once, without following a symbolic link (`safe_files.open_file`), and every reader
reads through that handle; a worker also checks that it is the file the job was submitted with
(`source.check_unchanged` on its `os.fstat`), so a path swapped after submit leads nowhere else.
The .jsonl reader is in `jsonl_source.py`, what every reader is in `source.py`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import threading
import zipfile
import zlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from broker.errors import BadInput
from sits_worker.model.jsonl_source import open_jsonl
from sits_worker.model.padding import MaskSpec, TokenLimits, check_mask
from sits_worker.model.safe_files import open_file
from sits_worker.model.source import INPUT_FIX, Batch, InputSource, check_unchanged, file_error
from sits_worker.model.table_readers import size_and_time
from sits_worker.model.table_source import TABLE_SUFFIXES, open_table
from sits_worker.model.tensors import InputSpec, NpyHeader, convert_hint, parse_signature, read_npy_header

SUPPORTED_FORMATS = (".npy", ".npz", ".bin", ".jsonl", *TABLE_SUFFIXES)
INPUT_FORMATS = ("npy", "npz", "bin", "jsonl", "parquet", "arrow", "csv")
"""What a job's `input_format` may name: the file is read so whatever its suffix."""
_BLOCK_BYTES = 1 << 20
_READ_BYTES = 16 << 20
"""Most bytes of an array file read at a time (whole mini-batches, at least one): a 4,096-row chunk of 64
float32 values is one 1 MiB read, and a chunk of images never takes more than this, or a mini-batch, at once."""
_DEFLATE_MAX_RATIO = 1032
"""zlib's bound: one byte of a deflate stream never stands for more than 1032 bytes of output."""


def file_checksum(path: Path) -> str:
    """Return "sha256:<hex>" of a file's bytes, read in 1 MiB blocks.

    Recorded in job manifests so results are tied to the exact bytes they came from; streaming
    keeps memory flat whatever the file size.
    """
    digest = hashlib.sha256()
    try:
        with open_file(Path(path), what="input", fix=INPUT_FIX) as handle:
            while block := handle.read(_BLOCK_BYTES):
                digest.update(block)
    except OSError as err:
        raise file_error(Path(path), err) from err
    return f"sha256:{digest.hexdigest()}"


class _ArraySource(InputSource):
    """npy, npz and bin inputs: one array per input, read as contiguous row slices."""

    def __init__(
        self,
        path: Path,
        specs: list[InputSpec],
        arrays: dict[str, StoredArray | _LazyMember],
        handle: BinaryIO,
        archive: zipfile.ZipFile | None = None,
    ) -> None:
        rows = {name: arr.shape[0] for name, arr in arrays.items()}
        if len(set(rows.values())) > 1:
            raise BadInput(f"arrays in '{path.name}' have different row counts {rows}; all need the same")
        super().__init__(path, path.suffix.lower(), [spec.name for spec in specs], max(rows.values()))
        self._dtypes = {spec.name: spec.dtype for spec in specs}
        self._arrays: dict[str, StoredArray | _LazyMember | np.ndarray] = dict(arrays)
        self._handle, self._archive = handle, archive
        self._opened = size_and_time(handle)
        self._row_bytes = max(1, sum(self._dtypes[name].itemsize * math.prod(arr.shape[1:])
                                     for name, arr in arrays.items()))
        self._lock = threading.Lock()

    def reads_rows_cheaply(self) -> bool:
        """False while a compressed npz member is still to be loaded whole."""
        return not any(isinstance(held, _LazyMember) for held in self._arrays.values())

    def _array(self, name: str) -> StoredArray | np.ndarray:
        held = self._arrays[name]
        if isinstance(held, _LazyMember):
            try:
                held = self._arrays[name] = held.load()  # kept: a compressed member is read whole
            except OSError as err:
                raise file_error(self.path, err) from err
            except (ValueError, EOFError, zipfile.BadZipFile, zlib.error) as err:
                if size_and_time(self._handle) != self._opened:  # (cut short or rewritten since: its retry says so)
                    raise file_error(self.path, OSError(f"array '{name}' could not be read ({err}); the file changed "
                                                        "since it was opened")) from err
                raise BadInput(f"array '{name}' in '{self.path.name}' is corrupt ({err}); write it again") from err
        return held

    def iter_batches(self, start: int, stop: int, max_batch: int) -> Iterator[Batch]:
        """Yield contiguous slices of at most `max_batch` rows, read-only views of one read of whole mini-batches.

        The rows are read with `os.preadv` into a fresh buffer, up to `_READ_BYTES` at a time, so a file cut
        short after open is an error, not a SIGBUS. The copy out of the page cache costs about 25 ms a
        million 64-float rows, lost in the noise of the zoo MLP's 1.1 s over them. An array already of the
        model's dtype and C order goes as it was read; other byte orders and layouts are converted once a read.
        """
        self._check_range(start, stop, max_batch)
        arrays = [(name, self._array(name), self._dtypes[name]) for name in self.input_names]
        rows = np.arange(start, stop, dtype=np.int64)
        piece_rows = max(max_batch, _READ_BYTES // self._row_bytes // max_batch * max_batch)
        with self._reading() as fd:
            for lo in range(start, stop, piece_rows):
                hi = min(lo + piece_rows, stop)
                piece = {name: self._piece(fd, name, held, dtype, lo, hi) for name, held, dtype in arrays}
                for first in range(lo, hi, max_batch):
                    last = min(first + max_batch, hi)
                    yield rows[first - start : last - start], {name: arr[first - lo : last - lo]
                                                               for name, arr in piece.items()}

    @contextmanager
    def _reading(self) -> Iterator[int]:
        """A descriptor of the opened file of the reader's own: closing the source while a chunk reads (the
        worker keeps a few inputs open) neither fails that read nor lets it read a file opened since under the
        same descriptor number."""
        with self._lock:
            if self._closed:
                raise ValueError(f"'{self.path.name}' is closed")
            fd = os.dup(self._handle.fileno())
        try:
            yield fd
        finally:
            os.close(fd)

    def _piece(self, fd: int, name: str, held: StoredArray | np.ndarray, dtype: np.dtype,
               lo: int, hi: int) -> np.ndarray:
        """Rows [lo, hi) of one input, read-only, of the model's dtype, C order and aligned."""
        if isinstance(held, np.ndarray):
            return np.require(held[lo:hi], dtype=dtype, requirements=["C_CONTIGUOUS", "ALIGNED"])
        try:
            rows = held.read(fd, lo, hi)
        except ShortRead as err:  # (its size was checked at open: it was cut short since)
            now = os.fstat(fd).st_size
            raise file_error(self.path, OSError(f"rows [{lo}, {hi}) of array '{name}' end past the file's {now:,} "
                                                "bytes; the file changed since it was opened")) from err
        except OSError as err:
            raise file_error(self.path, err) from err
        piece = np.require(rows, dtype=dtype, requirements=["C_CONTIGUOUS", "ALIGNED"])
        piece.flags.writeable = False
        return piece

    def close(self) -> None:
        """Close the npz archive and the file; batches already yielded stay valid (they own their rows)."""
        with self._lock:
            self._arrays = {}
            if self._archive is not None:
                self._archive.close()
            self._handle.close()
            super().close()


class ShortRead(Exception):
    """A read of an array's rows ended early: the file is shorter than when it was opened."""


@dataclass(frozen=True)
class StoredArray:
    """An array's data in the opened file: where it starts, its dtype, shape and layout. Read by rows, never
    mapped (the file's size was checked at open to hold all of it)."""

    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]
    fortran_order: bool = False

    def read(self, fd: int, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop), read from `fd` into a new array: one read in C order; one per value of a row in
        Fortran order (each value's rows lie together there). `ShortRead` if the file ends first."""
        row_shape, itemsize = self.shape[1:], self.dtype.itemsize
        row_items = math.prod(row_shape)
        if not self.fortran_order or row_items == 1:
            rows = np.empty((stop - start, *row_shape), self.dtype)
            read_into(fd, rows, self.offset + start * row_items * itemsize)
            return rows
        runs = np.empty((row_items, stop - start), self.dtype)
        for value, run in enumerate(runs):
            read_into(fd, run, self.offset + (value * self.shape[0] + start) * itemsize)
        return runs.reshape(*reversed(row_shape), stop - start).T


def read_into(fd: int, array: np.ndarray, offset: int) -> None:
    """Fill the C-contiguous `array` with the bytes of `fd` from `offset` (a read may return fewer)."""
    buffer, done = array.reshape(-1).view(np.uint8).data, 0
    while done < len(buffer):
        count = os.preadv(fd, [buffer[done:]], offset + done)
        if count == 0:
            raise ShortRead(f"{len(buffer) - done:,} of {len(buffer):,} bytes from byte {offset:,} missing")
        done += count


def _single_input(specs: list[InputSpec], path: Path) -> InputSpec:
    if len(specs) != 1:
        raise BadInput(
            f"'{path.name}' holds one array but the model has inputs {[spec.name for spec in specs]}; "
            "use .npz with one array per input, keyed by input name"
        )
    return specs[0]


def _open_npy(path: Path, handle: BinaryIO, specs: list[InputSpec]) -> InputSource:
    spec = _single_input(specs, path)
    if handle.read(6) != b"\x93NUMPY":  # np.load would take anything else for a pickle or an npz
        raise BadInput(f"'{path.name}' is not an .npy file (no NPY header); write it with np.save")
    handle.seek(0)
    header = read_npy_header(handle, os.fstat(handle.fileno()).st_size, f"'{path.name}'", "write it with np.save")
    spec.check(header.dtype, header.shape, f"in '{path.name}'", convert_hint(spec, "np.save(path, "))
    return _ArraySource(path, specs, {spec.name: _stored(header, header.data_offset)}, handle)


def _stored(header: NpyHeader, offset: int) -> StoredArray:
    return StoredArray(offset, header.dtype, header.shape, header.fortran_order)


def _open_npz(path: Path, handle: BinaryIO, specs: list[InputSpec]) -> InputSource:
    try:
        archive = zipfile.ZipFile(handle)  # (closing it leaves `handle` open: the source closes both)
    except (zipfile.BadZipFile, ValueError, EOFError) as err:
        raise BadInput(f"'{path.name}' is not an .npz archive ({err}); write it with np.savez") from err
    try:
        members = {info.filename.removesuffix(".npy"): info for info in archive.infolist()}
        expected = [spec.name for spec in specs]
        if set(members) != set(expected):
            raise BadInput(
                f"'{path.name}' holds arrays {sorted(members)}, but the model needs one array per input, "
                f"named {expected}; save it with np.savez(path, {', '.join(n + '=...' for n in expected)})"
            )
        size = os.fstat(handle.fileno()).st_size
        arrays = {spec.name: _npz_member(path, handle, size, archive, members[spec.name], spec) for spec in specs}
        return _ArraySource(path, specs, arrays, handle, archive)
    except BaseException:
        archive.close()
        raise


def _npz_member(
    path: Path, handle: BinaryIO, size: int, archive: zipfile.ZipFile, info: zipfile.ZipInfo, spec: InputSpec
) -> StoredArray | _LazyMember:
    """Check a member's npy header; read the member's rows in place when stored uncompressed, else defer
    reading it.

    The header alone gives dtype and shape, so checking (what the API does) never reads the data;
    the header is checked against the member's size in the zip directory, so it cannot claim more
    rows than the member holds.
    """
    what, fix = f"array '{spec.name}' in '{path.name}'", "write it again with np.savez"
    try:
        with archive.open(info) as member:
            header = read_npy_header(member, _member_size(size, info, what, fix), what, fix)
        spec.check(header.dtype, header.shape, f"in '{path.name}'", convert_hint(spec, f"np.savez(path, {spec.name}="))
        if info.compress_type != zipfile.ZIP_STORED or math.prod(header.shape) == 0:
            return _LazyMember(archive, info, header.shape)
        # the data starts after the member's local zip header (pread: the archive's reads keep their place)
        name_len, extra_len = struct.unpack("<HH", os.pread(handle.fileno(), 4, info.header_offset + 26))
        stored = _stored(header, info.header_offset + 30 + name_len + extra_len + header.data_offset)
        if stored.offset + math.prod(header.shape) * header.dtype.itemsize > size:
            raise ValueError(f"its data run past the end of the {size:,}-byte file")
        return stored
    except (ValueError, EOFError, RuntimeError, NotImplementedError, zipfile.BadZipFile, struct.error) as err:
        raise BadInput(f"array '{spec.name}' in '{path.name}' is unreadable ({err}); write it again") from err


def _member_size(archive_size: int, info: zipfile.ZipInfo, what: str, fix: str) -> int:
    """The most bytes an npz member can really hold, told from the zip directory without decompressing.

    The directory's uncompressed size is as easy to forge as the npy header, so it is capped by what
    the compressed bytes (no more than the archive holds) can expand to. np.savez stores members,
    np.savez_compressed deflates them; bzip2 and lzma can expand without a useful bound.
    """
    compressed = min(info.compress_size, archive_size)
    if info.compress_type == zipfile.ZIP_STORED:
        return min(info.file_size, compressed)
    if info.compress_type == zipfile.ZIP_DEFLATED:
        return min(info.file_size, compressed * _DEFLATE_MAX_RATIO)
    raise BadInput(f"{what} is compressed with zip method {info.compress_type}; {fix} or np.savez_compressed")


@dataclass(frozen=True)
class _LazyMember:
    """A compressed npz member: its shape from the header now, its data when first read."""

    archive: zipfile.ZipFile
    info: zipfile.ZipInfo
    shape: tuple[int, ...]

    def load(self) -> np.ndarray:
        """Decompress the member (read-only, as every batch is); its header was checked at open."""
        with self.archive.open(self.info) as member:
            header = read_npy_header(member, self.info.file_size, f"npz member '{self.info.filename}'",
                                     "write it again with np.savez")
            count = math.prod(header.shape)
            data = np.frombuffer(member.read(count * header.dtype.itemsize), dtype=header.dtype, count=count)
        return data.reshape(header.shape, order="F" if header.fortran_order else "C")


def _open_bin(path: Path, handle: BinaryIO, specs: list[InputSpec], shape: Sequence[int] | None,
              dtype: str | None) -> InputSource:
    spec = _single_input(specs, path)
    try:
        given_dtype = spec.dtype if dtype is None else np.dtype(dtype)
        row_shape = None if shape is None else tuple(int(dim) for dim in shape)
    except (TypeError, ValueError) as err:
        raise BadInput(f"bad shape {shape!r} or dtype {dtype!r} for '{path.name}' ({err}); fix them") from err
    if given_dtype != spec.dtype:
        raise BadInput(
            f"input '{spec.name}' expects {spec.dtype.name}, but dtype {dtype!r} was given for "
            f"'{path.name}'; convert the file to {spec.dtype.name} (no silent casts)"
        )
    if row_shape is None:
        if not all(type(dim) is int for dim in spec.dims):
            raise BadInput(
                f"input '{spec.name}' has dynamic dims {spec.expected}; pass the per-row shape (without "
                f"the batch dim) for raw '{path.name}', or use .npy"
            )
        row_shape = tuple(int(dim) for dim in spec.dims)
    spec.check(spec.dtype, ("N", *row_shape), f"(shape given for '{path.name}')")
    row_bytes, size = spec.dtype.itemsize * math.prod(row_shape), os.fstat(handle.fileno()).st_size
    if size % row_bytes:
        raise BadInput(
            f"'{path.name}' is {size} bytes, not a multiple of one {spec.dtype.name} row of shape "
            f"{list(row_shape)} ({row_bytes} bytes); check shape and dtype, or that the file is complete"
        )
    rows = size // row_bytes
    if rows == 0:
        raise BadInput(f"input file '{path.name}' has no rows; submit a file with at least one row")
    stored = StoredArray(0, spec.dtype.newbyteorder("<"), (rows, *row_shape))
    return _ArraySource(path, specs, {spec.name: stored}, handle)


def open_input(
    path: Path,
    signature: Mapping[str, Any],
    *,
    shape: Sequence[int] | None = None,
    dtype: str | None = None,
    mask: MaskSpec | None = None,
    limits: TokenLimits | None = None,
    identity: dict[str, int] | None = None,
    input_format: str | None = None,
    columns: Mapping[str, Sequence[str]] | None = None,
    id_column: str | None = None,
) -> InputSource:
    """Open an input file, check it against the model signature and return its reader.

    The reader is chosen by suffix (.npy, .npz, .bin, .jsonl, and the tables of `table_source.py`:
    .parquet, .arrow, .feather, .ipc, .csv), or by `input_format` (one of `INPUT_FORMATS`) whatever the
    suffix. `shape` (per row, without the batch dim) and `dtype` apply to raw .bin files only; `columns`
    (input -> column names) and `id_column` to tables only. Nothing is loaded whole except compressed npz
    members, which are read on first use and kept. For a model that declares an attention mask
    (`mask`, from `padding.mask_spec`) the file may leave the mask out (.npy and .bin always do):
    its batches then get an all-ones mask.

    The file is opened once, not through a symbolic link (PathNotAllowed), and read through that
    handle only. With `identity` (the job's `file_identity` at submit) the file opened must be that
    one (`check_unchanged` on its `os.fstat`), or BadInput: a path swapped between a worker's check and
    its open leads to no other file.
    """
    path = Path(path)
    specs = parse_signature(signature)
    suffix = path.suffix.lower() if input_format is None else f".{input_format}"
    if input_format is not None and input_format not in INPUT_FORMATS:
        raise BadInput(f"input_format '{input_format}' is unknown; use one of {', '.join(INPUT_FORMATS)}")
    if suffix not in SUPPORTED_FORMATS:
        raise BadInput(
            f"input file '{path.name}' has unsupported format '{suffix or '(no suffix)'}'; "
            f"use one of {', '.join(SUPPORTED_FORMATS)}, or name its format with input_format"
        )
    if (shape is not None or dtype is not None) and suffix != ".bin":
        raise BadInput(f"shape and dtype apply only to raw .bin input, not '{path.name}'; leave them out")
    table = TABLE_SUFFIXES.get(suffix)
    if (columns is not None or id_column is not None) and table is None:
        raise BadInput(f"columns and id_column apply only to tables (Parquet, Arrow IPC, CSV), not '{path.name}'; "
                       "leave them out")
    try:
        handle = open_file(path, what="input", fix=INPUT_FIX)
    except OSError as err:
        raise file_error(path, err) from err
    try:
        if identity is not None:
            check_unchanged(path, identity, opened=os.fstat(handle.fileno()))
        mask_input = next((spec for spec in specs if mask is not None and spec.name == mask.mask_input), None)
        filled: tuple[MaskSpec, np.dtype] | None = None
        if mask is not None and mask_input is not None and not (
                mask.mask_input in (columns or {}) if table else _holds_input(handle, suffix, mask.mask_input)):
            filled, specs = (mask, mask_input.dtype), [spec for spec in specs if spec is not mask_input]
        if suffix == ".npy":
            source = _open_npy(path, handle, specs)
        elif suffix == ".npz":
            source = _open_npz(path, handle, specs)
        elif suffix == ".bin":
            source = _open_bin(path, handle, specs, shape, dtype)
        elif table is not None:
            source = open_table(path, handle, specs, table, columns=columns, id_column=id_column)
        else:
            source = open_jsonl(path, handle, specs)
    except OSError as err:
        handle.close()
        raise file_error(path, err) from err
    except BaseException:
        handle.close()
        raise
    if mask is None and limits is None:
        return source
    return _TokensChecked(source, mask, filled[1] if filled else None, limits)


def _holds_input(handle: BinaryIO, suffix: str, name: str) -> bool:
    """Whether an .npz (the opened `handle`) holds an array `name`, or a .jsonl's first row a key `name`.

    A peek only: anything unreadable answers False and the real reader reports it. The handle is
    rewound for the reader.
    """
    try:
        if suffix == ".npz":
            with zipfile.ZipFile(handle) as archive:  # (closing it leaves `handle` open)
                return f"{name}.npy" in archive.namelist() or name in archive.namelist()
        if suffix == ".jsonl":
            line = next((line for line in handle if line.strip()), b"")
            record = json.loads(line) if line else None
            return isinstance(record, dict) and name in record
    except (OSError, ValueError, RecursionError, zipfile.BadZipFile):
        return False
    finally:
        handle.seek(0)
    return False


class _TokensChecked(InputSource):
    """A token model's source: every batch is checked as a request is at submit (`padding.check_mask`:
    a mask of 0 and 1 the shape of the tokens; `TokenLimits`: no negative token id or one past the
    vocabulary, no sequence longer than the model declares), so a bad row fails its job with a clear
    error rather than running wrong (a negative id reads the embedding table from its end). A file
    without the mask (`fill_dtype` set) gets an all-ones mask: rows of one batch have the same length
    (array files are rectangular, jsonl batches group rows by shape), so no token is padding.
    """

    def __init__(self, inner: InputSource, mask: MaskSpec | None, fill_dtype: np.dtype | None,
                 limits: TokenLimits | None) -> None:
        names = inner.input_names if mask is None or fill_dtype is None else (*inner.input_names, mask.mask_input)
        super().__init__(inner.path, inner.format, names, inner.rows)
        self._inner, self._mask, self._fill_dtype, self._limits = inner, mask, fill_dtype, limits

    def iter_batches(self, start: int, stop: int, max_batch: int) -> Iterator[Batch]:
        """The inner source's batches, checked, with an all-ones mask where the file has none."""
        for row_indices, feed in self._inner.iter_batches(start, stop, max_batch):
            try:
                if self._mask is not None:
                    if self._fill_dtype is not None:
                        tokens = feed[self._mask.sequence_input]
                        feed[self._mask.mask_input] = np.ones(tokens.shape, dtype=self._fill_dtype)
                    check_mask(feed, self._mask)
                if self._limits is not None:
                    self._limits.check(feed)
            except BadInput as err:
                raise BadInput(f"rows {int(row_indices[0])}-{int(row_indices[-1])} of '{self.path.name}': "
                               f"{err.message}") from err
            yield row_indices, feed

    def reads_rows_cheaply(self) -> bool:
        """As the inner source."""
        return self._inner.reads_rows_cheaply()

    def row_ids(self, start: int, stop: int) -> Any:
        """As the inner source."""
        return self._inner.row_ids(start, stop)

    def close(self) -> None:
        """Close the inner source."""
        self._inner.close()
        super().close()
