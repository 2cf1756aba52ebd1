"""Loading, validating and statically profiling ONNX files."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from broker.errors import FileMissing, InvalidModel, PathNotAllowed
from sits_worker.model.graph import (
    REFERENCE_SEQUENCE_LENGTH,
    dtype_name,
    model_signature,
    operator_histogram,
    sequence_axis,
    static_profile,
    vocabulary_size,
)
from sits_worker.model.loading import load_model_checked
from sits_worker.model.zoo import build_model, build_zoo, mlp_reference
from tests.onnx_models import int_series_model, token_model, with_looked_up_input


@pytest.fixture
def model_root(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    root.mkdir()
    return root


@pytest.fixture
def zoo(model_root: Path) -> dict[str, Path]:
    return build_zoo(model_root / "zoo")


def save_with_external_data(model: onnx.ModelProto, path: Path, data_name: str = "weights.bin") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data_name, size_threshold=0)


def point_external_data_at(path: Path, location: str) -> None:
    """Rewrite every external-data location of the saved model at `path`."""
    model = onnx.load(str(path), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    path.write_bytes(model.SerializeToString())


def run_mlp(model: onnx.ModelProto, features: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"features": features})[0]


# --- loading ----------------------------------------------------------------------------


def test_zoo_model_loads_from_inside_the_model_roots(zoo: dict[str, Path], model_root: Path) -> None:
    model = load_model_checked(zoo["convnet"], [model_root])
    assert model.graph.name == "sits_convnet"


def test_missing_file_is_rejected_with_file_missing(model_root: Path) -> None:
    with pytest.raises(FileMissing, match="does not exist"):
        load_model_checked(model_root / "absent.onnx", [model_root])


def test_directory_is_rejected_with_file_missing(model_root: Path) -> None:
    (model_root / "folder.onnx").mkdir()
    with pytest.raises(FileMissing, match="is not a file"):
        load_model_checked(model_root / "folder.onnx", [model_root])


def test_path_outside_model_roots_is_rejected(tmp_path: Path, model_root: Path) -> None:
    outside = build_zoo(tmp_path / "elsewhere")["mlp"]
    with pytest.raises(PathNotAllowed, match="outside the model roots"):
        load_model_checked(outside, [model_root])
    with pytest.raises(PathNotAllowed):
        load_model_checked(model_root / ".." / "elsewhere" / "mlp.onnx", [model_root])


def test_path_outside_roots_is_rejected_before_its_existence_is_revealed(
    tmp_path: Path, model_root: Path
) -> None:
    with pytest.raises(PathNotAllowed):
        load_model_checked(tmp_path / "no-such-file.onnx", [model_root])


def test_symlink_escaping_model_roots_is_rejected(tmp_path: Path, model_root: Path) -> None:
    outside = build_zoo(tmp_path / "elsewhere")["mlp"]
    link = model_root / "innocent.onnx"
    link.symlink_to(outside)
    with pytest.raises(PathNotAllowed, match="outside the model roots") as refused:
        load_model_checked(link, [model_root])
    assert str(outside) not in refused.value.message  # where the link leads is not told


def test_symlink_inside_model_roots_is_followed(zoo: dict[str, Path], model_root: Path) -> None:
    link = model_root / "alias.onnx"
    link.symlink_to(zoo["mlp"])
    assert load_model_checked(link, [model_root]).graph.name == "sits_mlp"


def test_any_of_several_roots_is_accepted(tmp_path: Path, zoo: dict[str, Path], model_root: Path) -> None:
    other_root = tmp_path / "other"
    other_root.mkdir()
    assert load_model_checked(zoo["mlp"], [other_root, model_root]).graph.name == "sits_mlp"


def test_malformed_onnx_is_rejected_with_invalid_model(model_root: Path) -> None:
    bad = model_root / "garbage.onnx"
    bad.write_bytes(b"\xff\xfe this is not a protobuf \x00\x01" * 10)
    with pytest.raises(InvalidModel, match="garbage.onnx") as caught:
        load_model_checked(bad, [model_root])
    assert caught.value.__cause__ is not None


def test_model_failing_the_checker_is_rejected_with_its_reason(model_root: Path) -> None:
    # The Relu reads a tensor nothing produces.
    graph = helper.make_graph(
        [helper.make_node("Relu", ["nowhere"], ["y"])], "broken",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = model_root / "broken.onnx"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(InvalidModel, match=r"broken.onnx fails the ONNX checker: .*nowhere"):
        load_model_checked(path, [model_root])


def test_model_with_external_data_loads_with_its_weights(model_root: Path) -> None:
    path = model_root / "external" / "mlp.onnx"
    save_with_external_data(build_model("mlp"), path)
    model = load_model_checked(path, [model_root])
    features = np.random.default_rng(3).standard_normal((4, 64), dtype=np.float32)
    np.testing.assert_allclose(run_mlp(model, features), mlp_reference(features), rtol=1e-4, atol=1e-5)


def test_a_model_over_2_gb_with_its_external_data_is_refused_before_its_data_is_read(model_root: Path) -> None:
    """protobuf cannot serialize it (for its version hash): the sizes of its data files tell, before
    gigabytes are read into the API process. The data file is sparse: it takes no disk."""
    path = model_root / "external" / "mlp.onnx"
    save_with_external_data(build_model("mlp"), path)
    model = onnx.load(str(path), load_external_data=False)
    for entry in model.graph.initializer[0].external_data:
        if entry.key == "length":
            entry.value = str(2**31 + 8)
    onnx.save_model(model, str(path))
    os.truncate(path.parent / "weights.bin", 2**31 + 8)

    with pytest.raises(InvalidModel, match=r"more than the 2,147,483,647 one ONNX message can be serialized to"):
        load_model_checked(path, [model_root])


def test_external_data_outside_model_folder_is_rejected(model_root: Path) -> None:
    path = model_root / "external" / "mlp.onnx"
    save_with_external_data(build_model("mlp"), path)
    os.replace(path.parent / "weights.bin", model_root / "weights.bin")
    point_external_data_at(path, "../weights.bin")
    with pytest.raises(InvalidModel, match="external data '../weights.bin' of tensor .* points outside"):
        load_model_checked(path, [model_root])


def test_external_data_with_absolute_location_is_rejected(model_root: Path) -> None:
    path = model_root / "external" / "mlp.onnx"
    save_with_external_data(build_model("mlp"), path)
    point_external_data_at(path, str(path.parent / "weights.bin"))
    with pytest.raises(InvalidModel, match="points outside the model folder"):
        load_model_checked(path, [model_root])


def test_external_data_symlink_escaping_the_folder_is_rejected(tmp_path: Path, model_root: Path) -> None:
    path = model_root / "external" / "mlp.onnx"
    save_with_external_data(build_model("mlp"), path)
    secret = tmp_path / "secret.bin"
    os.replace(path.parent / "weights.bin", secret)
    (path.parent / "weights.bin").symlink_to(secret)
    with pytest.raises(InvalidModel, match="points outside the model folder"):
        load_model_checked(path, [model_root])


def test_missing_external_data_file_is_rejected(model_root: Path) -> None:
    path = model_root / "external" / "mlp.onnx"
    save_with_external_data(build_model("mlp"), path)
    (path.parent / "weights.bin").unlink()
    with pytest.raises(InvalidModel, match="external data 'weights.bin' .* does not exist"):
        load_model_checked(path, [model_root])


@pytest.mark.parametrize("location", ["weights", "."])
def test_external_data_pointing_at_a_directory_is_rejected_as_a_directory(model_root: Path, location: str) -> None:
    path = model_root / "external" / "mlp.onnx"
    save_with_external_data(build_model("mlp"), path)
    (path.parent / "weights").mkdir()
    point_external_data_at(path, location)
    with pytest.raises(InvalidModel, match=f"external data '{location}' of tensor .* is a directory, not a data file; "
                                           "copy the data file next to the model"):
        load_model_checked(path, [model_root])


# --- signature ------------------------------------------------------------------------------


def test_signature_reports_dtype_shape_and_dynamic_axes() -> None:
    signature = model_signature(build_model("transformer"))
    assert signature == {
        "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"],
                    "dynamic_axes": [0, 1]},
                   {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "sequence"],
                    "dynamic_axes": [0, 1]}],
        "outputs": [{"name": "embedding", "dtype": "float32", "shape": ["batch", 64], "dynamic_axes": [0]}],
    }


def test_signature_leaves_out_initializers_listed_as_inputs() -> None:
    model = build_model("mlp")
    for tensor in model.graph.initializer:  # the pre-IR-4 habit of listing weights as inputs
        model.graph.input.append(helper.make_tensor_value_info(tensor.name, tensor.data_type, tensor.dims))
    assert [entry["name"] for entry in model_signature(model)["inputs"]] == ["features"]


def test_signature_marks_unnamed_unknown_dims_as_dynamic() -> None:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "unnamed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [None, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)],
    )
    signature = model_signature(helper.make_model(graph))
    assert signature["inputs"][0] == {"name": "x", "dtype": "float16", "shape": ["?", 3], "dynamic_axes": [0]}
    assert signature["outputs"][0]["shape"] is None


@pytest.mark.parametrize(
    ("elem_type", "expected"),
    [(TensorProto.FLOAT, "float32"), (TensorProto.INT64, "int64"), (TensorProto.FLOAT16, "float16"),
     (TensorProto.BOOL, "bool"), (TensorProto.UINT8, "uint8"), (TensorProto.UNDEFINED, "undefined")],
)
def test_dtype_name_gives_numpy_names(elem_type: int, expected: str) -> None:
    assert dtype_name(elem_type) == expected


# --- profile ------------------------------------------------------------------------------------


def test_static_profile_counts_parameters_and_ops() -> None:
    profile = static_profile(build_model("mlp"))
    layers = [(64, 256), (256, 256), (256, 10)]
    assert profile["param_count"] == sum(k * n + n for k, n in layers)
    assert profile["param_bytes"] == 4 * profile["param_count"]
    assert profile["op_histogram"] == {"Gemm": 3, "Relu": 2}
    assert list(profile["op_histogram"]) == ["Gemm", "Relu"]  # most frequent first
    relu_elements = 256 + 256
    assert profile["flops_per_sample"] == sum(2 * k * n for k, n in layers) + relu_elements
    assert profile["activation_bytes_per_sample"] == 4 * (256 * 4)  # 2 Gemm + 2 Relu outputs
    assert profile["input_bytes_per_sample"] == 4 * 64
    assert profile["output_bytes_per_sample"] == 4 * 10
    assert profile["opset"] == 17
    assert profile["sequence_axis"] is None
    assert "flops_per_token" not in profile
    assert profile["unresolved_nodes"] == 0


def test_conv_flops_follow_output_size_times_kernel_volume() -> None:
    weight = onnx.numpy_helper.from_array(np.zeros((8, 3, 3, 3), dtype=np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])], "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8, 8, 8])], [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert static_profile(model)["flops_per_sample"] == 2 * (8 * 8 * 8) * (3 * 3 * 3)


def test_resnet50_profile_matches_the_published_size() -> None:
    """ResNet-50 has about 25.5 M parameters (BN folded) and about 4.1 G multiply-adds per image."""
    profile = static_profile(build_model("resnet50"))
    assert 25.4e6 < profile["param_count"] < 25.6e6
    assert 7.9e9 < profile["flops_per_sample"] < 8.4e9
    assert profile["op_histogram"]["Conv"] == 53


def test_token_model_profile_has_per_token_figures() -> None:
    profile = static_profile(build_model("transformer"))
    assert profile["sequence_axis"] == {"input": "input_ids", "axis": 1}
    assert profile["reference_sequence_length"] == REFERENCE_SEQUENCE_LENGTH
    assert profile["flops_per_token"] == profile["flops_per_sample"] // REFERENCE_SEQUENCE_LENGTH
    assert profile["activation_bytes_per_token"] == (
        profile["activation_bytes_per_sample"] // REFERENCE_SEQUENCE_LENGTH)
    # Each token passes 2 layers of 4 d*d projections and a 64->128->64 FFN, plus attention.
    dense_flops_per_token = 2 * 2 * (4 * 64 * 64 + 2 * 64 * 128)
    attention_flops_per_token = 2 * 2 * 2 * REFERENCE_SEQUENCE_LENGTH * 64
    assert profile["flops_per_token"] >= dense_flops_per_token + attention_flops_per_token
    assert profile["flops_per_token"] < 1.2 * (dense_flops_per_token + attention_flops_per_token)
    assert profile["unresolved_nodes"] == 0


def test_the_sequence_axis_is_the_token_ids_even_when_the_mask_is_listed_first() -> None:
    """Graph order put the attention mask first for models that list it first, and the vocabulary of the
    ids went unchecked: the input that indexes an embedding table is preferred, and a declared mask never."""
    for model in (token_model(), token_model(mask_first=True)):
        profile = static_profile(model)
        assert profile["sequence_axis"] == {"input": "input_ids", "axis": 1}
        assert profile["vocabulary_size"] == 50
    no_lookup = token_model(mask_first=True)
    no_lookup.graph.node[0].op_type = "GatherElements"  # no embedding lookup left: the declared mask is passed over
    assert sequence_axis(no_lookup) == {"input": "input_ids", "axis": 1}
    assert vocabulary_size(no_lookup, "input_ids") is None
    assert sequence_axis(int_series_model()) == {"input": "x", "axis": 1}  # with nothing to prefer, the first


def test_an_input_with_several_dynamic_axes_carries_no_sequence() -> None:
    """An image of any height and width is scheduled by rows, not as height-many tokens; a series of
    frames of one width ([batch, time, 80]) is a sequence."""
    def model_of(shape: list[int | str]) -> onnx.ModelProto:
        graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "m",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    assert sequence_axis(model_of(["batch", 3, "height", "width"])) is None
    assert static_profile(model_of(["batch", 3, "height", "width"]))["sequence_axis"] is None
    assert sequence_axis(model_of(["batch", "time", 80])) == {"input": "x", "axis": 1}


def test_word_ids_are_preferred_over_other_inputs_that_index_a_smaller_table() -> None:
    """token_type_ids listed first index a table of 2 rows; input_ids the 50-row vocabulary."""
    model = with_looked_up_input(token_model(), "token_type_ids", 2)
    assert sequence_axis(model) == {"input": "input_ids", "axis": 1}
    assert vocabulary_size(model, "token_type_ids") == 2


def test_the_vocabulary_is_found_through_a_cast_before_the_lookup() -> None:
    """int32 ids cast to int64 (or reshaped) before the Gather still index the same table."""
    model = token_model()
    model.graph.node[0].input[1] = "ids_64"
    model.graph.node.insert(0, helper.make_node("Cast", ["ids_32"], ["ids_64"], to=TensorProto.INT64))
    model.graph.node.insert(0, helper.make_node("Identity", ["input_ids"], ["ids_32"]))
    assert vocabulary_size(model, "input_ids") == 50
    assert vocabulary_size(int_series_model(), "x") is None


@pytest.mark.parametrize("name", ["mlp", "convnet", "transformer"])
def test_static_profile_is_json_serialisable_and_leaves_the_model_alone(name: str) -> None:
    model = build_model(name)
    before = model.SerializeToString()
    profile = static_profile(model)
    assert json.loads(json.dumps(profile)) == profile
    assert model.SerializeToString() == before
    assert profile["activation_bytes_per_sample"] > 0
    assert profile["param_count"] == sum(math.prod(t.dims) for t in model.graph.initializer)


def test_operator_histogram_counts_nodes_inside_subgraphs() -> None:
    branch = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"])], "branch", [],
        [helper.make_tensor_value_info("r", TensorProto.FLOAT, [1])],
    )
    graph = helper.make_graph(
        [helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch)], "with_if",
        [helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    assert operator_histogram(helper.make_model(graph)) == {"Relu": 2, "If": 1}


def test_input_ids_are_the_token_ids_even_beside_a_larger_position_table() -> None:
    """A byte-level model's position table (64 rows) outnumbers its vocabulary (50): the largest table
    alone picked position_ids, and input_ids went unchecked."""
    model = with_looked_up_input(token_model(), "position_ids", 64)

    assert sequence_axis(model) == {"input": "input_ids", "axis": 1}
    assert static_profile(model)["vocabulary_size"] == 50


def test_megabytes_of_model_metadata_stay_out_of_the_profile_but_sits_keys_are_kept() -> None:
    model = build_model("mlp")
    helper.set_model_props(model, {**{f"blob{index}": "x" * 1_000_000 for index in range(3)},
                                   "author": "team-a", "sits.max_sequence": "64"})
    profile = static_profile(model)

    assert profile["metadata"] == {"sits.max_sequence": "64", "author": "team-a"}
    assert profile["metadata_dropped"] == 3
    assert len(json.dumps(profile)) < 100_000  # (what Redis stores for the version)
