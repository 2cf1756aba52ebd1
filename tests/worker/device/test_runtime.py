"""ONNX Runtime sessions as SITS builds them."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from broker.errors import InvalidModel
from sits_worker.device.pinning import Device
from sits_worker.device.runtime import (
    INTRA_OP_SPIN_MICROSECONDS,
    build_session,
    fixed_batch_rows,
    run_session,
    session_options,
)
from tests.onnx_models import fixed_batch_model


def test_session_options_bound_the_intra_op_spin() -> None:
    options = session_options(2)

    assert options.intra_op_num_threads == 2
    assert options.get_session_config_entry("session.intra_op.spin_duration_us") == str(INTRA_OP_SPIN_MICROSECONDS)


def test_idle_intra_op_threads_stop_spinning_soon_after_a_run(zoo_dir: Path) -> None:
    session = build_session(zoo_dir / "mlp.onnx", Device("cpu"), 2)
    features = np.ones((128, 64), np.float32)
    for _ in range(200):
        run_session(session, {"features": features})

    cpu_before = time.process_time()
    time.sleep(0.1)
    cpu_while_idle = time.process_time() - cpu_before

    # onnxruntime's default spin burns about 40 ms of a core here; what runs between batches needs it
    assert cpu_while_idle < 0.02


@pytest.mark.parametrize(("rows_per_run", "rows"), [(1, 1), (1, 5), (4, 3), (4, 4), (4, 10), (4, 12)])
def test_a_model_with_a_fixed_batch_axis_runs_any_number_of_rows(tmp_path: Path, rows_per_run: int,
                                                                  rows: int) -> None:
    session = build_session(fixed_batch_model(tmp_path / "fixed.onnx", rows_per_run), Device("cpu"), 1)
    a = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    b = a[::-1] - 7

    total, product = run_session(session, {"a": a, "b": b}, ["total", "product"])

    assert fixed_batch_rows(session) == rows_per_run
    np.testing.assert_array_equal(total, a + b)  # every row its own, none of the padding
    np.testing.assert_array_equal(product, a * b)


def test_a_model_with_a_dynamic_batch_axis_runs_in_one_piece(zoo_dir: Path) -> None:
    session = build_session(zoo_dir / "mlp.onnx", Device("cpu"), 1)

    assert fixed_batch_rows(session) is None
    assert run_session(session, {"features": np.ones((3, 64), np.float32)})[0].shape == (3, 10)


def test_an_output_without_the_batch_axis_first_is_an_invalid_model_naming_it(tmp_path: Path) -> None:
    """[N, 4] -> Transpose -> [4, N], declared with a dynamic first axis: registration cannot tell, the
    run does, before any row gets another row's outputs."""
    graph = helper.make_graph([helper.make_node("Transpose", ["x"], ["y"], perm=[1, 0])], "transposed",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["cols", "N"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "transposed.onnx")
    session = build_session(tmp_path / "transposed.onnx", Device("cpu"), 1)

    with pytest.raises(InvalidModel, match=r"model output 'y' came back with shape \[4, 3\] from a batch of 3 rows"):
        run_session(session, {"x": np.ones((3, 4), np.float32)}, ["y"])


HOST_MEMORY_SCRIPT = """
import resource, sys
import numpy as np
from broker.config.settings import Settings
from broker.errors import DeviceOutOfMemory
from sits_worker.device.pinning import Device
from sits_worker.device.runtime import run_session
from sits_worker.device.worker_settings import WorkerSettings
from sits_worker.serving.context import WorkerContext

settings = Settings().with_overrides(redis={"url": sys.argv[2]}, resources={"host_memory_limit": "256MiB"})
context = WorkerContext.create(WorkerSettings(settings=settings, device=Device("cpu"), streams=1, intra_op_threads=1))
session = context.sessions.get("bomb@1", sys.argv[1])
small = run_session(session, {"rows": np.array([[1000]], np.int64)})[0]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
try:
    run_session(session, {"rows": np.array([[200_000_000]], np.int64)})  # 800 MB of float32
    print("ran", small.tolist())
except DeviceOutOfMemory as err:
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024 - before
    print("refused", small.tolist(), grew, err.message)
"""


def value_sized_model() -> onnx.ModelProto:
    """A row's output is the sum of a tensor of ones as long as its input's value says: what it allocates
    is chosen by the request, not by the graph."""
    node = helper.make_node
    graph = helper.make_graph(
        [node("Reshape", ["rows", "flat"], ["length"]),
         node("ConstantOfShape", ["length"], ["ones"], value=helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])),
         node("ReduceSum", ["ones"], ["total"], keepdims=1),
         node("Reshape", ["total", "row"], ["sum"])],
        "value_sized", [helper.make_tensor_value_info("rows", TensorProto.INT64, [1, 1])],
        [helper.make_tensor_value_info("sum", TensorProto.FLOAT, [1, 1])],
        initializer=[helper.make_tensor("flat", TensorProto.INT64, [1], [1]),
                     helper.make_tensor("row", TensorProto.INT64, [2], [1, 1])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_a_worker_s_sessions_allocate_at_most_its_host_memory_limit_whatever_a_request_asks(
        tmp_path: Path, redis_server: Any) -> None:
    """A graph whose allocation follows its input's value (800 MB asked by one request) fails that run as out
    of memory past `resources.host_memory_limit` (256 MiB here), rather than taking the host's memory: in a
    worker process of its own, as ONNX Runtime keeps one such limit a process."""
    import subprocess
    import sys
    onnx.save(value_sized_model(), tmp_path / "bomb.onnx")

    done = subprocess.run([sys.executable, "-c", HOST_MEMORY_SCRIPT, str(tmp_path / "bomb.onnx"), redis_server.url],
                          capture_output=True, text=True, timeout=120)

    outcome = done.stdout.split()
    assert outcome[:2] == ["refused", "[[1000.0]]"], done.stdout + done.stderr
    assert int(outcome[2]) < 300, done.stdout  # (the peak resident MiB it grew by: the 800 MB were never taken)
    assert "device out of memory" in done.stdout
