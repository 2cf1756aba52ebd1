"""Malformed and lying inputs are refused as BadInput by the decoders, before anything is allocated or queued."""

from __future__ import annotations

import base64
import io
import json
import math
import struct
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper

from broker.errors import BadInput
from sits_worker.device.pinning import Device
from sits_worker.device.runtime import build_session, run_session
from sits_worker.model.graph import model_signature
from sits_worker.model.inputs import open_input
from sits_worker.model.servable import check_servable
from sits_worker.model.tensors import request_tensors
from tests.npy_files import float32_header, npy_bytes, write_npz

FEATURES = {
    "inputs": [{"name": "features", "dtype": "float32", "shape": ["batch", 64], "dynamic_axes": [0]}],
    "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", 10], "dynamic_axes": [0]}],
}
HUGE_ROWS = 100_000_000_000
MALFORMED_HEADERS = [
    "{'descr': 'zz', 'fortran_order': False, 'shape': (",  # tokenize.TokenError inside numpy
    "{'descr': 'zz', 'fortran_order': False}",  # ValueError: keys missing
    "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 64)} + 1",  # not a literal
    "(" * 150,  # deep nesting
]


def lying_npy(rows: int = HUGE_ROWS, data: bytes = b"") -> bytes:
    return npy_bytes(float32_header(f"({rows}, 64)"), data)


def b64(raw: bytes) -> dict[str, str]:
    return {"b64": base64.b64encode(raw).decode()}


def npy_of(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


# --- 1: headers that claim more data than the file holds -------------------------------------


@pytest.mark.parametrize("method", [zipfile.ZIP_DEFLATED, zipfile.ZIP_STORED], ids=["deflated", "stored"])
def test_an_npz_member_whose_header_claims_more_rows_than_it_holds_is_refused_at_once(
        tmp_path: Path, method: int) -> None:
    path = write_npz(tmp_path / "lie.npz", lying_npy(data=bytes(64 * 4)), method)

    started = time.monotonic()
    with pytest.raises(BadInput) as error:
        open_input(path, FEATURES)

    assert time.monotonic() - started < 1  # from the zip directory: nothing decompressed, nothing chunked
    message = error.value.message
    assert "array 'features' in 'lie.npz'" in message and f"[{HUGE_ROWS}, 64]" in message
    assert "256 bytes of data follow" in message and "np.savez" in message


def test_an_npz_whose_zip_directory_also_lies_about_the_member_size_is_refused(tmp_path: Path) -> None:
    path = write_npz(tmp_path / "lie.npz", lying_npy(data=bytes(256)))
    raw = bytearray(path.read_bytes())
    claimed = struct.pack("<I", 0xFFFFFFF0)
    local, central = raw.index(b"PK\x03\x04"), raw.index(b"PK\x01\x02")
    raw[local + 22 : local + 26] = claimed  # uncompressed size, local header
    raw[central + 24 : central + 28] = claimed  # uncompressed size, central directory
    path.write_bytes(bytes(raw))
    assert zipfile.ZipFile(path).getinfo("features.npy").file_size == 0xFFFFFFF0

    with pytest.raises(BadInput, match=r"\[100000000000, 64\].* bytes of data follow"):
        open_input(path, FEATURES)


def test_an_npz_member_compressed_with_lzma_is_refused_saying_how_to_write_it(tmp_path: Path) -> None:
    path = write_npz(tmp_path / "lzma.npz", npy_of(np.zeros((4, 64), np.float32)), zipfile.ZIP_LZMA)

    with pytest.raises(BadInput, match="compressed with zip method 14; write it again with np.savez"):
        open_input(path, FEATURES)


@pytest.mark.parametrize("suffix", [".npy", ".npz"])
def test_a_negative_dimension_in_a_header_is_refused(tmp_path: Path, suffix: str) -> None:
    member = npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (-5, 64), }")
    path = tmp_path / f"negative{suffix}"
    path.write_bytes(member) if suffix == ".npy" else write_npz(path, member)

    with pytest.raises(BadInput, match=r"negative dimension in its header shape \[-5, 64\]"):
        open_input(path, FEATURES)


def test_a_truncated_npy_file_is_refused_naming_the_sizes(tmp_path: Path) -> None:
    (tmp_path / "cut.npy").write_bytes(npy_of(np.zeros((10, 64), np.float32))[:-4])

    with pytest.raises(BadInput, match=r"'cut.npy' has a header claiming float32 \[10, 64\] \(2,560 bytes\), "
                                       r"but only 2,556 bytes"):
        open_input(tmp_path / "cut.npy", FEATURES)


def test_a_b64_tensor_whose_header_claims_a_huge_shape_is_refused_before_allocating() -> None:
    with pytest.raises(BadInput, match=r"input 'features' has a header claiming float32 \[100000000000, 64\]"):
        request_tensors(FEATURES, {"features": b64(lying_npy())})


def test_valid_stored_and_compressed_npz_and_b64_inputs_still_read() -> None:
    values = np.arange(3 * 64, dtype=np.float32).reshape(3, 64)
    np.testing.assert_array_equal(request_tensors(FEATURES, {"features": b64(npy_of(values))})["features"], values)
    for layout in (np.asfortranarray(values), values.astype(">f4")):  # column-major; big-endian
        read = request_tensors(FEATURES, {"features": b64(npy_of(layout))})["features"]
        np.testing.assert_array_equal(read, values)
        assert read.flags.c_contiguous and read.dtype == np.float32 and read.dtype.isnative


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
def test_valid_npz_inputs_still_read(tmp_path: Path, save: Any) -> None:
    values = np.arange(5 * 64, dtype=np.float32).reshape(5, 64)
    save(tmp_path / "ok.npz", features=values)

    with open_input(tmp_path / "ok.npz", FEATURES) as source:
        batches = list(source.iter_batches(0, source.rows, 2))

    np.testing.assert_array_equal(np.concatenate([feed["features"] for _, feed in batches]), values)


# --- 2: headers numpy cannot parse ----------------------------------------------------------


@pytest.mark.parametrize("header", MALFORMED_HEADERS)
def test_a_malformed_npy_header_is_bad_input_naming_the_file(tmp_path: Path, header: str) -> None:
    (tmp_path / "bad.npy").write_bytes(npy_bytes(header, bytes(256)))

    with pytest.raises(BadInput, match=r"'bad.npy' has a malformed \.npy header .*write it with np.save"):
        open_input(tmp_path / "bad.npy", FEATURES)


@pytest.mark.parametrize("header", MALFORMED_HEADERS)
def test_a_malformed_npz_member_header_is_bad_input_naming_the_array(tmp_path: Path, header: str) -> None:
    path = write_npz(tmp_path / "bad.npz", npy_bytes(header, bytes(256)))

    with pytest.raises(BadInput, match=r"array 'features' in 'bad.npz' has a malformed \.npy header"):
        open_input(path, FEATURES)


@pytest.mark.parametrize("header", MALFORMED_HEADERS)
def test_a_malformed_b64_npy_header_is_bad_input_naming_the_input(header: str) -> None:
    with pytest.raises(BadInput, match=r"input 'features' has a malformed \.npy header .*encode it with np.save"):
        request_tensors(FEATURES, {"features": b64(npy_bytes(header, bytes(256)))})


def test_b64_that_is_not_npy_or_not_base64_is_bad_input() -> None:
    with pytest.raises(BadInput, match="is not base64"):
        request_tensors(FEATURES, {"features": {"b64": "not base64!"}})
    with pytest.raises(BadInput, match="malformed .npy header"):
        request_tensors(FEATURES, {"features": b64(b"PK\x03\x04 an npz, not an npy")})
    with pytest.raises(BadInput, match="holds Python objects"):
        request_tensors(FEATURES, {"features": b64(npy_bytes("{'descr': '|O', 'fortran_order': False, "
                                                             "'shape': (1, 64), }", bytes(512)))})


# --- 4: JSON numbers that are not finite or do not fit the dtype ----------------------------


@pytest.mark.parametrize("bad", [1e308, -1e39, math.inf, -math.inf, math.nan])
def test_json_numbers_that_are_not_finite_or_overflow_float32_are_refused(bad: float) -> None:
    row = [0.5] * 63 + [bad]

    with pytest.raises(BadInput, match="input 'features' holds a value that is not finite or does not fit "
                                       "float32 in the request"):
        request_tensors(FEATURES, {"features": [row]})


def test_json_nan_and_overflow_parsed_from_text_are_refused() -> None:
    for text in ("NaN", "Infinity", "1e400", "1e308"):
        row = json.loads("[" + ", ".join(["0.5"] * 63 + [text]) + "]")
        with pytest.raises(BadInput, match="not finite or does not fit float32"):
            request_tensors(FEATURES, {"features": [row]})


def test_the_range_is_the_target_dtypes() -> None:
    wide = {"inputs": [{**FEATURES["inputs"][0], "dtype": "float64"}], "outputs": FEATURES["outputs"]}
    half = {"inputs": [{**FEATURES["inputs"][0], "dtype": "float16"}], "outputs": FEATURES["outputs"]}

    assert request_tensors(wide, {"features": [[1e308] * 64]})["features"].dtype == np.float64
    with pytest.raises(BadInput, match="does not fit float16"):
        request_tensors(half, {"features": [[70000.0] * 64]})
    with pytest.raises(BadInput, match="does not fit float16"):
        request_tensors(half, {"features": [[70000] * 64]})  # ints too


def test_typed_json_tensors_of_the_v2_protocol_follow_the_json_rule() -> None:
    with np.errstate(over="ignore"):
        overflowed = np.asarray([[1e308] * 64], dtype=np.float32)  # how v2 reads its JSON data

    with pytest.raises(BadInput, match="not finite or does not fit float32"):
        request_tensors(FEATURES, {"features": overflowed})


def test_b64_npy_arrays_carry_nan_and_inf_as_they_are() -> None:
    values = np.full((2, 64), np.nan, np.float32)
    values[1] = np.inf  # typed data: no conversion happens, and a model may read NaN as "missing"

    got = request_tensors(FEATURES, {"features": b64(npy_of(values))})["features"]

    np.testing.assert_array_equal(got, values)


def test_a_jsonl_row_holding_a_number_float32_cannot_hold_is_refused_naming_its_line(tmp_path: Path) -> None:
    (tmp_path / "rows.jsonl").write_text("{\"features\": [" + ", ".join(["1e39"] * 64) + "]}\n")

    with pytest.raises(BadInput, match=r"does not fit float32 in row 0 of 'rows.jsonl' \(line 1\)"):
        open_input(tmp_path / "rows.jsonl", FEATURES)


# --- 5: jsonl messages name the file's line --------------------------------------------------


def test_jsonl_errors_name_the_files_1_based_line_counting_blank_lines(tmp_path: Path) -> None:
    good = json.dumps({"features": [0.5] * 64})
    lines = ["", good, good, "", "", "{not json", good, "   ", '{"feature": []}']
    (tmp_path / "rows.jsonl").write_text("\n".join(lines) + "\n")

    with open_input(tmp_path / "rows.jsonl", FEATURES) as source:
        assert source.rows == 5
        with pytest.raises(BadInput, match=r"invalid JSON in row 2 of 'rows.jsonl' \(line 6\)"):
            list(source.iter_batches(0, 3, 8))
        with pytest.raises(BadInput, match=r"got keys \['feature'\] in row 4 of 'rows.jsonl' \(line 9\)"):
            list(source.iter_batches(4, 5, 8))
        assert [rows.tolist() for rows, _ in source.iter_batches(0, 2, 8)] == [[0, 1]]


def test_integers_beyond_int64_are_read_exactly_for_a_uint64_input_and_refused_elsewhere() -> None:
    """numpy reads [2**63, 1] as float64; for a uint64 target the values are ints that fit, so they pass."""
    from sits_worker.model.tensors import fits_exactly, json_numbers

    uint64, int64 = np.dtype("uint64"), np.dtype("int64")
    raw = json_numbers([[2**63, 1]], uint64)
    assert raw.dtype == uint64 and fits_exactly(raw, uint64) and raw[0, 0] == 2**63
    assert not fits_exactly(json_numbers([2**63, 1], int64), int64)
    assert not fits_exactly(json_numbers([2**64, 1], uint64), uint64)
    assert not fits_exactly(json_numbers([1.5, 2**63], uint64), uint64)


def test_jsonl_rows_keep_nan_and_infinity_as_written_but_refuse_overflow(tmp_path: Path) -> None:
    """Python's json writes NaN and Infinity; a .jsonl job file may hold them as a .npy may. A finite
    number float32 cannot hold (1e39) would silently become inf: refused."""
    from sits_worker.model.graph import static_profile
    from sits_worker.model.zoo import build_model

    signature = static_profile(build_model("mlp"))["signature"]
    row = [0.5] * 64
    (tmp_path / "nan.jsonl").write_text(json.dumps({"features": [math.nan, math.inf] + row[2:]}) + "\n")
    with open_input(tmp_path / "nan.jsonl", signature) as source:
        (_, feed), = source.iter_batches(0, 1, 8)
        assert np.isnan(feed["features"][0, 0]) and np.isinf(feed["features"][0, 1])
    (tmp_path / "big.jsonl").write_text(json.dumps({"features": [1e39] + row[1:]}) + "\n")
    with pytest.raises(BadInput, match="does not fit float32"):
        with open_input(tmp_path / "big.jsonl", signature) as source:
            list(source.iter_batches(0, 1, 8))


def test_the_api_reads_no_first_row_of_a_compressed_npz_at_submit(tmp_path: Path) -> None:
    """Its first read loads the whole member: a 10 GB array must not be decompressed in the API process
    to check one row (the worker checks every row as it reads it)."""
    rows = np.zeros((4, 64), dtype=np.float32)
    np.savez_compressed(tmp_path / "packed.npz", features=rows)
    np.savez(tmp_path / "stored.npz", features=rows)
    with open_input(tmp_path / "packed.npz", FEATURES) as packed, \
            open_input(tmp_path / "stored.npz", FEATURES) as stored:
        assert not packed.reads_rows_cheaply() and stored.reads_rows_cheaply()
        list(packed.iter_batches(0, 4, 4))
        assert packed.reads_rows_cheaply()  # loaded now


def test_an_empty_dynamic_axis_is_accepted_and_json_that_cannot_carry_it_says_how_to_send_it() -> None:
    """A key/value cache is empty on a first step: [rows, 0, 4] fits [batch, past_len, 4]; as JSON it
    reads [[], []], whose trailing axis is lost, so the message points to base64 .npy."""
    cache = {"inputs": [{"name": "past", "dtype": "float32", "shape": ["batch", "past_len", 4],
                         "dynamic_axes": [0, 1]}], "outputs": []}

    tensors = request_tensors(cache, {"past": b64(npy_of(np.zeros((2, 0, 4), np.float32)))})

    assert tensors["past"].shape == (2, 0, 4)
    with pytest.raises(BadInput, match=r"got JSON numbers \[2,0\].*cannot carry the axes after an empty one.*b64"):
        request_tensors(cache, {"past": [[], []]})


def test_a_b64_tensor_with_an_empty_axis_and_an_impossible_one_is_refused_not_built() -> None:
    """No data bounds a shape past an empty axis: numpy would refuse to build [1, 0, 2**62] (a 500)."""
    pair = {"inputs": [{"name": "pair", "dtype": "float32", "shape": ["batch", "a", "b"], "dynamic_axes": [0, 1, 2]}],
            "outputs": []}
    with pytest.raises(BadInput, match=r"input 'pair' has shape \[1, 0, 4611686018427387904\], which no tensor"):
        request_tensors(pair, {"pair": b64(npy_bytes(float32_header(f"(1, 0, {2**62})")))})


# --- 6: JSON sent the wrong way round is told what to send ------------------------------------


def signature_of(*inputs: tuple[str, str, list[int | str]]) -> dict[str, Any]:
    return {"inputs": [{"name": name, "dtype": dtype, "shape": shape,
                        "dynamic_axes": [axis for axis, dim in enumerate(shape) if isinstance(dim, str)]}
                       for name, dtype, shape in inputs], "outputs": []}


def test_a_bool_input_sent_as_json_1_and_0_is_told_to_write_true_or_false() -> None:
    flags = signature_of(("flag", "bool", ["batch", 2]))

    with pytest.raises(BadInput, match=r"list of bool values in the request; write true or false$"):
        request_tensors(flags, {"flag": [[1, 0]]})
    assert request_tensors(flags, {"flag": [[True, False]]})["flag"].tolist() == [[True, False]]


@pytest.mark.parametrize(("dtype", "example"), [("int64", "[3, 4]"), ("bool", "[true, false]")])
def test_a_one_value_per_row_input_sent_as_nested_rows_is_told_to_send_a_flat_list(dtype: str, example: str) -> None:
    scalar = signature_of(("k", dtype, ["batch"]))
    kind = "booleans" if dtype == "bool" else "numbers"

    with pytest.raises(BadInput) as refused:
        request_tensors(scalar, {"k": [[3], [4]] if dtype == "int64" else [[True], [False]]})

    assert refused.value.message == (f"input 'k' expects {dtype} [N], got JSON {kind} [2,1] in the request; each row "
                                     f"must have shape []; send a flat list, one value per row, e.g. {example}")


def test_a_jsonl_row_of_a_one_value_input_written_as_a_list_is_told_to_write_a_single_value(tmp_path: Path) -> None:
    (tmp_path / "rows.jsonl").write_text('{"k": [3]}\n')

    with pytest.raises(BadInput, match=r"got JSON numbers \[1,1\] in row 0 of 'rows.jsonl' \(line 1\); each row "
                                       r"must have shape \[\]; write a single value, e.g. 3"):
        with open_input(tmp_path / "rows.jsonl", signature_of(("k", "int64", ["batch"]))) as source:
            list(source.iter_batches(0, 1, 8))


def test_json_values_of_a_wrong_shape_are_reported_as_json_numbers_not_a_dtype() -> None:
    with pytest.raises(BadInput, match=r"expects float32 \[N,64\], got JSON numbers \[2,3\] in the request"):
        request_tensors(FEATURES, {"features": [[1, 2, 3], [4, 5, 6]]})


def loop_model() -> Any:
    """steps[1] (a Loop's trip count, fixed at one row) and x [N,4] -> y = x + steps, one Add per step."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond"], ["cond_out"]),
         helper.make_node("Add", ["acc", "one"], ["acc_out"])],
        "step",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])],
    )
    graph = helper.make_graph(
        [helper.make_node("Squeeze", ["steps"], ["trip_count"]),
         helper.make_node("Loop", ["trip_count", "", "x"], ["y"], body=body)],
        "loop",
        [helper.make_tensor_value_info("steps", TensorProto.INT64, [1]),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_an_input_fixed_at_one_row_beside_batched_ones_is_told_to_repeat_it_once_per_row(tmp_path: Path) -> None:
    """The model fixes the batch at 1 (`steps[1]`), so it runs one row at a time (`runtime.run_session`)
    and each row takes its own `steps`: repeated, the request runs, each row with its own trip count."""
    model = loop_model()
    check_servable(model)  # registration takes it: one fixed batch size, outputs following the batch
    signature = model_signature(model)
    x = [[0.0, 1.0, 2.0, 3.0]] * 3

    with pytest.raises(BadInput) as refused:
        request_tensors(signature, {"steps": [2], "x": x})
    assert refused.value.message == (
        "inputs must have the same number of rows (>= 1) on axis 0, got [1, 3]; 'steps' has a fixed first axis "
        "of 1, so the model runs one row at a time and each row needs its own copy: repeat it once per row "
        "(3 rows), e.g. 'steps': [2, 2, 2]")

    (tmp_path / "loop.onnx").write_bytes(model.SerializeToString())
    feed = request_tensors(signature, {"steps": [2, 2, 5], "x": x})
    (y,) = run_session(build_session(tmp_path / "loop.onnx", Device("cpu"), 1), feed)
    np.testing.assert_array_equal(y, np.asarray(x, np.float32) + [[2], [2], [5]])
