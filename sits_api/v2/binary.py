"""Triton's binary tensor data extension of the v2 protocol: raw tensor bytes after the JSON header.

tritonclient uses it by default. A request with an `Inference-Header-Content-Length: N` header
holds N bytes of JSON and then, in the order of its inputs, the raw bytes of each input that says
`"parameters": {"binary_data_size": <bytes>}` instead of giving `data`: row-major, little-endian,
one byte per BOOL. An answer framed the same way carries the outputs the request asks for in binary
(`binary_data` on a requested output, else the request's `binary_data_output`) with
`binary_data_size` in place of `data`.
https://github.com/triton-inference-server/server/blob/main/docs/protocol/extension_binary_data.md
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from flask import Response, current_app

from broker.errors import BadInput

HEADER_LENGTH = "Inference-Header-Content-Length"
"""The HTTP header giving the byte length of the JSON header at the start of a framed body."""


class BinaryData:
    """The bytes after the JSON header, handed to the binary inputs in their order."""

    def __init__(self, data: bytes | memoryview) -> None:
        self._data = memoryview(data)
        self._taken = 0

    def take(self, name: str, size: int) -> memoryview:
        """The next `size` bytes, for input `name`; BadInput when the body ends before them."""
        if size > len(self._data) - self._taken:
            raise BadInput(f"input '{name}' declares binary_data_size {size}, but only "
                           f"{len(self._data) - self._taken} bytes of the body are left for it; the bytes "
                           f"after the JSON header ({HEADER_LENGTH}) must hold every binary input, in order")
        self._taken += size
        return self._data[self._taken - size : self._taken]

    def check_all_taken(self) -> None:
        """BadInput when bytes are left over: a wrong binary_data_size or header length would shift every input."""
        left = len(self._data) - self._taken
        if left:
            raise BadInput(f"the body has {left} bytes after the binary data of the inputs; the binary_data_size "
                           f"of the inputs must add up to the body's length after the JSON header "
                           f"({HEADER_LENGTH} bytes)")


def split_body(body: bytes, header_length: str | None) -> tuple[bytes, BinaryData]:
    """(The JSON header, the binary data after it) of a request body; without a header length
    (`Inference-Header-Content-Length`) the whole body is JSON."""
    if header_length is None:
        return body, BinaryData(b"")
    digits = header_length.strip()
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 20):
        raise BadInput(f"header {HEADER_LENGTH} must be the byte length of the JSON at the start of the body, "
                       f"a whole number; got {header_length[:40]!r}")
    length = int(digits)
    if length > len(body):
        raise BadInput(f"header {HEADER_LENGTH} is {length}, but the body has only {len(body)} bytes; it must be "
                       f"the byte length of the JSON at the start of the body")
    return body[:length], BinaryData(memoryview(body)[length:])


def binary_data_size(parameters: dict[str, Any], name: str) -> int | None:
    """The `binary_data_size` of input `name` (None when its data is JSON)."""
    size = parameters.get("binary_data_size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
        raise BadInput(f"input '{name}' parameter 'binary_data_size' must be a whole number of bytes, got {size!r}")
    return size


def tensor_from_bytes(name: str, raw: memoryview, datatype: str, dtype: np.dtype, shape: list[int]) -> np.ndarray:
    """The binary data of input `name` as a `dtype` array of `shape`, its size checked first."""
    expected = math.prod(shape) * dtype.itemsize
    if len(raw) != expected:
        raise BadInput(f"input '{name}' has {len(raw)} bytes of binary data, but {datatype} {shape} takes "
                       f"{expected} ({dtype.itemsize} per value); fix its shape or binary_data_size")
    if dtype.kind == "b":
        octets = np.frombuffer(raw, dtype=np.uint8)
        if (octets > 1).any():
            raise BadInput(f"input '{name}' is BOOL, one byte per value, 0 or 1; it holds other bytes")
        return (octets == 1).reshape(shape)
    return np.frombuffer(raw, dtype=dtype.newbyteorder("<")).astype(dtype).reshape(shape)


def tensor_bytes(array: np.ndarray) -> bytes:
    """An output's data as the extension sends it: row-major, little-endian."""
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def framed_response(header: dict[str, Any], binary: list[bytes], *, text: str | None = None) -> Response:
    """An answer of the JSON `header` (or its `text`, written already) followed by the `binary` output
    data, in the order of its outputs."""
    header_bytes = (current_app.json.dumps(header) if text is None else text).encode()
    response = Response(header_bytes + b"".join(binary), mimetype="application/octet-stream")
    response.headers[HEADER_LENGTH] = str(len(header_bytes))
    return response
