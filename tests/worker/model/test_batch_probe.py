"""Registration refuses models whose rows see each other (sits_worker/model/batch_probe.py): run on two
rows alone and together, their outputs must be the same and one row per input row."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from broker.errors import InvalidModel
from sits_worker.model.batch_probe import check_rows_independent
from sits_worker.model.graph import model_signature


def graph_model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto],
                initializers: list[onnx.TensorProto] | None = None) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "probe", inputs, outputs, initializers or [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def floats(name: str, shape: list[int | str]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def pairwise() -> onnx.ModelProto:
    """CLIP's shape: image rows scored against text rows, [image_batch, text_batch]."""
    return graph_model([helper.make_node("Transpose", ["txt"], ["txt_t"]),
                        helper.make_node("MatMul", ["img", "txt_t"], ["logits"])],
                       [floats("img", ["image_batch", 4]), floats("txt", ["text_batch", 4])],
                       [floats("logits", ["image_batch", "text_batch"])])


def dynamic_quantization() -> onnx.ModelProto:
    """One scale for the whole batch: the larger row flattens the smaller one."""
    return graph_model([helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "scale", "zero"]),
                        helper.make_node("DequantizeLinear", ["q", "scale", "zero"], ["y"])],
                       [floats("x", ["N", 4])], [floats("y", ["N", 4])])


def running_sum() -> onnx.ModelProto:
    """A sum down the batch axis (what a Scan or a time-major RNN over axis 0 does)."""
    return graph_model([helper.make_node("CumSum", ["x", "axis"], ["y"])], [floats("x", ["N", 4])],
                       [floats("y", ["N", 4])], [numpy_helper.from_array(np.array(0, dtype=np.int64), "axis")])


def detections() -> onnx.ModelProto:
    """NonMaxSuppression: as many output rows as boxes kept, not as input rows."""
    return graph_model([helper.make_node("NonMaxSuppression", ["boxes", "scores", "keep"], ["selected"])],
                       [floats("boxes", ["N", 5, 4]), floats("scores", ["N", 1, 5])],
                       [helper.make_tensor_value_info("selected", TensorProto.INT64, ["kept", 3])],
                       [numpy_helper.from_array(np.array([2], dtype=np.int64), "keep")])


@pytest.mark.parametrize(("model", "problem"), [
    (pairwise(), "output 'logits' has shape [1, 1] for one row but [2, 2] for two"),
    (dynamic_quantization(), "output 'y' of a row changes when another row shares its batch"),
    (running_sum(), "output 'y' of a row changes when another row shares its batch"),
    (detections(), "output 'selected' has 2 rows for one input row"),
], ids=["pairwise", "dynamic-quantization", "running-sum", "detections"])
def test_a_model_whose_rows_see_each_other_is_refused_naming_the_output(model: onnx.ModelProto,
                                                                        problem: str) -> None:
    with pytest.raises(InvalidModel, match=r"model 'm' does not batch: ") as refused:
        check_rows_independent(model.SerializeToString(), model_signature(model), "m")

    assert problem in str(refused.value)
    assert "re-export the model so that each row's outputs depend on that row alone" in str(refused.value)


def test_models_whose_rows_are_independent_pass(zoo_dir: Path) -> None:
    for name in ("mlp", "convnet", "transformer"):
        model = onnx.load(zoo_dir / f"{name}.onnx")
        check_rows_independent(model.SerializeToString(), model_signature(model), name)
    elementwise = graph_model([helper.make_node("Relu", ["x"], ["y"])], [floats("x", ["N", 4])],
                              [floats("y", ["N", 4])])
    check_rows_independent(elementwise.SerializeToString(), model_signature(elementwise), "relu")


def test_a_model_that_cannot_run_here_is_not_judged() -> None:
    """A fixed batch axis needs no check (it runs in pieces of its size); a feed over the bound is not built."""
    fixed = graph_model([helper.make_node("CumSum", ["x", "axis"], ["y"])], [floats("x", [2, 4])],
                        [floats("y", [2, 4])], [numpy_helper.from_array(np.array(0, dtype=np.int64), "axis")])
    check_rows_independent(fixed.SerializeToString(), model_signature(fixed), "fixed")
    huge = graph_model([helper.make_node("CumSum", ["x", "axis"], ["y"])], [floats("x", ["N", 4096, 4096])],
                       [floats("y", ["N", 4096, 4096])],
                       [numpy_helper.from_array(np.array(0, dtype=np.int64), "axis")])
    check_rows_independent(huge.SerializeToString(), model_signature(huge), "huge")


def test_a_model_with_random_ops_is_not_judged_and_bool_rows_differ() -> None:
    """A sampler answers one feed differently twice: its rows are not compared (they may well be
    independent). Bool rows are all false and all true, so a batch-wide `any` is seen."""
    noisy = graph_model([helper.make_node("RandomNormalLike", ["x"], ["noise"]),
                         helper.make_node("Add", ["x", "noise"], ["y"])],
                        [floats("x", ["N", 4])], [floats("y", ["N", 4])])
    check_rows_independent(noisy.SerializeToString(), model_signature(noisy), "noisy")

    any_row = graph_model([helper.make_node("Cast", ["flags"], ["as_float"], to=TensorProto.FLOAT),
                           helper.make_node("ReduceMax", ["as_float"], ["batch_max"], axes=[0], keepdims=1),
                           helper.make_node("Expand", ["batch_max", "shape"], ["y"])],
                          [helper.make_tensor_value_info("flags", TensorProto.BOOL, ["N", 4])],
                          [floats("y", ["N", 4])])
    any_row.graph.node.insert(0, helper.make_node("Shape", ["flags"], ["shape"]))
    with pytest.raises(InvalidModel, match="output 'y' of a row changes"):
        check_rows_independent(any_row.SerializeToString(), model_signature(any_row), "any")


def test_a_declared_negative_dim_is_probed_as_a_dynamic_one_not_a_500() -> None:
    model = graph_model([helper.make_node("Relu", ["x"], ["y"])], [floats("x", ["N", -2, 3])],
                        [floats("y", ["N", -2, 3])])
    check_rows_independent(model.SerializeToString(), model_signature(model), "negative")
