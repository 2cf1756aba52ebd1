"""Input files are checked against the model signature and read in row ranges as feed batches."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
import textwrap
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest

from broker.errors import BadInput, FileMissing, PathNotAllowed, RetryableError
from sits_worker.model import inputs
from sits_worker.model.inputs import file_checksum, open_input
from sits_worker.model.source import check_unchanged, file_identity
from tests.npy_files import npy_bytes, write_npz


def _signature(*inputs: tuple[str, str, list[int | str]]) -> dict:
    return {
        "inputs": [
            {
                "name": name,
                "dtype": dtype,
                "shape": shape,
                "dynamic_axes": [axis for axis, dim in enumerate(shape) if isinstance(dim, str)],
            }
            for name, dtype, shape in inputs
        ],
        "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", 10], "dynamic_axes": [0]}],
    }


PIXELS = _signature(("pixels", "float32", ["batch", 3, 4, 4]))
TOKENS = _signature(("input_ids", "int64", ["batch", "sequence"]), ("attention_mask", "int64", ["batch", "sequence"]))


def _pixels(rows: int) -> np.ndarray:
    return np.arange(rows * 48, dtype=np.float32).reshape(rows, 3, 4, 4)


def _read_all(path: Path, signature: dict, max_batch: int, **kwargs) -> list:
    with open_input(path, signature, **kwargs) as source:
        return list(source.iter_batches(0, source.rows, max_batch))


def test_npy_rows_are_read_in_row_ranges_without_loading_everything(tmp_path: Path) -> None:
    data = np.random.default_rng(0).random((4096, 3, 16, 16), dtype=np.float32)  # 12 MiB
    path = tmp_path / "images.npy"
    np.save(path, data)
    signature = _signature(("pixels", "float32", ["batch", 3, 16, 16]))

    tracemalloc.start()
    try:
        with open_input(path, signature) as source:
            batches = list(source.iter_batches(1000, 1100, 32))
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert source.rows == 4096 and source.format == ".npy" and source.input_names == ("pixels",)
    assert peak_bytes < 1 << 20  # a few batches of 32 rows (96 KiB each), not the 12 MiB file
    assert [len(rows) for rows, _ in batches] == [32, 32, 32, 4]
    row_indices = np.concatenate([rows for rows, _ in batches])
    assert row_indices.dtype == np.int64 and row_indices.tolist() == list(range(1000, 1100))
    for rows, feed in batches:
        assert feed["pixels"].dtype == np.float32 and feed["pixels"].flags.c_contiguous
        np.testing.assert_array_equal(feed["pixels"], data[rows])


def test_npy_batches_are_read_only_views_of_one_read_that_outlive_close(tmp_path: Path) -> None:
    np.save(tmp_path / "images.npy", _pixels(10))

    with open_input(tmp_path / "images.npy", PIXELS) as source:
        batches = list(source.iter_batches(2, 10, 4))

    for rows, feed in batches:  # no copy per batch: views of the rows read for the chunk
        pixels = feed["pixels"]
        assert type(pixels) is np.ndarray and not pixels.flags.owndata and not pixels.flags.writeable
        assert pixels.flags.c_contiguous and pixels.dtype == np.float32
        np.testing.assert_array_equal(pixels, _pixels(10)[rows])  # still there after close()
    assert batches[0][1]["pixels"].base is batches[1][1]["pixels"].base


def test_a_chunk_of_array_rows_is_one_read_of_its_own_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the worker does per chunk: 4,096 rows of 64 float32 in mini-batches of 256 are one 1 MiB read."""
    values = np.random.default_rng(0).random((10_000, 64), dtype=np.float32)
    np.save(tmp_path / "rows.npy", values)
    reads: list[tuple[int, int]] = []
    preadv = os.preadv

    def counted(fd: int, buffers: list, offset: int) -> int:
        reads.append((offset, sum(len(buffer) for buffer in buffers)))
        return preadv(fd, buffers, offset)

    monkeypatch.setattr(inputs.os, "preadv", counted)
    with open_input(tmp_path / "rows.npy", _signature(("x", "float32", ["batch", 64]))) as source:
        batches = list(source.iter_batches(4096, 8192, 256))

    assert reads == [(128 + 4096 * 256, 4096 * 256)]  # (after the 128-byte header)
    assert [len(rows) for rows, _ in batches] == [256] * 16
    np.testing.assert_array_equal(np.concatenate([feed["x"] for _, feed in batches]), values[4096:8192])


def test_rows_are_read_in_pieces_of_whole_mini_batches_when_a_range_is_large(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inputs, "_READ_BYTES", 5 * 192)  # five rows of pixels: four, whole mini-batches
    np.save(tmp_path / "images.npy", _pixels(11))

    with open_input(tmp_path / "images.npy", PIXELS) as source:
        batches = list(source.iter_batches(1, 11, 2))

    assert len({id(feed["pixels"].base) for _, feed in batches}) == 3  # rows 1-4, 5-8, 9-10
    np.testing.assert_array_equal(np.concatenate([feed["pixels"] for _, feed in batches]), _pixels(11)[1:])


def test_a_source_closed_while_a_chunk_reads_it_keeps_that_read_going(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker closes the least recent of the inputs it keeps open, maybe one a chunk is reading."""
    monkeypatch.setattr(inputs, "_READ_BYTES", 2 * 192)  # two rows of pixels
    np.save(tmp_path / "images.npy", _pixels(10))
    source = open_input(tmp_path / "images.npy", PIXELS)
    batches = source.iter_batches(0, 10, 2)
    first = next(batches)
    source.close()

    rest = list(batches)

    np.testing.assert_array_equal(np.concatenate([feed["pixels"] for _, feed in [first, *rest]]), _pixels(10))
    with pytest.raises(ValueError, match="closed"):
        next(source.iter_batches(0, 2, 2))


@pytest.mark.parametrize("suffix", [".npy", ".npz"])
def test_fortran_order_arrays_are_read_in_row_order(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"images{suffix}"
    np.save(path, np.asfortranarray(_pixels(9))) if suffix == ".npy" else np.savez(
        path, pixels=np.asfortranarray(_pixels(9)))

    with open_input(path, PIXELS) as source:
        batches = list(source.iter_batches(2, 9, 3))

    assert all(feed["pixels"].flags.c_contiguous for _, feed in batches)
    np.testing.assert_array_equal(np.concatenate([feed["pixels"] for _, feed in batches]), _pixels(9)[2:])


_READ_AFTER_A_CUT = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from sits_worker.model.inputs import open_input
    path, signature = Path(sys.argv[1]), {"inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 64],
                                                      "dynamic_axes": [0]}], "outputs": []}
    source = open_input(path, signature)
    os.truncate(path, 4096)  # the tenant cuts its file short while the job runs
    try:
        for _, feed in source.iter_batches(3000, 4000, 256):  # a chunk past the cut, in mini-batches
            feed["x"].sum()  # (as onnxruntime reads them)
    except Exception as err:
        print(type(err).__name__, getattr(err, "message", err))
""")


@pytest.mark.parametrize("suffix", [".npy", ".bin", ".npz"])
def test_an_array_file_cut_short_after_open_is_an_error_to_retry_not_a_crash(tmp_path: Path, suffix: str) -> None:
    """A mapped file cut short kills the worker (SIGBUS, -7) at the first page read past its new end, with
    every tenant's work on it; read, it is an error to retry, and the retry's check fails the job."""
    path, values = tmp_path / f"in{suffix}", np.ones((4096, 64), np.float32)
    np.save(path, values) if suffix == ".npy" else np.savez(path, x=values) if suffix == ".npz" else (
        path.write_bytes(values.tobytes()))
    submitted = file_identity(path)

    done = subprocess.run([sys.executable, "-c", _READ_AFTER_A_CUT, str(path)], capture_output=True, text=True,
                          timeout=3, cwd=Path(__file__).parents[3])

    assert done.returncode == 0, (done.returncode, done.stderr)
    assert done.stdout.startswith(f"RetryableError reading '{path}' failed (rows [3000, 4000) of array 'x' end "
                                  "past the file's 4,096 bytes; the file changed since it was opened)"), done.stdout
    with pytest.raises(BadInput, match=r"changed after the job was submitted \(size [0-9,]+ -> 4,096 bytes"):
        check_unchanged(path, submitted)


def test_a_compressed_npz_cut_short_after_open_is_an_error_to_retry_not_a_corrupt_file(tmp_path: Path) -> None:
    """Its member is read whole at the first chunk: cut short before that, it read as corrupt (a BadInput, whose
    rows the bad-row search then tried one by one, inflating the member again each time)."""
    path = tmp_path / "in.npz"
    np.savez_compressed(path, x=np.random.default_rng(0).standard_normal((4096, 64)).astype(np.float32))
    source = open_input(path, {"inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 64],
                                           "dynamic_axes": [0]}], "outputs": []})
    os.truncate(path, 4096)

    with source, pytest.raises(RetryableError, match="the file changed since it was opened"):
        list(source.iter_batches(0, 100, 50))


def test_an_npz_member_whose_data_would_run_past_the_file_is_refused_at_open(tmp_path: Path) -> None:
    """The zip directory may claim a member larger than what follows it: its sizes and its npy header
    agree, but the data would end past the file's end."""
    def member(rows: int) -> bytes:
        return npy_bytes(f"{{'descr': '<f4', 'fortran_order': False, 'shape': ({rows}, 1), }}", bytes(8))

    size = write_npz(tmp_path / "long.npz", member(2), zipfile.ZIP_STORED, name="x.npy").stat().st_size
    path = write_npz(tmp_path / "long.npz", member((size - 128) // 4), zipfile.ZIP_STORED, name="x.npy")
    raw = bytearray(path.read_bytes())  # (the same size: the npy header is 128 bytes either way)
    local, central = raw.index(b"PK\x03\x04"), raw.index(b"PK\x01\x02")
    claimed = struct.pack("<II", size, size)
    raw[local + 18 : local + 26], raw[central + 20 : central + 28] = claimed, claimed  # compressed, uncompressed
    path.write_bytes(bytes(raw))

    with pytest.raises(BadInput, match=r"array 'x' in 'long.npz' is unreadable \(its data run past the end"):
        open_input(path, _signature(("x", "float32", ["batch", 1])))


def test_an_unaligned_npz_member_is_fed_as_aligned_copies(tmp_path: Path) -> None:
    values = np.arange(30, dtype=np.float32).reshape(10, 3)
    np.savez(tmp_path / "rows.npz", pix=values)  # "pix.npy" puts the member's data at an odd offset
    signature = _signature(("pix", "float32", ["batch", 3]))

    with open_input(tmp_path / "rows.npz", signature) as source:
        assert source._array("pix").offset % 4
        batches = list(source.iter_batches(0, 10, 4))

    assert all(feed["pix"].flags.aligned and feed["pix"].flags.c_contiguous for _, feed in batches)
    np.testing.assert_array_equal(np.concatenate([feed["pix"] for _, feed in batches]), values)


def test_wrong_dtype_is_rejected_with_a_message_naming_the_input(tmp_path: Path) -> None:
    np.save(tmp_path / "images.npy", _pixels(8).astype(np.float64))
    np.savez(tmp_path / "images.npz", pixels=_pixels(8).astype(np.int64))

    with pytest.raises(BadInput) as npy_error:
        open_input(tmp_path / "images.npy", PIXELS)
    with pytest.raises(BadInput) as npz_error:
        open_input(tmp_path / "images.npz", PIXELS)

    assert "input 'pixels' expects float32 [N,3,4,4], got float64 [8,3,4,4]" in npy_error.value.message
    assert "arr.astype(np.float32)" in npy_error.value.message
    assert "input 'pixels' expects float32 [N,3,4,4], got int64 [8,3,4,4]" in npz_error.value.message


def test_byte_order_alone_is_not_a_cast(tmp_path: Path) -> None:
    np.save(tmp_path / "images.npy", _pixels(5).astype(">f4"))

    batches = _read_all(tmp_path / "images.npy", PIXELS, 4)

    assert all(feed["pixels"].dtype == np.dtype("float32") for _, feed in batches)
    np.testing.assert_array_equal(np.concatenate([feed["pixels"] for _, feed in batches]), _pixels(5))


def test_wrong_per_sample_shape_is_rejected(tmp_path: Path) -> None:
    np.save(tmp_path / "short.npy", _pixels(8)[:, :, :, :3])
    np.save(tmp_path / "flat.npy", _pixels(8).reshape(8, 48))

    with pytest.raises(BadInput, match=r"expects float32 \[N,3,4,4\], got float32 \[8,3,4,3\]"):
        open_input(tmp_path / "short.npy", PIXELS)
    with pytest.raises(BadInput, match=r"got float32 \[8,48\].*each row must have shape \[3,4,4\]"):
        open_input(tmp_path / "flat.npy", PIXELS)


def test_dynamic_dims_accept_any_length_empty_included(tmp_path: Path) -> None:
    """A dynamic axis may be empty (a cache on a first step); a fixed one must match."""
    signature = _signature(("features", "float32", ["batch", "width"]))
    np.save(tmp_path / "wide.npy", np.ones((3, 17), np.float32))
    np.save(tmp_path / "zero.npy", np.ones((3, 0), np.float32))

    assert open_input(tmp_path / "wide.npy", signature).rows == 3
    with open_input(tmp_path / "zero.npy", signature) as source:
        [(rows, feed)] = list(source.iter_batches(0, 3, 8))
    assert feed["features"].shape == (3, 0)


def test_npy_needs_a_single_input_model(tmp_path: Path) -> None:
    np.save(tmp_path / "ids.npy", np.ones((2, 4), np.int64))

    with pytest.raises(BadInput, match=r"use \.npz with one array per input"):
        open_input(tmp_path / "ids.npy", TOKENS)


def test_npz_requires_one_array_per_model_input(tmp_path: Path) -> None:
    ids = np.arange(24, dtype=np.int64).reshape(6, 4)
    np.savez(tmp_path / "missing.npz", input_ids=ids)
    np.savez(tmp_path / "extra.npz", input_ids=ids, attention_mask=ids, token_type_ids=ids)
    np.savez(tmp_path / "uneven.npz", input_ids=ids, attention_mask=ids[:5])
    np.savez(tmp_path / "stored.npz", input_ids=ids, attention_mask=ids * 2)
    np.savez_compressed(tmp_path / "compressed.npz", input_ids=ids, attention_mask=ids * 2)

    for name in ("missing.npz", "extra.npz"):
        with pytest.raises(BadInput, match=r"named \['input_ids', 'attention_mask'\]"):
            open_input(tmp_path / name, TOKENS)
    with pytest.raises(BadInput, match="different row counts"):
        open_input(tmp_path / "uneven.npz", TOKENS)
    for name in ("stored.npz", "compressed.npz"):
        with open_input(tmp_path / name, TOKENS) as source:
            assert source.rows == 6 and source.format == ".npz"
            batches = list(source.iter_batches(1, 6, 4))
        assert [rows.tolist() for rows, _ in batches] == [[1, 2, 3, 4], [5]]
        np.testing.assert_array_equal(batches[0][1]["input_ids"], ids[1:5])
        np.testing.assert_array_equal(batches[1][1]["attention_mask"], ids[5:] * 2)


def test_bin_uses_model_shape_or_explicit_shape(tmp_path: Path) -> None:
    (tmp_path / "images.bin").write_bytes(_pixels(7).astype("<f4").tobytes())
    features = np.arange(15, dtype=np.float32).reshape(3, 5)
    (tmp_path / "features.bin").write_bytes(features.tobytes())
    dynamic = _signature(("features", "float32", ["batch", "width"]))

    fixed_batches = _read_all(tmp_path / "images.bin", PIXELS, 4)
    np.testing.assert_array_equal(np.concatenate([feed["pixels"] for _, feed in fixed_batches]), _pixels(7))
    with pytest.raises(BadInput, match="pass the per-row shape"):
        open_input(tmp_path / "features.bin", dynamic)
    explicit_batches = _read_all(tmp_path / "features.bin", dynamic, 8, shape=[5])
    np.testing.assert_array_equal(explicit_batches[0][1]["features"], features)
    with pytest.raises(BadInput, match=r"not a multiple of one float32 row of shape \[4\] \(16 bytes\)"):
        open_input(tmp_path / "features.bin", dynamic, shape=[4])
    with pytest.raises(BadInput, match=r"expects float32 \[N,3,4,4\], got float32 \[N,3,8\]"):
        open_input(tmp_path / "images.bin", PIXELS, shape=[3, 8])
    with pytest.raises(BadInput, match="convert the file to float32"):
        open_input(tmp_path / "images.bin", PIXELS, dtype="float64")
    with pytest.raises(BadInput, match="only to raw .bin input"):
        open_input(tmp_path / "x.npy", PIXELS, shape=[3, 4, 4])


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _tokens(length: int, start: int) -> dict:
    return {"input_ids": list(range(start, start + length)), "attention_mask": [1] * length}


def test_jsonl_variable_lengths_are_grouped_by_shape(tmp_path: Path) -> None:
    lengths = [3, 5, 3, 5, 3, 2, 5]
    rows = [_tokens(length, 100 * row) for row, length in enumerate(lengths)]
    path = tmp_path / "tokens.jsonl"
    _write_jsonl(path, rows[:3])
    with path.open("a") as handle:  # blank lines are not rows
        handle.write("\n" + "".join(json.dumps(row) + "\n" for row in rows[3:]))

    with open_input(path, TOKENS) as source:
        assert source.rows == 7 and source.format == ".jsonl"
        batches = list(source.iter_batches(1, 7, 2))

    assert [rows.tolist() for rows, _ in batches] == [[1, 3], [6], [2, 4], [5]]
    for row_indices, feed in batches:
        assert feed["input_ids"].dtype == np.int64 and feed["input_ids"].flags.c_contiguous
        expected = [rows[row]["input_ids"] for row in row_indices]
        np.testing.assert_array_equal(feed["input_ids"], np.array(expected))
        assert feed["attention_mask"].shape == feed["input_ids"].shape


def test_jsonl_rows_are_checked_when_read(tmp_path: Path) -> None:
    path = tmp_path / "tokens.jsonl"
    _write_jsonl(
        path,
        [_tokens(3, 0), {"input_ids": [1.5, 2.0], "attention_mask": [1, 1]}, {"input_ids": [1]}],
    )
    _write_jsonl(tmp_path / "bad_first.jsonl", [{"input_ids": [[1, 2], [3]], "attention_mask": [1]}])

    with open_input(path, TOKENS) as source:  # only the first row is checked at open
        with pytest.raises(BadInput, match=r"list of int64 values in row 1 of 'tokens.jsonl'"):
            list(source.iter_batches(0, 2, 8))
        with pytest.raises(BadInput, match=r"got keys \['input_ids'\] in row 2"):
            list(source.iter_batches(2, 3, 8))
    with pytest.raises(BadInput, match="expects a rectangular"):
        open_input(tmp_path / "bad_first.jsonl", TOKENS)


def test_empty_inputs_unknown_formats_and_missing_files_are_rejected(tmp_path: Path) -> None:
    np.save(tmp_path / "empty.npy", np.ones((0, 3, 4, 4), np.float32))
    (tmp_path / "empty.bin").write_bytes(b"")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    (tmp_path / "images.xlsx").write_text("1,2,3\n")

    for name in ("empty.npy", "empty.bin", "empty.jsonl"):
        with pytest.raises(BadInput, match="has no rows"):
            open_input(tmp_path / name, PIXELS if name != "empty.jsonl" else TOKENS)
    with pytest.raises(BadInput, match=r"unsupported format '\.xlsx'; use one of \.npy, \.npz, \.bin, \.jsonl"):
        open_input(tmp_path / "images.xlsx", PIXELS)
    with pytest.raises(FileMissing):
        open_input(tmp_path / "absent.npy", PIXELS)


def test_a_range_past_the_end_means_the_file_changed(tmp_path: Path) -> None:
    np.save(tmp_path / "images.npy", _pixels(4))

    with open_input(tmp_path / "images.npy", PIXELS) as source, pytest.raises(BadInput, match="changed"):
        list(source.iter_batches(2, 6, 2))


def test_file_checksum_is_the_sha256_of_the_bytes(tmp_path: Path) -> None:
    payload = bytes(range(256)) * 9000  # more than one 1 MiB block
    (tmp_path / "blob.bin").write_bytes(payload)

    assert file_checksum(tmp_path / "blob.bin") == "sha256:" + hashlib.sha256(payload).hexdigest()
    with pytest.raises(FileMissing):
        file_checksum(tmp_path / "absent.bin")


def test_jsonl_ranges_read_from_several_threads_at_once_stay_intact(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    _write_jsonl(tmp_path / "t.jsonl", [_tokens(1 + i % 7, i) for i in range(400)])
    with open_input(tmp_path / "t.jsonl", TOKENS) as source:

        def read(start: int) -> list[tuple[list[int], list]]:
            batches = source.iter_batches(start, start + 50, 8)
            return [(rows.tolist(), feed["input_ids"].tolist()) for rows, feed in batches]

        expected = [read(start) for start in range(0, 400, 50)]
        with ThreadPoolExecutor(4) as pool:
            for _ in range(5):
                assert list(pool.map(read, range(0, 400, 50))) == expected


# --- opened without following a link, and the file submitted --------------------------------


def _saved(tmp_path: Path, name: str) -> Path:
    """An input of every format the signature `PIXELS` or `TOKENS` reads, as `name` says."""
    path = tmp_path / name
    if name.endswith(".npy"):
        np.save(path, _pixels(4))
    elif name.endswith(".npz"):
        np.savez(path, pixels=_pixels(4))
    elif name.endswith(".bin"):
        path.write_bytes(_pixels(4).tobytes())
    else:
        _write_jsonl(path, [_tokens(3, row) for row in range(4)])
    return path


@pytest.mark.parametrize("name", ["in.npy", "in.npz", "in.bin", "in.jsonl"])
def test_an_input_that_is_a_link_is_refused_and_one_that_is_the_submitted_file_is_read(
        tmp_path: Path, name: str) -> None:
    path = _saved(tmp_path, name)
    signature = TOKENS if name.endswith(".jsonl") else PIXELS
    (tmp_path / f"link-{name}").symlink_to(path)

    with pytest.raises(PathNotAllowed, match=r"input '.*/link-in\.[a-z]+' is a symbolic link"):
        open_input(tmp_path / f"link-{name}", signature)
    with pytest.raises(PathNotAllowed, match="is a symbolic link"):
        file_checksum(tmp_path / f"link-{name}")
    with pytest.raises(PathNotAllowed, match="is a symbolic link"):
        check_unchanged(tmp_path / f"link-{name}", file_identity(path))
    assert len(_read_all(path, signature, 2, identity=file_identity(path))) == 2


def test_an_input_opened_is_checked_against_the_identity_submitted(tmp_path: Path) -> None:
    """The file at the path when the worker opens it must be the one submitted: the check is on the
    opened file (`os.fstat`), so nothing can swap the path between the check and the open."""
    path = _saved(tmp_path, "in.npy")
    submitted = file_identity(path)
    path.rename(tmp_path / "aside.npy")
    np.save(path, _pixels(4) + 1)  # same size, another file

    with pytest.raises(BadInput, match=r"input '.*/in\.npy' changed after the job was submitted"):
        open_input(path, PIXELS, identity=submitted)
    assert len(_read_all(path, PIXELS, 4)) == 1  # without an identity (at submit), any regular file
