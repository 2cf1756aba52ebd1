"""Padding token requests into one batch: real ONNX Runtime on the zoo transformer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given
from hypothesis import strategies as st
from onnx import TensorProto, helper

from broker.errors import BadInput, InvalidModel
from sits_worker.model.graph import static_profile
from sits_worker.model.inputs import open_input
from sits_worker.model.padding import (
    MaskSpec,
    TokenLimits,
    bucket_length,
    mask_spec,
    pad_batch,
    token_limits,
    unpad_outputs,
)
from sits_worker.model.tensors import request_tensors
from sits_worker.model.zoo import build_model, build_zoo
from tests.onnx_models import int_series_model, token_model, with_looked_up_input

TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(scope="module")
def transformer(tmp_path_factory: pytest.TempPathFactory) -> tuple[ort.InferenceSession, dict[str, Any]]:
    """The zoo transformer as a worker sees it: a session on the built file, and its static profile."""
    path = build_zoo(tmp_path_factory.mktemp("zoo"))["transformer"]
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session, static_profile(onnx.load(str(path)))


def _ids(rows: int, length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 1000, (rows, length), dtype=np.int64)


def _alone(session: ort.InferenceSession, ids: np.ndarray) -> np.ndarray:
    """The reference: one request run by itself, unpadded, every token real."""
    return session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0]


def _run_padded(session: ort.InferenceSession, spec: MaskSpec,
                requests: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """What the worker does with a merged batch: pad, run once, cut back per request."""
    feed, lengths = pad_batch(requests, spec)
    names = [output.name for output in session.get_outputs()]
    outputs = dict(zip(names, session.run(names, feed), strict=True))
    rows = [next(iter(tensors.values())).shape[0] for tensors in requests]
    return unpad_outputs(outputs, lengths, rows, spec)


def test_transformer_declares_its_mask_and_pad_id(transformer: tuple[ort.InferenceSession, dict[str, Any]]) -> None:
    session, profile = transformer
    assert [(i.name, i.shape) for i in session.get_inputs()] == [
        ("input_ids", ["batch", "sequence"]), ("attention_mask", ["batch", "sequence"])]
    metadata = session.get_modelmeta().custom_metadata_map
    assert metadata["sits.attention_mask"] == "attention_mask" and metadata["sits.pad_token_id"] == "0"
    assert mask_spec(profile) == MaskSpec("attention_mask", 0, "input_ids", 1, "int64", (), ())


def test_models_without_a_declared_mask_get_no_padding_spec() -> None:
    assert mask_spec(static_profile(build_model("mlp"))) is None
    assert mask_spec(None) is None


def test_padded_batch_of_different_lengths_matches_each_request_alone(
        transformer: tuple[ort.InferenceSession, dict[str, Any]]) -> None:
    session, profile = transformer
    spec = mask_spec(profile)
    assert spec is not None
    requests = [{"input_ids": _ids(rows, length, seed)}
                for seed, (rows, length) in enumerate([(1, 5), (2, 17), (1, 30), (3, 1)])]
    feed, lengths = pad_batch(requests, spec)
    assert lengths == [5, 17, 30, 1]
    assert feed["input_ids"].shape == feed["attention_mask"].shape == (7, 30)
    assert feed["attention_mask"].sum(axis=1).tolist() == [5, 17, 17, 30, 1, 1, 1]
    assert (feed["input_ids"][0, 5:] == spec.pad_id).all()
    for tensors, result in zip(requests, _run_padded(session, spec, requests), strict=True):
        assert result["embedding"].shape == (len(tensors["input_ids"]), 64)
        np.testing.assert_allclose(result["embedding"], _alone(session, tensors["input_ids"]), **TOLERANCE)


def test_a_client_sent_mask_is_kept_and_padded_with_zeros(
        transformer: tuple[ort.InferenceSession, dict[str, Any]]) -> None:
    """A client that padded its own row to 12 tokens gets the embedding of its 9 real tokens."""
    session, profile = transformer
    spec = mask_spec(profile)
    assert spec is not None
    real = _ids(1, 9, 7)
    own_padding = np.concatenate([real, np.full((1, 3), 999, dtype=np.int64)], axis=1)
    own_mask = np.array([[1] * 9 + [0] * 3], dtype=np.int64)
    requests = [{"input_ids": own_padding, "attention_mask": own_mask}, {"input_ids": _ids(1, 20, 8)}]
    feed, lengths = pad_batch(requests, spec)
    assert lengths == [12, 20]
    assert feed["attention_mask"][0].tolist() == [1] * 9 + [0] * 11
    first, second = _run_padded(session, spec, requests)
    np.testing.assert_allclose(first["embedding"], _alone(session, real), **TOLERANCE)
    np.testing.assert_allclose(second["embedding"], _alone(session, requests[1]["input_ids"]), **TOLERANCE)


def test_requests_at_their_bucket_length_need_no_padding(
        transformer: tuple[ort.InferenceSession, dict[str, Any]]) -> None:
    session, profile = transformer
    spec = mask_spec(profile)
    assert spec is not None
    length = bucket_length(32, 512)
    assert length == 32
    requests = [{"input_ids": _ids(2, length, 1)}, {"input_ids": _ids(1, length, 2)}]
    feed, lengths = pad_batch(requests, spec)
    assert lengths == [length, length]
    np.testing.assert_array_equal(feed["input_ids"], np.concatenate([r["input_ids"] for r in requests]))
    assert (feed["attention_mask"] == 1).all()
    for tensors, result in zip(requests, _run_padded(session, spec, requests), strict=True):
        np.testing.assert_allclose(result["embedding"], _alone(session, tensors["input_ids"]), **TOLERANCE)


# --- per-token outputs ---------------------------------------------------------------------------


def _per_token_model() -> onnx.ModelProto:
    """A tiny token model with a per-token output [batch, sequence] and a pooled one [batch, 1]."""
    nodes = [
        helper.make_node("Cast", ["input_ids"], ["ids_f"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["ids_f", "mask_f"], ["per_token"]),
        helper.make_node("ReduceSum", ["per_token", "axis"], ["total"], keepdims=1),
    ]
    graph = helper.make_graph(
        nodes, "per_token",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("per_token", TensorProto.FLOAT, ["batch", "sequence"]),
         helper.make_tensor_value_info("total", TensorProto.FLOAT, ["batch", 1])],
        [helper.make_tensor(name="axis", data_type=TensorProto.INT64, dims=[1], vals=[1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    helper.set_model_props(model, {"sits.attention_mask": "attention_mask", "sits.pad_token_id": "7"})
    return model


def test_per_token_outputs_are_cut_back_to_each_request_length() -> None:
    model = _per_token_model()
    spec = mask_spec(static_profile(model))
    assert spec == MaskSpec("attention_mask", 7, "input_ids", 1, "int64", (), (("per_token", 1),))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    requests = [{"input_ids": _ids(2, 3, 1)}, {"input_ids": _ids(1, 6, 2)}]
    first, second = _run_padded(session, spec, requests)
    for tensors, result in ((requests[0], first), (requests[1], second)):
        ids = tensors["input_ids"]
        assert result["per_token"].shape == ids.shape
        np.testing.assert_array_equal(result["per_token"], ids.astype(np.float32))
        np.testing.assert_array_equal(result["total"], ids.sum(axis=1, keepdims=True).astype(np.float32))


def test_a_mask_declared_without_a_matching_input_is_an_invalid_model() -> None:
    profile = static_profile(build_model("transformer"))
    profile["metadata"]["sits.attention_mask"] = "mask"
    with pytest.raises(InvalidModel, match="sits.attention_mask='mask'"):
        mask_spec(profile)
    profile["metadata"].update({"sits.attention_mask": "attention_mask", "sits.pad_token_id": "pad"})
    with pytest.raises(InvalidModel, match="not an integer"):
        mask_spec(profile)


# --- bucket_length ---------------------------------------------------------------------------------


def test_bucket_classes_step_by_8_up_to_64_then_four_per_doubling() -> None:
    classes = sorted({bucket_length(length, 512) for length in range(1, 513)})
    assert classes == [8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512]


@given(length=st.integers(1, 4096), other=st.integers(1, 4096), max_sequence=st.integers(1, 4096))
def test_bucket_length_is_monotone_bounded_and_wastes_little(length: int, other: int, max_sequence: int) -> None:
    padded = bucket_length(length, max_sequence)
    assert length <= padded <= max(max_sequence, length)
    assert bucket_length(padded, max_sequence) == padded  # a length at its class needs no padding
    low, high = sorted((length, other))
    assert bucket_length(low, max_sequence) <= bucket_length(high, max_sequence)
    assert padded - length < 8 or (padded - length) / padded < 1 / 5
    if padded < max_sequence:
        assert padded % 8 == 0


def test_bucket_length_rejects_empty_sequences_and_odd_class_counts() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        bucket_length(0, 512)
    with pytest.raises(ValueError, match="powers of two"):
        bucket_length(10, 512, classes_per_octave=3)


# --- requests and job files without a mask ----------------------------------------------------------


def test_requests_may_leave_out_a_declared_mask_but_not_send_a_wrong_one() -> None:
    profile = static_profile(build_model("transformer"))
    spec = mask_spec(profile)
    signature = profile["signature"]
    tensors = request_tensors(signature, {"input_ids": [[1, 2, 3]]}, mask=spec)
    assert list(tensors) == ["input_ids"]
    sent = request_tensors(signature, {"input_ids": [[1, 2, 3]], "attention_mask": [[1, 1, 0]]}, mask=spec)
    assert sent["attention_mask"].dtype == np.int64
    with pytest.raises(BadInput, match="shape \\[1, 2\\] but 'input_ids' has \\[1, 3\\]"):
        request_tensors(signature, {"input_ids": [[1, 2, 3]], "attention_mask": [[1, 1]]}, mask=spec)
    with pytest.raises(BadInput, match="takes exactly"):
        request_tensors(signature, {"input_ids": [[1, 2, 3]]})  # the caller did not pass the mask spec
    with pytest.raises(BadInput, match="may be left out"):
        request_tensors(signature, {"attention_mask": [[1, 2, 3]]}, mask=spec)


def test_job_rows_are_checked_like_requests_when_read(tmp_path: Path) -> None:
    """A job's rows go through the same mask and token id checks as a request at submit (a mask of
    0 and 1, no negative id), each batch as it is read: the job fails with the rows named."""
    profile = static_profile(build_model("transformer"))
    spec, signature = mask_spec(profile), profile["signature"]
    ids = _ids(6, 4, 5)
    np.savez(tmp_path / "bad_mask.npz", input_ids=ids, attention_mask=np.full_like(ids, 2))
    ids[4, 1] = -3
    np.save(tmp_path / "bad_id.npy", ids)

    limits = token_limits(profile)
    with open_input(tmp_path / "bad_mask.npz", signature, mask=spec, limits=limits) as source:
        with pytest.raises(BadInput, match="rows 0-2 of 'bad_mask.npz'.*other than 0 and 1"):
            list(source.iter_batches(0, 6, 3))
    with open_input(tmp_path / "bad_id.npy", signature, mask=spec, limits=limits) as source:
        assert len(list(source.iter_batches(0, 3, 3))) == 1  # rows 0-2 are fine
        with pytest.raises(BadInput, match="rows 3-5 of 'bad_id.npy'.*negative token id \\(-3\\)"):
            list(source.iter_batches(3, 6, 3))


def test_rows_of_a_token_model_without_a_mask_are_checked_too(tmp_path: Path) -> None:
    """The limits hold for every token model: ids past the vocabulary, or longer than declared, fail."""
    signature = {"inputs": [{"name": "ids", "dtype": "int64", "shape": ["batch", "sequence"], "dynamic_axes": [0, 1]}],
                 "outputs": [{"name": "y", "dtype": "float32", "shape": ["batch", 4], "dynamic_axes": [0]}]}
    np.save(tmp_path / "ids.npy", np.array([[1, 2, 3], [4, 5, 10]], dtype=np.int64))
    with open_input(tmp_path / "ids.npy", signature, limits=TokenLimits("ids", 1, None, 10)) as source:
        with pytest.raises(BadInput, match="rows 0-1 of 'ids.npy'.*token id 10, but the model's vocabulary has 10"):
            list(source.iter_batches(0, 2, 2))
    with open_input(tmp_path / "ids.npy", signature, limits=TokenLimits("ids", 1, 2, None)) as source:
        with pytest.raises(BadInput, match="3 tokens long.*sits.max_sequence = 2"):
            list(source.iter_batches(0, 2, 2))
    with open_input(tmp_path / "ids.npy", signature, limits=TokenLimits("ids", 1, 3, 11)) as source:
        assert len(list(source.iter_batches(0, 2, 2))) == 1


def test_job_files_without_a_mask_get_an_all_ones_mask(tmp_path: Path) -> None:
    profile = static_profile(build_model("transformer"))
    spec, signature = mask_spec(profile), profile["signature"]
    ids = _ids(5, 6, 3)
    np.save(tmp_path / "ids.npy", ids)
    np.savez(tmp_path / "both.npz", input_ids=ids, attention_mask=np.zeros_like(ids))
    (tmp_path / "ids.jsonl").write_text("".join(json.dumps({"input_ids": row}) + "\n"
                                                for row in ([1, 2], [3, 4, 5], [6, 7])))
    with open_input(tmp_path / "ids.npy", signature, mask=spec) as source:
        (rows, feed), = source.iter_batches(0, 5, 8)
        np.testing.assert_array_equal(feed["input_ids"], ids)
        assert feed["attention_mask"].dtype == np.int64 and (feed["attention_mask"] == 1).all()
    with open_input(tmp_path / "both.npz", signature, mask=spec) as source:  # a mask in the file is used
        assert not list(source.iter_batches(0, 5, 8))[0][1]["attention_mask"].any()
    with open_input(tmp_path / "ids.jsonl", signature, mask=spec) as source:
        batches = list(source.iter_batches(0, 3, 8))
        assert [feed["attention_mask"].tolist() for _, feed in batches] == [[[1, 1], [1, 1]], [[1, 1, 1]]]


# --- token id checks need evidence of token ids ----------------------------------------------------


def test_an_int_sequence_that_holds_no_token_ids_may_be_negative() -> None:
    """An int input with a dynamic axis that feeds no embedding lookup, in a model whose metadata declares
    no token model, is no token ids: negative values pass; the declared length still holds."""
    profile = static_profile(int_series_model())
    limits = token_limits(profile)
    assert limits == TokenLimits("x", 1, None, None, False) and limits is not None and not limits.holds_token_ids
    limits.check({"x": np.array([[3, -1, 4], [-5, 9, 2]], dtype=np.int64)})
    profile["metadata"]["sits.max_sequence"] = "2"
    limits = token_limits(profile)
    assert limits is not None
    with pytest.raises(BadInput, match="3 tokens long"):
        limits.check({"x": np.array([[3, -1, 4]], dtype=np.int64)})
    with pytest.raises(BadInput, match=r"sequence is empty \(0 tokens\); send at least one token"):
        limits.check({"x": np.zeros((1, 0), dtype=np.int64)})


def test_token_ids_are_checked_where_an_embedding_lookup_or_the_metadata_says_they_are_ids() -> None:
    looked_up = token_limits(static_profile(token_model()))
    assert looked_up is not None and looked_up.vocabulary_size == 50 and looked_up.holds_token_ids
    for bad, message in (([[1, -5]], "negative token id \\(-5\\)"), ([[1, 50]], "token id 50.*has 50 ids")):
        with pytest.raises(BadInput, match=message):
            looked_up.check({"input_ids": np.array(bad, dtype=np.int64)})
    declared = static_profile(int_series_model())
    declared["metadata"]["sits.pad_token_id"] = "0"  # a pad token id declares token ids
    limits = token_limits(declared)
    assert limits is not None and limits.holds_token_ids and limits.vocabulary_size is None
    with pytest.raises(BadInput, match="negative token id"):
        limits.check({"x": np.array([[1, -5]], dtype=np.int64)})


def test_a_mask_listed_before_the_ids_still_gets_the_ids_checked_against_the_vocabulary() -> None:
    profile = static_profile(token_model(mask_first=True))
    limits = token_limits(profile)
    assert limits is not None and limits == TokenLimits("input_ids", 1, None, 50, True)
    with pytest.raises(BadInput, match="token id 60"):
        limits.check({"input_ids": np.array([[1, 60]], dtype=np.int64), "attention_mask": np.ones((1, 2), np.int64)})
    # A record profiled before: its sequence axis named the mask and no vocabulary was found. The ids are
    # still the ones checked (no negative id), and padded.
    profile |= {"sequence_axis": {"input": "attention_mask", "axis": 1}, "vocabulary_size": None}
    assert token_limits(profile) == TokenLimits("input_ids", 1, None, None, True)
    spec = mask_spec(profile)
    assert spec is not None and (spec.sequence_input, spec.axis) == ("input_ids", 1)


# --- inputs beside the ids, and masks of another length ---------------------------------------------


def test_token_type_ids_of_another_length_than_the_ids_are_refused_at_submit() -> None:
    """They are padded with the ids; one shorter was padded silently, one longer failed in the worker."""
    profile = static_profile(with_looked_up_input(token_model(), "token_type_ids", 2, first=False))
    spec = mask_spec(profile)
    assert spec is not None and ("token_type_ids", 1) in spec.other_inputs
    ids = np.array([[1, 2, 3, 4]], dtype=np.int64)
    for types in ([[0, 0, 1]], [[0, 0, 1, 1, 0]]):
        with pytest.raises(BadInput, match=r"'input_ids' holds 4 tokens per row; send one 'token_type_ids' value"):
            request_tensors(profile["signature"], {"input_ids": ids, "token_type_ids": np.array(types)}, mask=spec)
    request_tensors(profile["signature"], {"input_ids": ids, "token_type_ids": np.zeros((1, 4), np.int64)},
                    mask=spec)


def test_a_mask_whose_dim_the_exporter_named_otherwise_than_the_ids_still_pads() -> None:
    """Exporters name dims per input (`sequence_length` for the mask, `sequence` for the ids): that alone
    says nothing about the mask spanning another axis, so the model keeps its padding spec."""
    model = token_model()
    mask = next(value for value in model.graph.input if value.name == "attention_mask")
    mask.type.tensor_type.shape.dim[1].dim_param = "sequence_length"
    spec = mask_spec(static_profile(model))
    assert spec is not None and spec.pads


def test_a_jsonl_line_that_gives_the_mask_when_the_first_did_not_is_told_why(tmp_path: Path) -> None:
    profile = static_profile(token_model())
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"input_ids": [1, 2]}) + "\n"
                    + json.dumps({"input_ids": [3, 4], "attention_mask": [1, 1]}) + "\n")

    with open_input(path, profile["signature"], mask=mask_spec(profile)) as source, \
            pytest.raises(BadInput, match="the same on every line: an attention mask is given on all lines or on none"):
        list(source.iter_batches(0, 2, 8))
