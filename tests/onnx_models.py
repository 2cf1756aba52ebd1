"""Small hand-made ONNX graphs that more than one test folder builds."""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper


def fixed_batch_model(path: Path, rows_per_run: int) -> Path:
    """a, b [rows_per_run, 3] -> total = a + b, product = a * b: a model exported without a dynamic
    batch axis, as exporters write one by default."""
    def tensor(name: str) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, [rows_per_run, 3])

    graph = helper.make_graph([helper.make_node("Add", ["a", "b"], ["total"]),
                               helper.make_node("Mul", ["a", "b"], ["product"])],
                              "fixed", [tensor("a"), tensor("b")], [tensor("total"), tensor("product")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path
