"""Small hand-made ONNX graphs that more than one test folder builds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
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


def token_model(*, output_sequence_dim: str | None = "sequence", mask_first: bool = False,
                vocabulary: int = 50, hidden: int = 4) -> onnx.ModelProto:
    """A token model shaped as exporters write them, `sits.attention_mask` declared.

    input_ids, attention_mask int64 [batch, sequence] (the mask listed first when `mask_first`) ->
    last_hidden_state [batch, S, hidden] (each id's embedding, times the mask), scores [batch, S, S]
    (last_hidden_state times its transpose) and pooled [batch, hidden] (the mean over real tokens).
    S is `output_sequence_dim`: torch's exporter names it `<Op><output>_dim_1` when `dynamic_axes`
    lists only the inputs, None leaves it unnamed. Padded tokens are zero rows, so a right-padded
    row gives its own outputs back once they are cut to its length.
    """
    table = np.random.default_rng(0).standard_normal((vocabulary, hidden)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["embedding", "input_ids"], ["token_vectors"]),
             helper.make_node("Cast", ["attention_mask"], ["real"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["real", "feature_axis"], ["real_3d"]),
             helper.make_node("Mul", ["token_vectors", "real_3d"], ["last_hidden_state"]),
             helper.make_node("Transpose", ["last_hidden_state"], ["hidden_t"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["last_hidden_state", "hidden_t"], ["scores"]),
             helper.make_node("ReduceSum", ["last_hidden_state", "sequence_axis"], ["total"], keepdims=0),
             helper.make_node("ReduceSum", ["real", "sequence_axis"], ["count"], keepdims=1),
             helper.make_node("Div", ["total", "count"], ["pooled"])]
    inputs = [helper.make_tensor_value_info(name, TensorProto.INT64, ["batch", "sequence"])
              for name in ("input_ids", "attention_mask")]
    dim = output_sequence_dim
    graph = helper.make_graph(
        nodes, "token_model", inputs[::-1] if mask_first else inputs,
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", dim, hidden]),
         helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", dim, dim]),
         helper.make_tensor_value_info("pooled", TensorProto.FLOAT, ["batch", hidden])],
        [helper.make_tensor("embedding", TensorProto.FLOAT, [vocabulary, hidden], table.ravel().tolist()),
         helper.make_tensor("sequence_axis", TensorProto.INT64, [1], [1]),
         helper.make_tensor("feature_axis", TensorProto.INT64, [1], [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    helper.set_model_props(model, {"sits.attention_mask": "attention_mask"})
    return model


def last_position_model(*, vocabulary: int = 50, hidden: int = 4) -> onnx.ModelProto:
    """A causal decoder's shape, `sits.attention_mask` declared: input_ids, attention_mask int64 [batch,
    sequence] -> logits [batch, hidden], read at the last position (`logits[:, -1, :]`).

    Each position holds its token's embedding plus the mean of the real tokens up to it (a causal,
    masked attention's context). The mask keeps pads out of every real position, but the last position
    of a row padded on the right is a pad: its logits are the pad's embedding plus the row's context.
    """
    table = np.random.default_rng(1).standard_normal((vocabulary, hidden)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["embedding", "input_ids"], ["token_vectors"]),
             helper.make_node("Cast", ["attention_mask"], ["real"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["real", "feature_axis"], ["real_3d"]),
             helper.make_node("Mul", ["token_vectors", "real_3d"], ["real_vectors"]),
             helper.make_node("CumSum", ["real_vectors", "sequence_axis"], ["running_total"]),
             helper.make_node("CumSum", ["real_3d", "sequence_axis"], ["running_count"]),
             helper.make_node("Div", ["running_total", "running_count"], ["context"]),
             helper.make_node("Add", ["token_vectors", "context"], ["hidden_states"]),
             helper.make_node("Gather", ["hidden_states", "last_position"], ["logits"], axis=1)]
    graph = helper.make_graph(
        nodes, "last_position",
        [helper.make_tensor_value_info(name, TensorProto.INT64, ["batch", "sequence"])
         for name in ("input_ids", "attention_mask")],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", hidden])],
        [helper.make_tensor("embedding", TensorProto.FLOAT, [vocabulary, hidden], table.ravel().tolist()),
         helper.make_tensor("sequence_axis", TensorProto.INT64, [], [1]),
         helper.make_tensor("feature_axis", TensorProto.INT64, [1], [2]),
         helper.make_tensor("last_position", TensorProto.INT64, [], [-1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    helper.set_model_props(model, {"sits.attention_mask": "attention_mask"})
    return model


def int_series_model() -> onnx.ModelProto:
    """x int64 [batch, steps] -> total int64 [batch] (the sum over the steps): an int input with a dynamic
    sequence axis that holds no token ids (deltas, counts), so negative values are fine."""
    graph = helper.make_graph([helper.make_node("ReduceSum", ["x", "steps_axis"], ["total"], keepdims=0)], "int_series",
                              [helper.make_tensor_value_info("x", TensorProto.INT64, ["batch", "steps"])],
                              [helper.make_tensor_value_info("total", TensorProto.INT64, ["batch"])],
                              [helper.make_tensor("steps_axis", TensorProto.INT64, [1], [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def with_looked_up_input(model: onnx.ModelProto, name: str, table_rows: int, *, first: bool = True) -> onnx.ModelProto:
    """`model` with one more int64 [batch, sequence] input, `name`, looked up in a `table_rows`-row table
    (token type ids, position ids), listed first among the inputs (else last)."""
    entry = helper.make_tensor_value_info(name, TensorProto.INT64, ["batch", "sequence"])
    if first:
        model.graph.input.insert(0, entry)
    else:
        model.graph.input.append(entry)
    model.graph.initializer.append(helper.make_tensor(f"{name}_table", TensorProto.FLOAT, [table_rows, 4],
                                                      [0.0] * 4 * table_rows))
    model.graph.node.append(helper.make_node("Gather", [f"{name}_table", name], [f"{name}_vectors"]))
    return model
