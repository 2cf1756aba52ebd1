"""Model input specs and the tensors of online requests, checked against a model's signature.

Shared by the offline file readers (`inputs.py`) and the API's request path: the same
rules everywhere — exact dtype for typed data (no silent casts), lossless conversion for JSON
numbers, fixed dims must match and dynamic ones may be any length >= 1.
"""

from __future__ import annotations

import base64
import io
import json
import math
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

from broker.errors import BadInput, InvalidModel
from sits_worker.model.padding import MaskSpec, check_mask

# Which kinds of JSON values (dtype.kind of np.asarray(value)) may fill an input of a given kind
# without losing information; anything else (floats into ints, strings, nulls) is rejected.
_JSON_KINDS = {"b": "b", "i": "iu", "u": "iu", "f": "iuf", "c": "iufc"}


@dataclass(frozen=True)
class InputSpec:
    """One model input: name, dtype and per-row dims (an int when fixed, a label when dynamic).

    `fixed_rows` is the first axis when the model declares it a number: a model that fixes it runs
    that many rows at a time (`runtime.run_session`), so even a config tensor such as a Loop's trip
    count `steps[1]` is cut along axis 0 like any batched input and must come once per row.
    """

    name: str
    dtype: np.dtype
    dims: tuple[int | str, ...]
    fixed_rows: int | None = None

    @classmethod
    def from_entry(cls, entry: dict[str, Any]) -> InputSpec:
        name, shape, dynamic = str(entry["name"]), list(entry["shape"]), {0, *entry.get("dynamic_axes", [0])}
        try:
            dtype = np.dtype(entry["dtype"])
        except TypeError:
            dtype = np.dtype(object)
        if dtype.kind not in _JSON_KINDS:
            raise BadInput(f"model input '{name}' has dtype {entry['dtype']!r}; only numeric inputs can be read")
        if not shape:
            raise InvalidModel(f"model input '{name}' has no batch axis (shape []); re-export the model")
        dims = tuple(
            dim if type(dim) is int and dim > 0 and axis not in dynamic else dim if isinstance(dim, str) else "?"
            for axis, dim in enumerate(shape)
            if axis > 0
        )
        first = shape[0]
        return cls(name, dtype, dims, first if type(first) is int and first > 0 else None)

    @property
    def expected(self) -> str:
        return f"{self.dtype.name} [{','.join(['N', *map(str, self.dims)])}]"

    def check(self, dtype: np.dtype | None, shape: Sequence[int | str], where: str, hint: str | None = None, *,
              shape_hint: str | None = None) -> None:
        """Raise BadInput naming the input, what it expects and what it got, unless both fit.

        `dtype` None means JSON values, which have no dtype of their own (they are converted
        losslessly or refused before this). `shape` includes the batch axis ("N" when the row count
        is not known). Fixed dims must match, dynamic ones may be any size, 0 included (a cache that
        is empty on a first step). The dtype is compared only when `hint` (how to fix a wrong dtype)
        is given; `shape_hint` is added to what a wrong shape is told.
        """
        dtype_ok = hint is None or dtype is None or dtype.newbyteorder("=") == self.dtype
        row_dims = [int(dim) for dim in shape[1:]]
        itemsize = (dtype or self.dtype).itemsize
        check_buildable(f"input '{self.name}'", [dim for dim in shape if not isinstance(dim, str)], itemsize)
        if dtype_ok and len(shape) >= 1 and len(row_dims) == len(self.dims):
            pairs = zip(row_dims, self.dims, strict=True)
            if all(got == want if type(want) is int else got >= 0 for got, want in pairs):
                return
        json_values = "JSON booleans" if self.dtype.kind == "b" else "JSON numbers"
        got = f"{dtype.name if dtype is not None else json_values} [{','.join(map(str, shape))}]"
        fix = hint if not dtype_ok and hint else f"each row must have shape [{','.join(map(str, self.dims))}]"
        if dtype_ok and shape_hint:
            fix += f"; {shape_hint}"
        if list(shape) == [0] and self.dims:
            fix = f"it holds no rows: send at least one row of shape [{','.join(map(str, self.dims))}]"
        if dtype_ok and 0 in row_dims and len(row_dims) < len(self.dims):
            fix += ("; JSON lists cannot carry the axes after an empty one, so send an input with an empty axis "
                    "as {\"b64\": <base64 .npy>} (or, in the v2 protocol, with its shape and flat data)")
        raise BadInput(f"input '{self.name}' expects {self.expected}, got {got} {where}; {fix}")


MAX_TENSOR_BYTES = 2**48
"""The most bytes a tensor's shape may describe, its empty axes counted as 1: far beyond any request
or input file, and far below where numpy's size arithmetic overflows."""


def _numpy_max_dims() -> int:
    """The most axes this numpy builds an array with (64 in numpy 2, 32 before)."""
    for dims in (64, 32):
        try:
            np.empty((1,) * dims, dtype=np.uint8)
            return dims
        except ValueError:
            continue
    return 32


MAX_DIMS = _numpy_max_dims()
"""The most axes a tensor may have: numpy's own limit, past which it refuses to build one."""


def check_buildable(what: str, shape: Sequence[int], itemsize: int) -> None:
    """BadInput for a shape no array can have. Data present bounds a shape's size, but not past an
    empty axis: [0, 2**40, 2**40] holds no value, yet numpy refuses to build it ("array is too big"),
    which would surface as a 500; such a shape is a mistake, said so here. So is one of more axes
    than numpy's limit (`MAX_DIMS`), which numpy refuses as well."""
    if len(shape) > MAX_DIMS:
        raise BadInput(f"{what} has {len(shape)} axes; a tensor has at most {MAX_DIMS} (and a model input "
                       "as many as its signature lists); fix its shape")
    size = max(itemsize, 1)
    for dim in shape:
        size *= max(int(dim), 1)
        if size > MAX_TENSOR_BYTES:
            raise BadInput(f"{what} has shape {list(shape)}, which no tensor can have (more than "
                           f"{MAX_TENSOR_BYTES:,} bytes even with its empty axes counted as 1); fix its shape")


def parse_signature(signature: Mapping[str, Any]) -> list[InputSpec]:
    try:
        specs = [InputSpec.from_entry(entry) for entry in signature["inputs"]]
    except (KeyError, TypeError, ValueError) as err:
        raise InvalidModel(f"model signature is malformed ({err!r}); re-register the model") from err
    if not specs:
        raise InvalidModel("model signature lists no inputs; re-register the model")
    return specs


def convert_hint(spec: InputSpec, save: str) -> str:
    return f"convert it first (no silent casts), e.g. {save}arr.astype(np.{spec.dtype.name}))"


def json_numbers(value: Any, target: np.dtype | None = None) -> np.ndarray:
    """JSON nested lists as an array of the dtype their values imply (object/None for ragged lists).

    Python integers beyond int64 make numpy pick float64 (or object) for the lot; for an integer
    `target` they are read as that dtype when every value is an integer within its range.
    """
    try:
        raw = np.asarray(value)
    except ValueError:  # ragged nested lists
        return np.asarray(None)
    if target is not None and target.kind in "iu" and raw.dtype.kind in "fO" and raw.size:
        objects = np.asarray(value, dtype=object)
        limits = np.iinfo(target)
        if all(type(item) is int and limits.min <= item <= limits.max for item in objects.ravel()):
            return objects.astype(target)
    return raw


def fits_exactly(raw: np.ndarray, dtype: np.dtype) -> bool:
    """Can JSON values read as `raw` become `dtype` without losing anything (no float to int, no
    string, no null, integers within the dtype's range)? Finiteness is checked after the cast."""
    if raw.size == 0 and raw.dtype.kind == "f":  # [] reads as float64: there is nothing to lose
        return True
    if raw.dtype.kind not in _JSON_KINDS.get(dtype.kind, ""):
        return False
    if dtype.kind in "iu" and raw.size:
        limits = np.iinfo(dtype)
        return bool(raw.min() >= limits.min and raw.max() <= limits.max)
    return True


def json_array(spec: InputSpec, value: Any, where: str, *, batched: bool, finite: bool = True) -> np.ndarray:
    """Convert a JSON value (one row, or rows with the batch axis) to the input's dtype, losslessly.

    `finite=False` (rows of a .jsonl file, which Python's json writes NaN and Infinity into, as a
    .npy holds them) keeps NaN and infinity as written; a finite number the dtype cannot hold is
    refused either way.
    """
    converted = exact_numbers(value, spec.dtype)
    if converted is None:
        fix = "write true or false" if spec.dtype.kind == "b" else f"write numbers that fit {spec.dtype.name} exactly"
        raise BadInput(
            f"input '{spec.name}' expects a rectangular (nested) list of {spec.dtype.name} values {where}; {fix}"
        )
    raw, array = converted
    shape_hint = None
    if not spec.dims:  # one value per row: [[3], [4]] is the commonest way to get it wrong
        one, two = ("true", "false") if spec.dtype.kind == "b" else ("3", "4")
        shape_hint = f"send a flat list, one value per row, e.g. [{one}, {two}]" if batched else \
            f"write a single value, e.g. {one}"
    spec.check(None, raw.shape if batched else (1, *raw.shape), where, shape_hint=shape_hint)
    _check_finite(spec, array, where, as_written=None if finite else raw)
    return array


def exact_numbers(value: Any, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray] | None:
    """(The JSON numbers in `value` as written, the same converted to `dtype`), or None when they are
    not a rectangular list of numbers that all fit `dtype` exactly: no silent casts (1.5 is no
    int64). A number beyond a float dtype's range becomes inf, for the caller to refuse."""
    raw = json_numbers(value, dtype)
    if not fits_exactly(raw, dtype):
        return None
    with np.errstate(over="ignore"):
        return raw, raw.astype(dtype)


def _check_finite(spec: InputSpec, array: np.ndarray, where: str, *, as_written: np.ndarray | None = None) -> None:
    """Refuse NaN, infinity and numbers beyond a float dtype's range in values that came as JSON numbers;
    with `as_written`, only numbers that were finite there (NaN and infinity written as such stay).

    JSON has no NaN or infinity (the literals are a Python extension), and 1e308 read into float32 is
    inf: either way the model would answer with nulls. Typed arrays (.npy bytes, input files) are
    passed as they are: no conversion happens there, and a model may read NaN as "missing".
    """
    if spec.dtype.kind not in "fc" or not array.size:
        return
    refused = ~np.isfinite(array)
    if as_written is not None and as_written.dtype.kind in "fc":
        refused &= np.isfinite(as_written)
    if refused.any():
        limit = np.finfo(spec.dtype).max
        raise BadInput(
            f"input '{spec.name}' holds a value that is not finite or does not fit {spec.dtype.name} {where} "
            f"(NaN, Infinity or beyond ±{limit:.4g}); send finite numbers within that range"
        )


def request_tensors(signature: Mapping[str, Any], values: Mapping[str, Any], *,
                    mask: MaskSpec | None = None) -> dict[str, np.ndarray]:
    """The input tensors of an online request, checked against the model's signature.

    Each value carries the batch axis and is either (nested) JSON numbers, converted only when
    lossless, or `{"b64": <base64 .npy>}` or a numpy array, whose dtype must match exactly. Every input must be
    there, no other, and all must have the same number of rows (>= 1). The one exception is the
    attention mask of a model that declares one (`mask`, from `padding.mask_spec`): the worker builds
    it when padding, so the client may leave it out; a mask that is sent must match the token input's shape.
    """
    specs = parse_signature(signature)
    expected = [spec.name for spec in specs]
    optional = {mask.mask_input} if mask is not None else set()
    if not set(expected) - optional <= set(values) <= set(expected):
        leave_out = f" ('{mask.mask_input}' may be left out)" if mask is not None else ""
        raise BadInput(f"got inputs {sorted(values)}; the model takes exactly {expected}{leave_out}")
    tensors: dict[str, np.ndarray] = {}
    for spec in specs:
        if spec.name not in values:
            continue
        value, where = values[spec.name], "in the request"
        if isinstance(value, np.ndarray):  # already typed (the v2 protocol declares its datatype)
            spec.check(value.dtype, value.shape, where, hint=f"send datatype {spec.dtype.name}")
            _check_finite(spec, value, where)  # v2 tensors are JSON numbers, read with the declared dtype
            tensors[spec.name] = np.ascontiguousarray(value)
        elif isinstance(value, dict):
            tensors[spec.name] = _b64_tensor(spec, value, where)
        else:
            tensors[spec.name] = json_array(spec, value, where, batched=True)
    rows = {array.shape[0] if array.ndim else 0 for array in tensors.values()}
    if len(rows) != 1 or 0 in rows:
        raise BadInput(f"inputs must have the same number of rows (>= 1) on axis 0, got {sorted(rows)}"
                       f"{_repeat_once_per_row_hint(specs, tensors)}")
    if mask is not None:
        check_mask(tensors, mask)
    return tensors


_MAX_EXAMPLE_VALUES = 8


def _repeat_once_per_row_hint(specs: list[InputSpec], tensors: Mapping[str, np.ndarray]) -> str:
    """What to send when inputs the model fixes at one row (a config tensor such as `steps[1]`) came
    once beside batched ones: the model runs one row at a time, each row taking its own copy."""
    once = [spec.name for spec in specs if spec.fixed_rows == 1 and spec.name in tensors
            and tensors[spec.name].shape[0] == 1]
    batched = {array.shape[0] for name, array in tensors.items() if name not in once}
    if not once or len(batched) != 1 or min(batched) < 2:
        return ""
    rows = min(batched)
    names = ", ".join(f"'{name}'" for name in once)
    hint = (f"; {names} {'has' if len(once) == 1 else 'have'} a fixed first axis of 1, so the model runs one row at "
            f"a time and each row needs its own copy: repeat {'it' if len(once) == 1 else 'each'} once per row "
            f"({rows} rows)")
    example = tensors[once[0]]
    if example.size * rows <= _MAX_EXAMPLE_VALUES:
        hint += f", e.g. '{once[0]}': {json.dumps(np.repeat(example, rows, axis=0).tolist())}"
    return hint


def _b64_tensor(spec: InputSpec, value: dict[str, Any], where: str) -> np.ndarray:
    if set(value) != {"b64"} or not isinstance(value["b64"], str):
        raise BadInput(f"input '{spec.name}' must be nested lists or {{\"b64\": <base64 .npy bytes>}}")
    try:
        raw = base64.b64decode(value["b64"], validate=True)
    except ValueError as err:
        raise BadInput(f"input '{spec.name}' is not base64 of a .npy file ({err}); encode it with np.save") from err
    stream = io.BytesIO(raw)
    header = read_npy_header(stream, len(raw), f"input '{spec.name}'", "encode it with np.save")
    if not header.shape:
        raise BadInput(f"input '{spec.name}' must be an array with a batch axis")
    spec.check(header.dtype, header.shape, where, hint=convert_hint(spec, "np.save(buffer, "))
    # The data as the header describes it (checked against the bytes present), without parsing the
    # header a second time as np.load would: that parse costs more than a small request's inference.
    array = np.frombuffer(raw, dtype=header.dtype, count=math.prod(header.shape), offset=header.data_offset)
    array = array.reshape(header.shape, order="F" if header.fortran_order else "C")
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("="))


@dataclass(frozen=True)
class NpyHeader:
    """What an .npy header says: the array's shape, dtype and layout, and where its data starts."""

    shape: tuple[int, ...]
    dtype: np.dtype
    fortran_order: bool
    data_offset: int


NPY_HEADER_LOCK = threading.Lock()
"""Held by whoever lets numpy parse an .npy header (`np.load`, `read_array`, the header readers).
numpy parses it with `ast.literal_eval`, and CPython 3.11 keeps the AST constructor's recursion
counter in state shared by all threads: two threads parsing at once (a merge's copy and hash
threads, two API threads decoding requests) can fail with "AST constructor recursion depth
mismatch". A header parse takes microseconds, so one lock per process costs nothing measurable."""

_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
_HEADER_LENGTH_BYTES = {(1, 0): 2, (2, 0): 4}
_NUMPY_WRITTEN_HEADER = re.compile(
    r"\{'descr': '([<>|][a-zA-Z]\d*)', 'fortran_order': (True|False), 'shape': \((|\d+,|\d+(?:, \d+)+)\), \} *\n")
"""A header exactly as `np.save` writes it for a plain dtype. Read by this pattern, not numpy's parser
(`ast.literal_eval` under `NPY_HEADER_LOCK`): that parse was about a third of an online request's tensor
checks. Any other header, however valid, goes to numpy's parser."""


def _numpy_written_header(stream: IO[bytes], version: tuple[int, int]) -> tuple[tuple[int, ...], bool, np.dtype] | None:
    """(shape, fortran order, dtype) of a header `np.save` wrote (`_NUMPY_WRITTEN_HEADER`), read from
    `stream` just after the magic; None, with the stream where it was, for any other header."""
    start = stream.tell()
    length_bytes = stream.read(_HEADER_LENGTH_BYTES[version])
    complete = len(length_bytes) == _HEADER_LENGTH_BYTES[version]
    text = stream.read(int.from_bytes(length_bytes, "little")) if complete else b""
    found = _NUMPY_WRITTEN_HEADER.fullmatch(text.decode("latin-1"))
    try:
        dtype = np.dtype(found.group(1)) if found else None
    except TypeError:  # (no such dtype: numpy's parser says what is wrong)
        dtype = None
    if found is None or dtype is None or dtype.str != found.group(1):
        stream.seek(start)
        return None
    shape = tuple(int(dim) for dim in found.group(3).rstrip(",").split(", ") if dim)
    return shape, found.group(2) == "True", dtype


def read_npy_header(stream: IO[bytes], size: int, what: str, fix: str) -> NpyHeader:
    """Read and check the .npy header at the start of `stream`, whose bytes number `size` in all.

    Every .npy reader (files, npz members, base64 requests) comes through here, so a bad header is
    always a BadInput naming `what`, with `fix` saying how to write it again. numpy's header parser
    raises ValueError, SyntaxError, tokenize.TokenError or RecursionError on bad text, so any
    exception but OSError counts as malformed. A header that claims more data than follows it is
    refused before anything is allocated or queued: 200 bytes must not pass for 25 TB of rows.
    """
    try:
        version = np.lib.format.read_magic(stream)
        if version not in _HEADER_READERS:
            raise ValueError(f"npy format version {version} is not supported")
        fast = _numpy_written_header(stream, version)
        if fast is not None:
            shape, fortran_order, dtype = fast
        else:
            with NPY_HEADER_LOCK:
                shape, fortran_order, dtype = _HEADER_READERS[version](stream)
        header = NpyHeader(tuple(shape), dtype, bool(fortran_order), stream.tell())
    except OSError:
        raise
    except Exception as err:
        raise BadInput(f"{what} has a malformed .npy header ({type(err).__name__}: {err}); {fix}") from err
    if header.dtype.hasobject:
        raise BadInput(f"{what} holds Python objects (dtype {header.dtype}); only numeric arrays can be read")
    if any(dim < 0 for dim in header.shape):
        raise BadInput(f"{what} has a negative dimension in its header shape {list(header.shape)}; {fix}")
    claimed, present = math.prod(header.shape) * header.dtype.itemsize, size - header.data_offset
    if claimed > present:
        raise BadInput(
            f"{what} has a header claiming {header.dtype.name} {list(header.shape)} ({claimed:,} bytes), but only "
            f"{max(present, 0):,} bytes of data follow it (truncated, or a wrong header); {fix}"
        )
    return header
