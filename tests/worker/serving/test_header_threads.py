"""numpy parses .npy headers with `ast.literal_eval`, which CPython 3.11 cannot run on two threads at
once (a shared recursion counter): the merge's copy and hash threads, and the API's request threads,
parse headers through one lock. This test makes the race likely (thread switches every microsecond,
garbage with finalizers collected in the middle of AST construction) and checks SITS's readers hold the
lock; without it each test here fails on CPython 3.11.7."""

from __future__ import annotations

import gc
import io
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from sits_worker.model.tensors import read_npy_header
from sits_worker.serving.outputs import finalize_outputs, write_part

_THREAD_DEPTHS = (5, 150, 60, 100)  # the counter mismatch needs threads at different stack depths


class _Garbage:
    """A cycle with a finalizer: collecting it runs Python code, where the interpreter may switch threads."""

    def __del__(self) -> None:
        sum(range(50))


@contextmanager
def _race_prone() -> Iterator[None]:
    interval, thresholds = sys.getswitchinterval(), gc.get_threshold()
    sys.setswitchinterval(1e-6)
    gc.set_threshold(50, 1, 1)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)
        gc.set_threshold(*thresholds)


def _errors(parse: Callable[[int], object], rounds: int) -> list[Exception]:
    """Run `parse(thread_index)` `rounds` times on each of four threads while making garbage; the
    exceptions seen (SITS's readers turn the SystemError into a BadInput naming it)."""
    errors: list[Exception] = []

    def at_depth(depth: int, thread_index: int) -> None:
        if depth:
            return at_depth(depth - 1, thread_index)
        for _ in range(rounds):
            for _ in range(20):
                junk = _Garbage()
                junk.cycle = junk  # type: ignore[attr-defined]
            try:
                parse(thread_index)
            except Exception as err:
                errors.append(err)
        return None

    threads = [threading.Thread(target=at_depth, args=(depth, index)) for index, depth in enumerate(_THREAD_DEPTHS)]
    with _race_prone():
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    return errors


def _npy_with_header(header: str, data: bytes) -> bytes:
    """.npy bytes (version 1.0) with `header` as the header text, padded as numpy pads it."""
    text = header.encode("latin-1")
    text += b" " * (-(10 + len(text) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + data


def test_header_reads_share_one_lock_so_threads_never_corrupt_the_ast_counter() -> None:
    # (keys in another order than np.save's: numpy's own parser reads it, not the pattern)
    raw = _npy_with_header("{'shape': (3, 4, 5), 'fortran_order': False, 'descr': '<f4'}",
                           np.zeros((3, 4, 5), np.float32).tobytes())

    errors = _errors(lambda _: read_npy_header(io.BytesIO(raw), len(raw), "a test array", "fix it"), rounds=3000)

    assert errors == []


def test_merges_on_several_threads_never_fail_on_a_header(tmp_path: Path) -> None:
    folders = [tmp_path / f"job{index}" for index in range(len(_THREAD_DEPTHS))]
    chunks = [(start, start + 2) for start in range(0, 16, 2)]
    for folder in folders:
        for index, (start, stop) in enumerate(chunks):
            write_part(folder, index, {"out": np.arange(start, stop, dtype=np.float32)})

    def merge(thread_index: int) -> None:
        folder = folders[thread_index]
        (folder / "out.npy").unlink(missing_ok=True)
        (folder / "manifest.json").unlink(missing_ok=True)
        finalize_outputs(folder, chunks, ["out"], {})

    assert _errors(merge, rounds=40) == []
    np.testing.assert_array_equal(np.load(folders[0] / "out.npy"), np.arange(16, dtype=np.float32))


def test_headers_np_save_writes_read_as_numpy_reads_them_and_any_other_valid_header_too() -> None:
    arrays = [np.zeros((1, 128), np.int64), np.zeros((3,), np.float32), np.array(2.5), np.zeros((2, 3, 4), ">f4"),
              np.asfortranarray(np.zeros((2, 3))), np.zeros((4, 5), np.bool_), np.zeros((0, 4), np.float16),
              np.zeros((2,), [("a", "<f4")]), np.zeros((2,), "M8[s]")]
    for array in arrays:
        buffer = io.BytesIO()
        np.save(buffer, array)
        raw = buffer.getvalue()
        theirs = io.BytesIO(raw)
        np.lib.format.read_magic(theirs)
        shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(theirs)

        header = read_npy_header(io.BytesIO(raw), len(raw), "a test array", "fix it")

        assert (header.shape, header.fortran_order, header.dtype) == (shape, fortran_order, dtype), array.dtype
        assert header.data_offset == theirs.tell()
    odd = _npy_with_header("{'fortran_order': False, 'descr': '<i2', 'shape': (2, 2)}", bytes(8))
    header = read_npy_header(io.BytesIO(odd), len(odd), "a test array", "fix it")
    assert (header.shape, header.dtype, header.data_offset) == ((2, 2), np.dtype("<i2"), len(odd) - 8)
