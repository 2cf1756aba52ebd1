"""The built-in model zoo: real graphs, checked by onnx and run by onnxruntime."""

from __future__ import annotations

import subprocess
import sys
from functools import cache
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.errors import BadInput
from sits_worker.model.zoo import (
    LARGE_MODELS,
    ZOO_MODELS,
    build_model,
    build_zoo,
    mlp_reference,
    mlp_weights,
)

REPO_ROOT = Path(__file__).resolve().parents[3]


@cache
def session(name: str, seed: int = 0) -> ort.InferenceSession:
    """One onnxruntime session per zoo model, shared by the tests of this module."""
    model = build_model(name, seed)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def sample_feed(name: str, batch: int, sequence: int = 16, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    if name == "mlp":
        return {"features": rng.standard_normal((batch, 64), dtype=np.float32)}
    if name == "transformer":
        ids = rng.integers(0, 1000, (batch, sequence), dtype=np.int64)
        return {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    side = 224 if name == "resnet50" else 32
    return {"pixels": rng.standard_normal((batch, 3, side, side), dtype=np.float32)}


EXPECTED_OUTPUT = {"mlp": ("logits", 10), "convnet": ("logits", 10), "transformer": ("embedding", 64)}


def test_mlp_matches_numpy_reference() -> None:
    features = sample_feed("mlp", 37)["features"]
    (logits,) = session("mlp").run(None, {"features": features})
    np.testing.assert_allclose(logits, mlp_reference(features), rtol=1e-4, atol=1e-5)


def test_mlp_reference_follows_the_seed() -> None:
    features = sample_feed("mlp", 4)["features"]
    (logits,) = session("mlp", 7).run(None, {"features": features})
    np.testing.assert_allclose(logits, mlp_reference(features, seed=7), rtol=1e-4, atol=1e-5)
    assert not np.allclose(mlp_reference(features, seed=7), mlp_reference(features, seed=0))


def test_mlp_weights_have_the_documented_layer_shapes() -> None:
    shapes = [(weight.shape, bias.shape) for weight, bias in mlp_weights(0)]
    assert shapes == [((64, 256), (256,)), ((256, 256), (256,)), ((256, 10), (10,))]


def test_mlp_reference_rejects_features_of_the_wrong_width() -> None:
    with pytest.raises(BadInput, match=r"\[N,64\]"):
        mlp_reference(np.zeros((2, 63), dtype=np.float32))


@pytest.mark.parametrize("name", ZOO_MODELS)
def test_zoo_model_passes_checker_and_declares_its_signature(name: str) -> None:
    model = build_model(name)
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version in (8, 9)
    assert [(op.domain, op.version) for op in model.opset_import] == [("", 17)]
    output_name, width = EXPECTED_OUTPUT[name]
    (output,) = model.graph.output
    assert output.name == output_name
    assert [d.dim_param or d.dim_value for d in output.type.tensor_type.shape.dim] == ["batch", width]


@pytest.mark.parametrize("name", ZOO_MODELS)
def test_zoo_model_runs_and_gives_finite_outputs(name: str) -> None:
    output_name, width = EXPECTED_OUTPUT[name]
    outputs = session(name).run([output_name], sample_feed(name, 5))
    assert outputs[0].shape == (5, width)
    assert outputs[0].dtype == np.float32
    assert np.isfinite(outputs[0]).all()
    assert outputs[0].std() > 1e-3  # random weights, not a degenerate constant


@pytest.mark.parametrize("name", ZOO_MODELS)
def test_rows_do_not_depend_on_the_rest_of_the_batch(name: str) -> None:
    """Batching must be invisible: the same row gives the same output alone or in a batch."""
    feed = sample_feed(name, 6)
    (batched,) = session(name).run(None, feed)
    (alone,) = session(name).run(None, {key: value[2:3] for key, value in feed.items()})
    np.testing.assert_allclose(batched[2:3], alone, rtol=1e-4, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(sequence=st.integers(min_value=1, max_value=512), batch=st.integers(min_value=1, max_value=3))
def test_transformer_runs_for_any_sequence_length(sequence: int, batch: int) -> None:
    (embedding,) = session("transformer").run(None, sample_feed("transformer", batch, sequence))
    assert embedding.shape == (batch, 64)
    assert np.isfinite(embedding).all()


@pytest.mark.parametrize("sequence", [1, 512])
def test_transformer_runs_at_the_sequence_bounds(sequence: int) -> None:
    (embedding,) = session("transformer").run(None, sample_feed("transformer", 2, sequence))
    assert embedding.shape == (2, 64)


def test_transformer_output_depends_on_token_positions() -> None:
    """The learned positional table is applied, so reordering tokens changes the embedding."""
    ids = np.arange(1, 9, dtype=np.int64)[None, :]
    mask = np.ones_like(ids)
    (forward,) = session("transformer").run(None, {"input_ids": ids, "attention_mask": mask})
    (backward,) = session("transformer").run(None, {"input_ids": ids[:, ::-1].copy(), "attention_mask": mask})
    assert not np.allclose(forward, backward, atol=1e-4)


def test_zoo_metadata_names_the_model_and_the_token_limit() -> None:
    for name in (*ZOO_MODELS, *LARGE_MODELS):
        assert session(name).get_modelmeta().custom_metadata_map["sits.zoo"] == name
    metadata = session("transformer").get_modelmeta().custom_metadata_map
    assert metadata["sits.max_sequence"] == "512"
    assert metadata["sits.attention_mask"] == "attention_mask" and metadata["sits.pad_token_id"] == "0"


def test_zoo_build_is_deterministic(tmp_path: Path) -> None:
    first = build_zoo(tmp_path / "a")
    second = build_zoo(tmp_path / "b")
    assert list(first) == list(ZOO_MODELS) == list(second)
    for name in ZOO_MODELS:
        assert first[name].read_bytes() == second[name].read_bytes()


def test_different_seeds_give_different_weights() -> None:
    assert build_model("convnet", 0).SerializeToString() != build_model("convnet", 1).SerializeToString()


def test_build_zoo_writes_one_onnx_file_per_model_and_nothing_else(tmp_path: Path) -> None:
    paths = build_zoo(tmp_path / "zoo")
    assert sorted(p.name for p in (tmp_path / "zoo").iterdir()) == sorted(f"{n}.onnx" for n in ZOO_MODELS)
    for name, path in paths.items():
        assert path == tmp_path / "zoo" / f"{name}.onnx"
        onnx.checker.check_model(str(path))


def test_unknown_zoo_model_is_rejected_with_bad_input() -> None:
    with pytest.raises(BadInput, match="unknown zoo model 'vgg'.*mlp"):
        build_model("vgg")


def test_resnet50_builds_and_runs_one_image() -> None:
    (logits,) = session("resnet50").run(None, sample_feed("resnet50", 1))
    assert logits.shape == (1, 1000)
    assert np.isfinite(logits).all()


def test_model_modules_do_not_import_onnxruntime() -> None:
    """The API imports the model package; onnxruntime must stay out of that process."""
    code = ("import sys, sits_worker.model.zoo, sits_worker.model.graph; "
            "sys.exit('onnxruntime' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT).returncode == 0
