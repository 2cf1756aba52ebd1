"""Chunk output parts are written atomically and merged into row-ordered outputs with a manifest."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from broker.errors import BadInput, Conflict, FileMissing, RetryableError
from broker.jobs.output_layout import chunks_with_parts, part_exists, part_path
from sits_worker.model.inputs import file_checksum
from sits_worker.serving import outputs
from sits_worker.serving.outputs import finalize_outputs, remove_parts, write_part

EXTRA = {
    "job_id": "job-1",
    "model": "resnet",
    "model_version": 3,
    "input_file": "images.npy",
    "input_checksum": "sha256:ab",
}
CHUNKS = [(0, 4), (4, 8), (8, 10)]


def _outputs(rows: range) -> dict[str, np.ndarray]:
    logits = np.array([[row, row * 0.5] for row in rows], dtype=np.float32)
    return {"logits": logits, "label": np.array(list(rows), dtype=np.int64)}


def _write_all(output_dir: Path, chunks: list[tuple[int, int]], order: list[int] | None = None) -> None:
    for index in order or range(len(chunks)):
        write_part(output_dir, index, _outputs(range(*chunks[index])))


def test_parts_merge_into_row_ordered_outputs_with_manifest_checksums(tmp_path: Path) -> None:
    _write_all(tmp_path, CHUNKS, order=[2, 0, 1])  # chunks finish in any order

    manifest = finalize_outputs(tmp_path, CHUNKS, ["logits", "label"], EXTRA)

    expected = _outputs(range(10))
    for name in ("logits", "label"):
        entry = manifest["outputs"][name]
        final = tmp_path / entry["file"]
        assert entry["file"] == f"{name}.npy"
        np.testing.assert_array_equal(np.load(final), expected[name])
        assert entry["shape"] == list(expected[name].shape) and entry["dtype"] == expected[name].dtype.name
        assert entry["checksum"] == "sha256:" + hashlib.sha256(final.read_bytes()).hexdigest()
    assert manifest["rows"] == 10 and manifest["chunks"] == 3
    assert {key: manifest[key] for key in EXTRA} == EXTRA
    assert json.loads((tmp_path / "manifest.json").read_text()) == manifest
    assert sorted(path.name for path in tmp_path.iterdir()) == [".parts", "label.npy", "logits.npy", "manifest.json"]
    assert sorted(path.name for path in (tmp_path / ".parts").iterdir()) == [  # no merge temp files left
        f"{name}.{index:06d}.npy" for name in ("label", "logits") for index in range(3)
    ]


def test_parts_stay_until_removed_once_the_job_is_recorded_done(tmp_path: Path) -> None:
    _write_all(tmp_path, CHUNKS)
    finalize_outputs(tmp_path, CHUNKS, ["logits", "label"], EXTRA)
    assert part_exists(tmp_path, 2, ["logits", "label"])  # the job is not recorded done yet

    remove_parts(tmp_path)
    remove_parts(tmp_path)  # idempotent

    assert sorted(path.name for path in tmp_path.iterdir()) == ["label.npy", "logits.npy", "manifest.json"]


def test_rewriting_a_part_gives_identical_bytes(tmp_path: Path) -> None:
    outputs = _outputs(range(4, 8))
    write_part(tmp_path, 1, outputs)
    first = {path.name: path.read_bytes() for path in (tmp_path / ".parts").iterdir()}

    # The same values again, even laid out in Fortran order in memory, after a lost ack.
    write_part(tmp_path, 1, {name: np.asfortranarray(values) for name, values in outputs.items()})
    second = {path.name: path.read_bytes() for path in (tmp_path / ".parts").iterdir()}

    assert first == second
    assert sorted(first) == ["label.000001.npy", "logits.000001.npy"]  # no temp files left behind


def test_part_exists_only_when_every_output_is_written(tmp_path: Path) -> None:
    assert not part_exists(tmp_path, 0, ["logits", "label"])
    write_part(tmp_path, 0, {"logits": _outputs(range(4))["logits"]})
    assert not part_exists(tmp_path, 0, ["logits", "label"])
    write_part(tmp_path, 0, _outputs(range(4)))
    assert part_exists(tmp_path, 0, ["logits", "label"])


def test_chunks_with_parts_lists_the_chunks_every_output_of_which_is_written(tmp_path: Path) -> None:
    assert chunks_with_parts(tmp_path, ["logits", "label"], job_id="j1") == set()  # no parts folder yet
    for chunk in (0, 2, 12):
        write_part(tmp_path, chunk, _outputs(range(4)), job_id="j1")
    write_part(tmp_path, 5, {"logits": _outputs(range(4))["logits"]}, job_id="j1")  # one output of two
    write_part(tmp_path, 7, _outputs(range(4)), job_id="j2")  # another job's

    found = chunks_with_parts(tmp_path, ["logits", "label"], job_id="j1")

    assert found == {0, 2, 12} == {chunk for chunk in range(20) if part_exists(tmp_path, chunk, ["logits", "label"],
                                                                               job_id="j1")}


def test_finalize_is_idempotent(tmp_path: Path) -> None:
    _write_all(tmp_path, CHUNKS)
    first = finalize_outputs(tmp_path, CHUNKS, ["logits", "label"], EXTRA)
    final_bytes = (tmp_path / "logits.npy").read_bytes()

    again = finalize_outputs(tmp_path, CHUNKS, ["logits", "label"], EXTRA)

    assert again == first and (tmp_path / "logits.npy").read_bytes() == final_bytes


def test_finalize_after_a_crash_before_the_parts_were_removed(tmp_path: Path) -> None:
    _write_all(tmp_path, CHUNKS)
    manifest = finalize_outputs(tmp_path, CHUNKS, ["logits", "label"], EXTRA)
    _write_all(tmp_path, CHUNKS)  # as if the worker died between the manifest and removing the parts

    assert finalize_outputs(tmp_path, CHUNKS, ["logits", "label"], EXTRA) == manifest
    remove_parts(tmp_path)
    assert not (tmp_path / ".parts").exists()


def test_a_missing_part_names_its_chunk_and_finalize_can_run_again(tmp_path: Path) -> None:
    _write_all(tmp_path, CHUNKS, order=[0, 2])

    with pytest.raises(FileMissing, match=r"chunk 1 \(rows \[4, 8\)\) is missing"):
        finalize_outputs(tmp_path, CHUNKS, ["logits", "label"], EXTRA)
    assert not (tmp_path / "manifest.json").exists()
    assert not list(tmp_path.glob("*.npy")) and not list((tmp_path / ".parts").glob("*.tmp"))  # no half merge

    _write_all(tmp_path, CHUNKS, order=[1])
    manifest = finalize_outputs(tmp_path, CHUNKS, ["logits", "label"], EXTRA)
    np.testing.assert_array_equal(np.load(tmp_path / "label.npy"), np.arange(10))
    assert manifest["rows"] == 10


@pytest.mark.parametrize("gone", ["out", "out/.parts"])
def test_a_merge_whose_folder_is_gone_says_the_chunks_must_run_again(tmp_path: Path, gone: str) -> None:
    """A missing folder is the job's missing parts (FileMissing, as one missing part), not a disk to wait for."""
    _write_all(tmp_path / "out", CHUNKS)
    shutil.rmtree(tmp_path / gone)

    with pytest.raises(FileMissing, match=f"'{tmp_path / gone}/?' is missing.*resume the job"):
        finalize_outputs(tmp_path / "out", CHUNKS, ["logits", "label"], EXTRA)


def test_chunks_whose_outputs_differ_in_dtype_or_row_shape_are_not_merged(tmp_path: Path) -> None:
    write_part(tmp_path, 0, {"logits": np.ones((4, 2), np.float32)})
    write_part(tmp_path, 1, {"logits": np.ones((4, 2), np.float64)})
    write_part(tmp_path, 2, {"logits": np.ones((2, 3), np.float32)})

    with pytest.raises(BadInput, match="float32 .* in chunk 0 but float64 .* in chunk 1"):
        finalize_outputs(tmp_path, CHUNKS, ["logits"], EXTRA)
    write_part(tmp_path, 1, {"logits": np.ones((4, 2), np.float32)})
    with pytest.raises(BadInput, match=r"rows of shape \[2\] in chunk 0 but float32 \[3\] in chunk 2"):
        finalize_outputs(tmp_path, CHUNKS, ["logits"], EXTRA)

    assert not (tmp_path / "logits.npy").exists() and not list((tmp_path / ".parts").glob("*.tmp"))


def test_a_late_part_of_a_cancelled_job_in_the_same_folder_does_not_touch_the_new_jobs(tmp_path: Path) -> None:
    """Job A was cancelled while a worker still ran its chunk 0; job B took the folder. A's part lands
    in A's own parts folder, after B's, and B's outputs are B's rows."""
    write_part(tmp_path, 0, _outputs(range(0, 4)), job_id="job-b")
    write_part(tmp_path, 0, {name: array * 0 - 1 for name, array in _outputs(range(0, 4)).items()}, job_id="job-a")

    assert part_exists(tmp_path, 0, ["logits", "label"], job_id="job-b")
    manifest = finalize_outputs(tmp_path, [(0, 4)], ["logits", "label"], EXTRA, job_id="job-b")

    assert manifest["rows"] == 4
    np.testing.assert_array_equal(np.load(tmp_path / "label.npy"), np.arange(4))


def test_removing_a_finished_job_s_parts_keeps_another_job_s_in_the_folder(tmp_path: Path) -> None:
    """Job A was cancelled with chunk 0 of 2 done; job B took the folder and finished. A's part is its
    resumable work: B's cleanup removes B's parts only, and `.parts/` once the last job's are gone."""
    write_part(tmp_path, 0, _outputs(range(0, 4)), job_id="job-a")
    a_parts = {path: path.read_bytes() for path in (tmp_path / ".parts" / "job-a").iterdir()}
    _write_all(tmp_path, CHUNKS)  # as job "": parts directly in .parts/
    for index, chunk in enumerate(CHUNKS):
        write_part(tmp_path, index, _outputs(range(*chunk)), job_id="job-b")
    finalize_outputs(tmp_path, CHUNKS, ["logits", "label"], EXTRA, job_id="job-b")

    remove_parts(tmp_path, job_id="job-b")
    remove_parts(tmp_path, job_id="job-b")  # idempotent

    assert sorted(path.name for path in (tmp_path / ".parts").iterdir()) == sorted(
        ["job-a", *(f"{name}.{index:06d}.npy" for name in ("label", "logits") for index in range(3))])
    assert {path: path.read_bytes() for path in (tmp_path / ".parts" / "job-a").iterdir()} == a_parts
    remove_parts(tmp_path)  # job "": the files directly in .parts/, not the folders of other jobs
    assert [path.name for path in (tmp_path / ".parts").iterdir()] == ["job-a"]
    remove_parts(tmp_path, job_id="job-a")
    assert not (tmp_path / ".parts").exists()


def test_a_crashed_merge_leaves_its_temp_file_in_its_own_job_s_parts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A merge killed before its rename leaves a temp file behind; it lies with its job's parts, so
    that job's cleanup removes it and no other job's cleanup touches another's."""
    write_part(tmp_path, 0, _outputs(range(0, 4)), job_id="job-a")
    write_part(tmp_path, 0, _outputs(range(0, 4)), job_id="job-b")

    def killed_before_the_rename(source: object, target: object, **dir_fds: object) -> None:
        raise OSError(5, "killed")

    monkeypatch.setattr(outputs.os, "replace", killed_before_the_rename)
    with pytest.raises(RetryableError):
        finalize_outputs(tmp_path, [(0, 4)], ["logits"], EXTRA, job_id="job-b")
    monkeypatch.undo()

    [temp] = (tmp_path / ".parts").rglob("*.tmp")
    assert temp.parent == tmp_path / ".parts" / "job-b" and temp.name.startswith(".logits.npy.")
    remove_parts(tmp_path, job_id="job-b")
    assert not list((tmp_path / ".parts").rglob("*.tmp"))
    assert part_exists(tmp_path, 0, ["logits", "label"], job_id="job-a")


def test_a_manifest_of_another_job_is_not_handed_back(tmp_path: Path) -> None:
    _write_all(tmp_path, CHUNKS)
    finalize_outputs(tmp_path, CHUNKS, ["logits", "label"], EXTRA)

    with pytest.raises(Conflict, match="already holds results of another job"):
        finalize_outputs(tmp_path, CHUNKS, ["logits", "label"], {**EXTRA, "job_id": "job-2"})


def test_output_names_that_are_not_file_names_get_safe_files(tmp_path: Path) -> None:
    write_part(tmp_path, 0, {"dense/Softmax:0": np.ones((2, 3), np.float32)})

    manifest = finalize_outputs(tmp_path, [(0, 2)], ["dense/Softmax:0"], EXTRA)

    file_name = manifest["outputs"]["dense/Softmax:0"]["file"]
    assert file_name.startswith("dense_Softmax_0-") and file_name.endswith(".npy")
    assert (tmp_path / file_name).is_file()


@pytest.mark.parametrize("kernel_copy", [True, False], ids=["copy_file_range", "through-python"])
def test_a_merge_keeps_its_lease_alive_after_every_block_it_copies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   kernel_copy: bool) -> None:
    """A multi-GB merge may outlast the finalize item's lease: no part, however big, is copied
    without `keep_alive` (which extends the lease when due) being called along the way. The same
    bytes come out where the kernel copies the parts and where it cannot (no `os.copy_file_range`,
    as on macOS)."""
    monkeypatch.setattr(outputs, "_COPY_BLOCK_BYTES", 16)
    monkeypatch.setattr(outputs, "_READ_BYTES", 16)
    if not kernel_copy:
        monkeypatch.delattr(os, "copy_file_range", raising=False)
    write_part(tmp_path, 0, {"out": np.arange(8, dtype=np.float64).reshape(4, 2)})  # 64 bytes: 4 blocks
    write_part(tmp_path, 1, {"out": np.arange(2, dtype=np.float64).reshape(1, 2)})  # 16 bytes: 1 block
    calls: list[int] = []

    finalize_outputs(tmp_path, [(0, 4), (4, 5)], ["out"], EXTRA, keep_alive=lambda: calls.append(1))

    assert len(calls) >= 5
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), [[0, 1], [2, 3], [4, 5], [6, 7], [0, 1]])


def test_c_order_parts_are_copied_by_the_kernel_and_fortran_order_ones_through_python(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel copies the file bytes of a C-order part, and only its chunk's rows of one longer than its chunk
    (written before the chunk was split); a Fortran-order part's bytes are not the merged rows' order."""
    kernel_copy, copied = os.copy_file_range, []

    def counted(source: int, target: int, count: int, offset: int) -> int:
        copied.append((count, offset))
        return kernel_copy(source, target, count, offset)

    monkeypatch.setattr(os, "copy_file_range", counted)
    values = np.arange(24, dtype=np.float32).reshape(8, 3)
    write_part(tmp_path, 0, {"out": values[:4]})  # chunk 0 is rows [0, 2): its first 2 rows are taken
    np.save(part_path(tmp_path, "out", 1), np.asfortranarray(values[2:5]))
    write_part(tmp_path, 2, {"out": values[5:]})

    manifest = finalize_outputs(tmp_path, [(0, 2), (2, 5), (5, 8)], ["out"], EXTRA)

    assert copied == [(2 * 3 * 4, 128), (3 * 3 * 4, 128)]  # (128: where a part's data start in its file)
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), values)
    assert manifest is not None and manifest["outputs"]["out"]["checksum"] == file_checksum(tmp_path / "out.npy")


@pytest.mark.parametrize("read_bytes", [None, 40], ids=["one-read", "a-row-a-read"])
def test_a_fortran_order_part_is_merged_in_row_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     read_bytes: int | None) -> None:
    if read_bytes:
        monkeypatch.setattr(outputs, "_READ_BYTES", read_bytes)  # (a row of 32 bytes a read, each reordered)
    values = np.arange(24, dtype=np.float64).reshape(6, 4)
    write_part(tmp_path, 0, {"out": values[:2]})
    np.save(part_path(tmp_path, "out", 1), np.asfortranarray(values[2:]))  # (as another writer might)

    manifest = finalize_outputs(tmp_path, [(0, 2), (2, 6)], ["out"], EXTRA)

    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), values)
    assert manifest["outputs"]["out"]["checksum"] == file_checksum(tmp_path / "out.npy")


def test_a_kernel_copy_refused_partway_goes_on_through_python(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system may copy part of a range and then refuse (or copy nothing): the rest of the part
    goes through Python from where the kernel stopped, and the merged file and its checksum are whole."""
    kernel_copy, calls = os.copy_file_range, []

    def copies_a_little_then_refuses(source: int, target: int, count: int, offset: int) -> int:
        calls.append(count)
        if len(calls) > 1:
            raise OSError(errno.EXDEV, "refused")
        return kernel_copy(source, target, min(count, 5), offset)  # a real partial copy, 5 bytes

    monkeypatch.setattr(os, "copy_file_range", copies_a_little_then_refuses)
    values = np.arange(40, dtype=np.int32).reshape(10, 4)
    write_part(tmp_path, 0, {"out": values[:7]})
    write_part(tmp_path, 1, {"out": values[7:]})

    manifest = finalize_outputs(tmp_path, [(0, 7), (7, 10)], ["out"], EXTRA)

    assert len(calls) >= 2
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), values)
    assert manifest["outputs"]["out"]["checksum"] == file_checksum(tmp_path / "out.npy")


_CUT_WHILE_MERGED = textwrap.dedent("""
    import hashlib, os, sys
    from pathlib import Path
    from sits_worker.serving import outputs
    out, part, side = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    cut = []

    def cut_once() -> None:  # the tenant cuts the part short once the merge has begun to read it
        if not cut:
            cut.append(os.truncate(part, 4096))

    class CutOnHash:  # (the hashing thread's first block, then the part is cut)
        def __init__(self, data: bytes) -> None:
            self.digest = hashlib.sha256(data)

        def update(self, data: bytes) -> None:
            cut_once()
            self.digest.update(data)

        def hexdigest(self) -> str:
            return self.digest.hexdigest()

    class Hashlib:
        sha256 = CutOnHash

    if side == "hashed":
        outputs.hashlib = Hashlib
    else:  # (the copying thread's first 4 KiB, then the part is cut)
        outputs._COPY_BLOCK_BYTES = 4096
    try:
        outputs.finalize_outputs(out, [(0, 16384)], ["score"], {}, job_id="j1",
                                 keep_alive=cut_once if side == "copied" else lambda: None)
    except Exception as err:
        print(type(err).__name__, err)
""")


@pytest.mark.parametrize("side", ["hashed", "copied"])
def test_a_part_cut_short_while_it_is_merged_is_unreadable_not_a_crash(tmp_path: Path, side: str) -> None:
    """A part lies in the tenant's folder: mapped and cut short under the mapping, the worker dies (SIGBUS, -7)
    at the first page read past the new end, with every tenant's work on it. Read, the merge fails naming the
    part and the chunk to run again, whichever of its threads (the hash, the copy) finds it short."""
    write_part(tmp_path, 0, {"score": np.ones((16384, 64), np.float32)}, job_id="j1")  # 4 MiB: 4 reads
    part = part_path(tmp_path, "score", 0, "j1")

    done = subprocess.run([sys.executable, "-c", _CUT_WHILE_MERGED, str(tmp_path), str(part), side],
                          capture_output=True, text=True, timeout=3, cwd=Path(__file__).parents[3])

    assert done.returncode == 0, (done.returncode, done.stderr)
    # (cut short while read, or, where the other thread cut it first, before its header was checked: either names it)
    assert done.stdout.startswith(f"SitsError output part '{part}' "), done.stdout
    assert "cut short while the merge read it" in done.stdout or "bytes of data follow it" in done.stdout, done.stdout
    assert done.stdout.rstrip().endswith("delete it and run chunk 0 again"), done.stdout
    assert not (tmp_path / "manifest.json").exists()


@st.composite
def _array_and_chunks(draw: st.DrawFn) -> tuple[np.ndarray, list[tuple[int, int]]]:
    dtype = draw(st.sampled_from([np.float32, np.float64, np.int64, np.uint8, np.bool_]))
    rows = draw(st.integers(1, 40))
    row_shape = draw(st.lists(st.integers(1, 4), max_size=2))
    values = draw(hnp.arrays(dtype, (rows, *row_shape)))
    cuts = sorted(draw(st.sets(st.integers(1, rows - 1), max_size=rows - 1)) if rows > 1 else set())
    bounds = [0, *cuts, rows]
    return values, list(zip(bounds, bounds[1:], strict=False))


@settings(max_examples=60, deadline=None)
@given(_array_and_chunks())
def test_any_chunking_reproduces_the_array_exactly(case: tuple[np.ndarray, list[tuple[int, int]]]) -> None:
    values, chunks = case
    with tempfile.TemporaryDirectory() as folder:
        output_dir = Path(folder)
        for index in reversed(range(len(chunks))):
            start, stop = chunks[index]
            write_part(output_dir, index, {"out": values[start:stop]})

        manifest = finalize_outputs(output_dir, chunks, ["out"], EXTRA)

        merged = np.load(output_dir / "out.npy")
        assert merged.dtype == values.dtype and merged.shape == values.shape
        assert merged.tobytes() == values.tobytes()  # exact, NaN payloads included
        assert manifest["rows"] == len(values) and manifest["chunks"] == len(chunks)


def test_a_merge_waiting_on_the_disk_keeps_its_lease_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """An fsync (or the hash) of GBs may take longer than the lease: the wait calls `keep_alive`
    every `_WAIT_SLICE_SECONDS` until the work is done."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(outputs, "_WAIT_SLICE_SECONDS", 0.02)
    calls: list[float] = []
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(lambda: (time.sleep(0.2), "done")[1])
        assert outputs._wait(slow, lambda: calls.append(time.monotonic())) == "done"
    assert len(calls) >= 4


def test_a_split_chunks_rest_numbered_last_merges_in_row_order(tmp_path: Path) -> None:
    """Chunk 0 ended early at row 2 as it ran; its rows [2, 4) became chunk 3, after the job's last index."""
    layout = [(0, 2), (4, 8), (8, 10), (2, 4)]
    _write_all(tmp_path, layout)

    manifest = finalize_outputs(tmp_path, layout, ["logits", "label"], EXTRA)

    for name, values in _outputs(range(10)).items():
        np.testing.assert_array_equal(np.load(tmp_path / f"{name}.npy"), values)
    assert manifest["chunks"] == 4


def test_a_part_written_before_its_chunk_was_split_gives_the_chunks_rows(tmp_path: Path) -> None:
    """A run that read chunk 0 as [0, 4) wrote it whole after another run split it at 2 (its rest is chunk 3):
    the merge takes the part's first rows, and a row both runs quarantined is listed once."""
    layout = [(0, 2), (4, 8), (8, 10), (2, 4)]
    write_part(tmp_path, 0, _outputs(range(0, 4)), quarantined=[(3, "bad")])
    write_part(tmp_path, 3, _outputs(range(2, 4)), quarantined=[(3, "bad")])
    for index in (1, 2):
        write_part(tmp_path, index, _outputs(range(*layout[index])))

    manifest = finalize_outputs(tmp_path, layout, ["logits", "label"], EXTRA)

    for name, values in _outputs(range(10)).items():
        np.testing.assert_array_equal(np.load(tmp_path / f"{name}.npy"), values)
    assert manifest["quarantined_rows"] == [3]
