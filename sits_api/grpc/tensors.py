"""Tensors in the gRPC protocol's messages: typed `contents` and raw bytes.

An input of a `ModelInferRequest` carries its values either in `contents`, a repeated field per
family of types (`fp32_contents`, `int_contents` for INT8 to INT32 ...), or, as tritonclient sends
them, in `raw_input_contents`: row-major and little-endian, one byte per BOOL, and for BYTES each
element as a 4-byte little-endian length and then its bytes. That raw form is the one of Triton's
binary tensor data extension over HTTP (`sits_api.v2.binary`), so every input is brought to it here
and then checked by the HTTP path's own parser. Outputs go back as raw contents.
"""

from __future__ import annotations

import math
import struct

import numpy as np

from broker.errors import BadInput, PayloadTooLarge
from sits_api.v2.binary import tensor_bytes
from sits_api.v2.parsing import NUMPY_TO_V2

TYPED_FIELDS = {"BOOL": ("bool_contents", "bool"), "INT8": ("int_contents", "int8"),
                "INT16": ("int_contents", "int16"), "INT32": ("int_contents", "int32"),
                "INT64": ("int64_contents", "int64"), "UINT8": ("uint_contents", "uint8"),
                "UINT16": ("uint_contents", "uint16"), "UINT32": ("uint_contents", "uint32"),
                "UINT64": ("uint64_contents", "uint64"), "FP32": ("fp32_contents", "float32"),
                "FP64": ("fp64_contents", "float64"), "BYTES": ("bytes_contents", "object")}
"""The `InferTensorContents` field that holds each datatype's values, and the numpy type they are
read as. FP16 and BF16 have no field: they travel as raw contents only, as in Triton."""

CONTENT_FIELDS = tuple(dict.fromkeys(field for field, _ in TYPED_FIELDS.values()))


def raw_from_contents(name: str, datatype: str, shape: list[int], contents: object, *, max_bytes: int = 0) -> bytes:
    """The values in an input's typed `contents` (an `InferTensorContents`) as its raw contents would
    hold them; BadInput naming what to fix when they are in the wrong field, out of range for the
    datatype, or not as many as `shape` needs; PayloadTooLarge when they would take more than `max_bytes`
    (0: no cap) once decoded: a small int64 value takes one byte on the wire and eight decoded, so the
    message's size alone does not bound them."""
    if datatype not in TYPED_FIELDS:
        raise BadInput(f"input '{name}' is {datatype}, which has no typed contents in the protocol; send it "
                       f"in raw_input_contents")
    field, numpy_type = TYPED_FIELDS[datatype]
    stray = [other for other in CONTENT_FIELDS if other != field and len(getattr(contents, other))]
    if stray:
        raise BadInput(f"input '{name}' is {datatype}: its values go in contents.{field}, not "
                       f"contents.{', contents.'.join(stray)}")
    values = getattr(contents, field)
    if len(values) != math.prod(shape):
        raise BadInput(f"input '{name}' has {len(values)} values in contents.{field} but shape {shape} needs "
                       f"{math.prod(shape)}")
    if datatype == "BYTES":
        return serialize_bytes(list(values))
    decoded = len(values) * np.dtype(_WIDE[field]).itemsize
    if 0 < max_bytes < decoded:
        raise PayloadTooLarge(f"input '{name}' holds {len(values):,} values in contents.{field}, {decoded:,} bytes "
                              f"decoded, more than a request may carry ({max_bytes:,} bytes, api.max_body_bytes); "
                              "send fewer rows per request")
    wide = np.fromiter(values, dtype=_WIDE[field], count=len(values))  # (C's loop: 3x np.array's)
    array = wide.astype(numpy_type)
    if not np.array_equal(array.astype(_WIDE[field]), wide):  # (INT8 in int_contents: 300 does not fit)
        raise BadInput(f"input '{name}' holds values in contents.{field} that do not fit {datatype}")
    return tensor_bytes(array)


_WIDE = {"bool_contents": "bool", "int_contents": "int32", "int64_contents": "int64", "uint_contents": "uint32",
         "uint64_contents": "uint64", "fp32_contents": "float32", "fp64_contents": "float64"}
"""The type each typed field holds on the wire (narrower datatypes share `int_contents` and `uint_contents`)."""


def serialize_bytes(elements: list[bytes]) -> bytes:
    """BYTES elements in the raw form: each one's 4-byte little-endian length, then its bytes."""
    return b"".join(struct.pack("<I", len(element)) + element for element in elements)


def output_datatype(array: np.ndarray) -> str:
    """The protocol's datatype of an output array: BYTES for strings and bytes (object arrays)."""
    return NUMPY_TO_V2.get(array.dtype.name) or "BYTES"


def raw_output(array: np.ndarray) -> bytes:
    """An output's raw contents: as the binary extension sends it, or BYTES elements length-prefixed."""
    if array.dtype.name in NUMPY_TO_V2:
        return tensor_bytes(array)
    return serialize_bytes([element if isinstance(element, bytes) else str(element).encode()
                            for element in array.ravel().tolist()])
