"""Hand-made .npy and .npz bytes for bad-input tests: headers that lie or do not parse."""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path


def npy_bytes(header: str, data: bytes = b"") -> bytes:
    """An .npy 1.0 file with this header text (not checked) and these data bytes."""
    text = header.encode("latin1")
    text += b" " * (-(10 + len(text) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text + data


def float32_header(shape: str) -> str:
    """The header text of a C-order float32 array of `shape` (written as a Python tuple)."""
    return f"{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}"


def write_npz(path: Path, member: bytes, method: int = zipfile.ZIP_DEFLATED, name: str = "features.npy") -> Path:
    """An .npz archive at `path` holding `member` as its one array file."""
    with zipfile.ZipFile(path, "w", compression=method) as archive:
        archive.writestr(name, member)
    return path
