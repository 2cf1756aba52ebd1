"""POST /v1/models refuses, with a 422 naming the problem, a model that could never serve a request.

The bad models are small graphs built with onnx.helper, as the zoo builds its models.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from onnx import ModelProto, TensorProto, helper, numpy_helper

from broker.config.settings import Settings
from broker.errors import SitsError
from broker.state.embedded import EmbeddedRedis
from sits_worker.model.graph import dtype_name
from sits_worker.model.servable import CARRIED_DTYPE_KINDS, check_servable
from sits_worker.model.tensors import InputSpec
from tests.api.api_helpers import Api, error_of

Dims = Sequence[int | str] | None


def make_model(nodes: Sequence[Any], inputs: Sequence[Any], outputs: Sequence[Any], *,
               initializers: Sequence[TensorProto] = (), opset: int = 17,
               metadata: dict[str, str] | None = None, domains: Sequence[str] = ()) -> ModelProto:
    graph = helper.make_graph(list(nodes), "bad", list(inputs), list(outputs), list(initializers))
    opsets = [helper.make_opsetid("", opset), *(helper.make_opsetid(domain, 1) for domain in domains)]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="sits.tests")
    model.ir_version = 8
    helper.set_model_props(model, metadata or {})
    return model


def one_op(op_type: str = "Relu", elem_type: int = TensorProto.FLOAT, in_shape: Dims = ("batch", 4),
           out_shape: Dims = ("batch", 4), *, out_type: int | None = None, **kwargs: Any) -> ModelProto:
    """x -> op -> y, with the declared types and shapes given."""
    return make_model([helper.make_node(op_type, ["x"], ["y"])],
                      [helper.make_tensor_value_info("x", elem_type, in_shape)],
                      [helper.make_tensor_value_info("y", out_type or elem_type, out_shape)], **kwargs)


def token_model(metadata: dict[str, str], token_type: int = TensorProto.INT64) -> ModelProto:
    """A token model: input_ids and attention_mask [batch, seq] -> scores [batch, seq] (ids * mask)."""
    nodes = [helper.make_node("Cast", ["input_ids"], ["ids_f"], to=TensorProto.FLOAT),
             helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["ids_f", "mask_f"], ["scores"])]
    return make_model(nodes, [helper.make_tensor_value_info("input_ids", token_type, ["batch", "seq"]),
                              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"])],
                      [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", "seq"])],
                      metadata=metadata)


def register(api: Api, tmp_path: Path, model: ModelProto, name: str = "m", **extra: Any) -> Any:
    path = tmp_path / "models" / f"{name}.onnx"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(model.SerializeToString())
    return api.post("/v1/models", json={"name": name, "path": str(path), **extra})


def refused(response: Any) -> str:
    """The error message of a 422 invalid_model answer."""
    assert response.status_code == 422, (response.status_code, response.get_json())
    assert response.get_json()["code"] == "invalid_model"
    return error_of(response)


WEIGHT = numpy_helper.from_array(np.ones(4, dtype=np.float32), "w")

# name -> (model, words the message must hold)
UNSERVABLE = {
    "scalar-input": (one_op(in_shape=[], out_shape=[]), ["input 'x'", "scalar", "batch axis"]),
    "string-input": (one_op("Identity", TensorProto.STRING), ["input 'x'", "STRING", "numeric"]),
    "bfloat16-input": (one_op("Identity", TensorProto.BFLOAT16), ["input 'x'", "BFLOAT16", "numeric"]),
    "unknown-rank-input": (one_op(in_shape=None), ["fails the ONNX checker", "'shape'", "required"]),
    "no-inputs": (make_model([helper.make_node("Constant", [], ["y"], value=helper.make_tensor(
        "c", TensorProto.FLOAT, [1], [1.0]))], [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])]),
        ["no inputs", "at least one input"]),
    "only-initializer-inputs": (make_model(
        [helper.make_node("Relu", ["w"], ["y"])], [helper.make_tensor_value_info("w", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], initializers=[WEIGHT]), ["no inputs"]),
    "no-outputs": (make_model([helper.make_node("Relu", ["x"], ["y"])],
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])], []),
                   ["no outputs"]),
    "scalar-output": (make_model([helper.make_node("ReduceSum", ["x"], ["y"], keepdims=0)],
                                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])]),
                      ["output 'y'", "scalar"]),
    "sequence-output": (make_model([helper.make_node("SequenceConstruct", ["x"], ["y"])],
                                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                                   [helper.make_tensor_sequence_value_info("y", TensorProto.FLOAT, None)]),
                        ["output 'y'", "sequence", "not a dense tensor"]),
    "type-clash": (make_model([helper.make_node("Add", ["x", "z"], ["y"])],
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
                               helper.make_tensor_value_info("z", TensorProto.INT64, ["batch", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])]),
                   ["m.onnx fails the ONNX checker", "Add", "inconsistent type", "re-export"]),
    "declared-output-type-wrong": (one_op(out_type=TensorProto.INT64),
                                   ["fails the ONNX checker", "elem type differs"]),
    "matmul-shapes-clash": (make_model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                        ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        initializers=[numpy_helper.from_array(np.ones((5, 3), dtype=np.float32), "w")]),
        ["fails the ONNX checker", "MatMul"]),
    "opset-999": (one_op(opset=999), ["opset 999", "re-export the model with opset"]),
    "output-sums-over-the-batch": (make_model(
        [helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        initializers=[numpy_helper.from_array(np.array([0], dtype=np.int64), "axes")]),
        ["output 'y' has shape [4]", "batch axis is dynamic", "re-export the model with outputs of shape [batch"]),
    "output-shape-of-the-input": (make_model(
        [helper.make_node("Shape", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [2])]), ["output 'y' has shape [2]"]),
    "output-first-axis-other-than-the-fixed-batch": (make_model(
        [helper.make_node("Transpose", ["x"], ["y"], perm=[1, 0])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 1])]), ["batch axis is fixed at 1"]),
    "rows-see-each-other": (make_model(
        [helper.make_node("CumSum", ["x", "axis"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        initializers=[numpy_helper.from_array(np.array(0, dtype=np.int64), "axis")]),
        ["model 'm' does not batch", "output 'y' of a row changes when another row shares its batch"]),
    "zero-size-axis": (one_op(in_shape=["batch", 0], out_shape=["batch", 0]),
                       ["input 'x' declares a zero-size axis 1", "no data fits it"]),
    "batch-axis-fixed-twice": (make_model([helper.make_node("Add", ["x", "z"], ["y"])],
                                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4]),
                                           helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 4])],
                                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])]),
                               ["fix the batch axis at different sizes", "{'x': 1, 'z': 2}", "re-export"]),
    "unknown-domain-op": (make_model([helper.make_node("Frobnicate", ["x"], ["y"], domain="com.example")],
                                     [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                                     [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
                                     domains=["com.example"]),
                          ["ONNX Runtime cannot load m.onnx", "com.example:Frobnicate"]),
}


@pytest.mark.parametrize("profile_mode", ["static", "full"])
@pytest.mark.parametrize("case", list(UNSERVABLE))
def test_a_model_that_can_never_serve_is_refused_with_a_422_naming_the_problem(
        api: Api, tmp_path: Path, case: str, profile_mode: str) -> None:
    model, words = UNSERVABLE[case]

    message = refused(register(api, tmp_path, model, profile_mode=profile_mode))

    for word in words:
        assert word in message, message
    assert api.get("/v1/models/m").status_code == 404


BAD_METADATA = {
    "pad-not-an-integer": ({"sits.pad_token_id": "x"}, "sits.pad_token_id='x'", "an integer from 0 to"),
    "pad-negative": ({"sits.pad_token_id": "-1"}, "sits.pad_token_id='-1'", "an integer from 0 to"),
    "pad-empty": ({"sits.pad_token_id": ""}, "sits.pad_token_id=''", "an integer from 0 to"),
    "max-sequence-negative": ({"sits.max_sequence": "-5"}, "sits.max_sequence='-5'", "an integer >= 1"),
    "max-sequence-zero": ({"sits.max_sequence": "0"}, "sits.max_sequence='0'", "an integer >= 1"),
    "max-sequence-float": ({"sits.max_sequence": "12.5"}, "sits.max_sequence='12.5'", "an integer >= 1"),
    "mask-empty": ({"sits.attention_mask": ""}, "sits.attention_mask=''", "'attention_mask'"),
    "mask-names-no-input": ({"sits.attention_mask": "mask"}, "sits.attention_mask='mask'", "[batch, sequence]"),
}


@pytest.mark.parametrize("case", list(BAD_METADATA))
def test_bad_sits_metadata_is_refused_naming_the_key_and_the_allowed_values(
        api: Api, tmp_path: Path, case: str) -> None:
    metadata, key_and_value, allowed = BAD_METADATA[case]

    message = refused(register(api, tmp_path, token_model({"sits.attention_mask": "attention_mask", **metadata})))

    assert key_and_value in message and allowed in message, message


def test_bad_sits_metadata_is_refused_on_a_model_without_a_mask_too(api: Api, tmp_path: Path) -> None:
    message = refused(register(api, tmp_path, one_op(metadata={"sits.max_sequence": "-5"})))

    assert "sits.max_sequence='-5'" in message and "an integer >= 1" in message


def test_a_pad_token_id_beyond_the_token_inputs_dtype_is_refused_naming_it(api: Api, tmp_path: Path) -> None:
    model = token_model({"sits.attention_mask": "attention_mask", "sits.pad_token_id": str(2**31)},
                        token_type=TensorProto.INT32)

    message = refused(register(api, tmp_path, model))

    assert f"sits.pad_token_id='{2**31}'" in message and f"from 0 to {2**31 - 1}" in message
    assert "int32 input 'input_ids'" in message


def test_a_refused_full_profile_sends_no_task_and_stores_nothing(
        api: Api, tmp_path: Path, settings: Settings, redis_server: EmbeddedRedis) -> None:
    broker = redis.Redis.from_url(redis_server.url, decode_responses=True)

    def profile_tasks() -> int:
        return sum(json.loads(message)["headers"]["task"] == "sits.profile_model"
                   for message in broker.lrange(settings.redis.task_queue, 0, -1))

    before = profile_tasks()
    refused(register(api, tmp_path, one_op(in_shape=[], out_shape=[]), profile_mode="full", enable_fusion=True))

    assert profile_tasks() == before
    assert not (settings.paths.store() / "m").exists()
    broker.close()


# --- still registered ---------------------------------------------------------------------


def test_a_token_model_with_valid_sits_metadata_registers(api: Api, tmp_path: Path) -> None:
    model = token_model({"sits.attention_mask": "attention_mask", "sits.pad_token_id": "3",
                         "sits.max_sequence": "256", "sits.zoo": "anything"})

    response = register(api, tmp_path, model)

    assert response.status_code == 201, error_of(response)


@pytest.mark.parametrize("model", [
    one_op(in_shape=[1, 4], out_shape=[1, 4]),  # a fixed batch dim: profiled at that batch size
    one_op(in_shape=["batch", 4], out_shape=[1, 4]),  # dynamic_axes named for the input only: runs at any batch
    one_op("Identity", TensorProto.BOOL),
    one_op("Relu", TensorProto.FLOAT16),
    one_op("Identity", TensorProto.UINT8, ["batch", 2, 3], ["batch", 2, 3]),
], ids=["fixed-batch", "output-left-at-1", "bool", "float16", "uint8-rank-3"])
def test_servable_edge_cases_still_register(api: Api, tmp_path: Path, model: ModelProto) -> None:
    response = register(api, tmp_path, model)

    assert response.status_code == 201, error_of(response)


def test_a_node_without_a_cpu_kernel_registers_since_a_gpu_worker_may_have_one(api: Api, tmp_path: Path) -> None:
    # float32 in and out; Relu on bfloat16 has no CPU kernel in ONNX Runtime (NOT_IMPLEMENTED).
    nodes = [helper.make_node("Cast", ["x"], ["x_bf16"], to=TensorProto.BFLOAT16),
             helper.make_node("Relu", ["x_bf16"], ["y_bf16"]),
             helper.make_node("Cast", ["y_bf16"], ["y"], to=TensorProto.FLOAT)]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])])

    response = register(api, tmp_path, model)

    assert response.status_code == 201, error_of(response)


@pytest.mark.parametrize("elem_type", sorted(TensorProto.DataType.values()))
def test_registration_accepts_exactly_the_input_dtypes_requests_can_carry(elem_type: int) -> None:
    """check_servable and tensors.InputSpec (the request path) agree on every ONNX element type."""
    model = one_op("Identity", elem_type)
    try:
        InputSpec.from_entry({"name": "x", "dtype": dtype_name(elem_type), "shape": ["batch", 4],
                              "dynamic_axes": [0]})
        readable = True
    except SitsError:
        readable = False
    try:
        check_servable(model)
        registrable = True
    except SitsError:
        registrable = False

    assert registrable == readable, (TensorProto.DataType.Name(elem_type), sorted(CARRIED_DTYPE_KINDS))


def test_a_version_is_profiled_once_per_mode_and_the_task_bills_the_registrant_s_tenant(
        api: Api, tmp_path: Path, settings: Settings, redis_server: EmbeddedRedis) -> None:
    """Registering a version again (the same file) asks no second profile while the first is pending
    or done; another mode asks again. The task names whom its device time is billed to."""
    broker = redis.Redis.from_url(redis_server.url, decode_responses=True)

    def profile_tasks() -> list[list[Any]]:  # (oldest first: kombu pushes on the left)
        return [json.loads(base64.b64decode(json.loads(message)["body"]))[0]
                for message in reversed(broker.lrange(settings.redis.task_queue, 0, -1))
                if json.loads(message)["headers"]["task"] == "sits.profile_model"]

    model = one_op(in_shape=["batch", 4], out_shape=["batch", 4])
    before = len(profile_tasks())  # (other tests' tasks may wait in the session's queue)
    first = register(api, tmp_path, model, profile_mode="full")
    again = register(api, tmp_path, model, profile_mode="full")
    fused = register(api, tmp_path, model, profile_mode="full", enable_fusion=True)

    assert first.status_code == again.status_code == fused.status_code == 201
    sent = profile_tasks()[before:]
    assert [args[1:3] for args in sent] == [["full", False], ["full", True]]  # the second asked nothing
    assert sent[0][3:] == ["test", "test"]  # the admin key's tenant and name, whom the profile is billed to
    broker.close()


def memory_bomb(floats: int) -> ModelProto:
    """int64 x [batch, 1] -> y = x + 0 * sum(zeros(max(x) * floats)): a few hundred bytes whose run on rows of
    ones (the probes') allocates `floats` float32, as many as its input's values ask."""
    nodes = [helper.make_node("ReduceMax", ["x"], ["top"], keepdims=0),
             helper.make_node("Mul", ["top", "k"], ["count"]),
             helper.make_node("Reshape", ["count", "one"], ["shape"]),
             helper.make_node("ConstantOfShape", ["shape"], ["zeros"],
                              value=numpy_helper.from_array(np.zeros(1, np.float32))),
             helper.make_node("ReduceSum", ["zeros"], ["total"], keepdims=0),
             helper.make_node("Mul", ["total", "nothing"], ["none"]),
             helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["xf", "none"], ["y"])]
    constants = [numpy_helper.from_array(np.array(floats, np.int64), "k"),
                 numpy_helper.from_array(np.array([1], np.int64), "one"),
                 numpy_helper.from_array(np.array(0.0, np.float32), "nothing")]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.INT64, ["batch", 1])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1])], initializers=constants)


def test_a_model_whose_probes_allocate_past_the_registration_limit_is_refused_outside_the_api_process(
        api: Api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Registration runs the tenant's graph on two rows. Run in the API process, this one would take a GiB
    there (any amount, for another constant), beside every tenant's requests; run in a child under its limit,
    its allocation fails there and the registration is refused."""
    import resource

    from sits_api.intake import model_checks

    monkeypatch.setattr(model_checks, "CHECK_MEMORY_BYTES", 256 << 20)
    before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    response = register(api, tmp_path, memory_bomb(1 << 28), name="bomb")  # 1 GiB of zeros on rows of ones

    message = refused(response)
    assert "memory" in message and "bomb" in message
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kib < 512 << 10
    assert register(api, tmp_path, memory_bomb(1 << 10), name="small").status_code == 201  # (4 KiB: within it)
