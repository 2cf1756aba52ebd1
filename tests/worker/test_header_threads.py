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
from sits_worker.outputs import finalize_outputs, write_part

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


def test_header_reads_share_one_lock_so_threads_never_corrupt_the_ast_counter() -> None:
    buffer = io.BytesIO()
    np.save(buffer, np.zeros((3, 4, 5), np.float32))
    raw = buffer.getvalue()

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
