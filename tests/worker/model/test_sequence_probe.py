"""Which outputs of a padded token model carry the sequence, and whether padding keeps its outputs: seen by
running it (`sequence_probe`), read by `padding.mask_spec`, and cut back by `padding.unpad_outputs`."""

from __future__ import annotations

import logging
import time
import tracemalloc
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from sits_worker.model import sequence_probe
from sits_worker.model.graph import static_profile
from sits_worker.model.padding import (
    PADDING_EXACT_KEY,
    SEQUENCE_OUTPUTS_KEY,
    MaskSpec,
    mask_spec,
    pad_batch,
    shape_bucket,
    unpad_outputs,
)
from sits_worker.model.sequence_probe import (
    PROBE_FEED_MAX_BYTES,
    SequenceProbe,
    observe_sequence_outputs,
    probe_feed,
    probe_feed_bytes,
    probe_lengths,
)
from sits_worker.model.zoo import build_model
from tests.onnx_models import last_position_model, token_model

EXPORTER_DIMS = ["sequence", "Mullast_hidden_state_dim_1", None]  # the input's name, torch's own, unnamed
CARRYING = [["last_hidden_state", 1], ["scores", 1], ["scores", 2]]
CUT = (("last_hidden_state", 1), ("scores", 1), ("scores", 2))


def _observed_profile(model: onnx.ModelProto) -> dict[str, Any]:
    """The static profile as registration stores it: with the probe's `sequence_outputs` and `padding_exact`."""
    profile = static_profile(model)
    probe = observe_sequence_outputs(model.SerializeToString(), profile)
    assert probe is not None
    profile[SEQUENCE_OUTPUTS_KEY], profile[PADDING_EXACT_KEY] = probe
    return profile


def _spec(profile: dict[str, Any]) -> MaskSpec:
    spec = mask_spec(profile)
    assert spec is not None
    return spec


@pytest.mark.parametrize("dim", EXPORTER_DIMS)
def test_outputs_that_follow_the_sequence_length_are_found_however_their_dims_are_named(dim: str | None) -> None:
    model = token_model(output_sequence_dim=dim)
    assert observe_sequence_outputs(model.SerializeToString(), static_profile(model)) == SequenceProbe(CARRYING, True)
    assert _spec(_observed_profile(model)).sequence_outputs == CUT


def test_records_without_observed_outputs_keep_matching_output_dims_by_name() -> None:
    """A record registered before the probe (or a model too large to run there) has no `sequence_outputs`:
    dims named like the input's sequence dim are cut back, others not, as before."""
    assert _spec(static_profile(token_model())).sequence_outputs == CUT
    for dim in EXPORTER_DIMS[1:]:
        assert _spec(static_profile(token_model(output_sequence_dim=dim))).sequence_outputs == ()


@pytest.mark.parametrize("dim", EXPORTER_DIMS)
def test_merged_requests_of_different_lengths_get_each_its_own_length_and_values(dim: str | None) -> None:
    model = token_model(output_sequence_dim=dim)
    spec = _spec(_observed_profile(model))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [output.name for output in session.get_outputs()]
    rng = np.random.default_rng(1)
    requests = [{"input_ids": rng.integers(1, 50, (1, length), dtype=np.int64)} for length in (5, 8, 7, 3)]
    feed, lengths = pad_batch(requests, spec)
    padded = dict(zip(names, session.run(names, feed), strict=True))
    for tensors, result in zip(requests, unpad_outputs(padded, lengths, [1] * 4, spec), strict=True):
        ids = tensors["input_ids"]
        alone = session.run(names, {"input_ids": ids, "attention_mask": np.ones_like(ids)})
        for name, expected in zip(names, alone, strict=True):
            assert result[name].shape == expected.shape, name
            np.testing.assert_allclose(result[name], expected, rtol=1e-5, atol=1e-6)


def test_the_zoo_transformer_carries_the_sequence_in_no_output() -> None:
    model = build_model("transformer")
    assert observe_sequence_outputs(model.SerializeToString(), static_profile(model)) == SequenceProbe([], True)


def _run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [output.name for output in session.get_outputs()]
    return dict(zip(names, session.run(names, feed), strict=True))


def test_a_model_that_reads_the_last_position_is_never_padded() -> None:
    """A decoder's last-token logits of a row padded on the right are a pad's: registration sees the padded
    row differ from the row alone, so requests of lengths 3 and 6 no longer share a bucket (equal ones do)."""
    model = last_position_model()
    unprobed = static_profile(model)
    spec = _spec(unprobed)  # what a record without the probe pads, to show what padding would hand back
    requests = [{"input_ids": np.array([[7, 3, 9]])}, {"input_ids": np.array([[4, 8, 2, 5, 1, 6]])}]
    feed, lengths = pad_batch(requests, spec)
    merged = unpad_outputs(_run(model, feed), lengths, [1, 1], spec)
    alone = _run(model, {"input_ids": requests[0]["input_ids"], "attention_mask": np.ones((1, 3), np.int64)})
    assert not np.allclose(merged[0]["logits"], alone["logits"])

    assert observe_sequence_outputs(model.SerializeToString(), unprobed) == SequenceProbe([], False)
    profile = _observed_profile(model)
    spec = mask_spec(profile)
    assert spec is not None and spec.pads is False  # the mask may still be left out: it is built
    short, long, long_again = (shape_bucket({"input_ids": np.ones((1, length), np.int64)}, mask_spec(profile), 512)
                               for length in (3, 6, 6))
    assert short != long == long_again


def test_the_probe_tokens_differ_from_the_pad_id() -> None:
    """With pad id 1, tokens of 1 would make the padded last position read what the real last one reads."""
    model = last_position_model()
    helper.set_model_props(model, {"sits.attention_mask": "attention_mask", "sits.pad_token_id": "1"})
    probe = observe_sequence_outputs(model.SerializeToString(), static_profile(model))
    assert probe is not None and probe.padding_exact is False


@pytest.mark.parametrize("model", [token_model(output_sequence_dim=dim) for dim in EXPORTER_DIMS]
                         + [build_model("transformer")], ids=[*map(str, EXPORTER_DIMS), "zoo_transformer"])
def test_models_whose_outputs_see_real_tokens_alone_keep_being_padded(model: onnx.ModelProto) -> None:
    profile = _observed_profile(model)
    assert profile[PADDING_EXACT_KEY] is True
    spec = _spec(profile)
    buckets = [shape_bucket({spec.sequence_input: np.ones((1, length), np.int64)}, spec, 512) for length in (3, 6)]
    assert buckets[0] == buckets[1]


def test_a_padded_run_that_fails_turns_padding_off(monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """The runs at both lengths are kept (the outputs cut back are known); the padded third run, stopped
    after PROBE_SECONDS here, would fail a worker's padded batch too."""
    runs: list[int] = []
    run_within = sequence_probe.run_within

    def third_run_stopped(*args: Any) -> list[np.ndarray]:
        runs.append(1)
        if len(runs) == 3:
            raise TimeoutError("its run outlasted PROBE_SECONDS (10 s) and was stopped")
        return run_within(*args)

    monkeypatch.setattr(sequence_probe, "run_within", third_run_stopped)
    model = token_model()
    with caplog.at_level(logging.INFO, logger=sequence_probe.__name__):
        probe = observe_sequence_outputs(model.SerializeToString(), static_profile(model))
    assert probe == SequenceProbe(CARRYING, False) and len(runs) == 3
    assert "padded run at registration failed (its run outlasted PROBE_SECONDS" in caplog.text


def test_models_that_are_not_run_get_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """None (name matching) for a model without a declared mask, one over the size the API loads, one
    whose run fails, and one that takes no two different lengths."""
    mlp = build_model("mlp")
    assert observe_sequence_outputs(mlp.SerializeToString(), static_profile(mlp)) is None
    model = token_model(output_sequence_dim=None)
    serialized, profile = model.SerializeToString(), static_profile(model)
    with monkeypatch.context() as patch:
        patch.setattr(sequence_probe, "RUNTIME_CHECK_MAX_BYTES", len(serialized) - 1)
        assert observe_sequence_outputs(serialized, profile) is None
    with monkeypatch.context() as patch:
        patch.setattr(sequence_probe, "probe_feed", lambda *args: {})  # ONNX Runtime refuses the run
        assert observe_sequence_outputs(serialized, profile) is None
    profile["metadata"]["sits.max_sequence"] = "1"
    assert observe_sequence_outputs(serialized, profile) is None


def test_probe_lengths_stay_within_the_declared_max_sequence() -> None:
    assert probe_lengths(None) == probe_lengths(512) == probe_lengths(5) == (3, 5)
    assert probe_lengths(4) == (3, 4) and probe_lengths(2) == (1, 2)
    assert probe_lengths(1) is None


def test_the_feed_size_is_counted_without_building_it() -> None:
    model = token_model()
    profile = static_profile(model)
    spec = _spec(profile)
    for length in probe_lengths(None) or ():
        feed = probe_feed(profile["signature"], spec, length, profile.get("vocabulary_size"))
        assert probe_feed_bytes(profile["signature"], spec, length) == sum(array.nbytes for array in feed.values())


def test_a_model_whose_fixed_dims_ask_for_a_huge_feed_is_not_run(caplog: pytest.LogCaptureFixture) -> None:
    """[1, 20000, 20000] float32 is 1.6 GB: the feed is never built in the API process, name matching stays."""
    model = token_model()
    model.graph.input.append(helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, [1, 20000, 20000]))
    serialized, profile = model.SerializeToString(), static_profile(model)

    tracemalloc.start()
    try:
        with caplog.at_level(logging.INFO, logger=sequence_probe.__name__):
            assert observe_sequence_outputs(serialized, profile) is None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert peak < PROBE_FEED_MAX_BYTES, f"the probe held {peak} bytes"
    feed_bytes = 4 * 20000 * 20000 + 2 * 8 * 5  # the image, the int64 ids and mask at length 5
    assert f"would hold {feed_bytes} bytes" in caplog.text and "PROBE_FEED_MAX_BYTES" in caplog.text


def test_a_probe_run_that_outlasts_its_time_is_stopped(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A Python exception cannot stop `session.run`; ONNX Runtime's terminate flag does, between nodes
    (here between the steps of a loop of 10**12 trips, which would otherwise run for hours)."""
    model = token_model()
    body = helper.make_graph(
        [helper.make_node("Identity", ["keep_in"], ["keep_out"]),
         helper.make_node("Add", ["acc_in", "one"], ["acc_out"])],
        "spin", [helper.make_tensor_value_info("step", TensorProto.INT64, []),
                 helper.make_tensor_value_info("keep_in", TensorProto.BOOL, []),
                 helper.make_tensor_value_info("acc_in", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("keep_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, [])],
        [helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])])
    model.graph.initializer.extend([helper.make_tensor("trips", TensorProto.INT64, [], [10**12]),
                                    helper.make_tensor("keep", TensorProto.BOOL, [], [True]),
                                    helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])])
    model.graph.node.extend([helper.make_node("Loop", ["trips", "keep", "zero"], ["spun"], body=body),
                             helper.make_node("Add", ["pooled", "spun"], ["pooled_spun"])])
    model.graph.output.append(helper.make_tensor_value_info("pooled_spun", TensorProto.FLOAT, ["batch", 4]))
    monkeypatch.setattr(sequence_probe, "PROBE_SECONDS", 0.3)
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger=sequence_probe.__name__):
        assert observe_sequence_outputs(model.SerializeToString(), static_profile(model)) is None
    elapsed = time.monotonic() - started

    assert "outlasted PROBE_SECONDS (0.3 s) and was stopped" in caplog.text  # not any other failure
    assert 0.3 <= elapsed < 10
