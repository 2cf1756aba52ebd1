"""One tenant's oversized request in a merged batch (real Redis, a real `WorkerContext`, ONNX Runtime under a
64 MiB memory arena in a process of its own, as `resources.host_memory_limit` sets it on a worker).

A request whose run needs more memory than the worker has (a 6,000-token row of a sequence model, or an
allocation its input's values size) fails on its own. Before, it failed every request merged with it, each
losing an attempt, retried together with it until all failed; it counted on the model's breaker (one failure
in 20 runs opens it: every tenant's next request a 503) and cut the model's batches to one row for a minute.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from broker.state.embedded import EmbeddedRedis
from tests.onnx_models import token_model

SCRIPT = """
import json, sys, time
import numpy as np
from broker.config.settings import Settings
from broker.models import registry
from broker.online import requests
from broker.online.requests import RequestSpec
from broker.state.store import Store
from sits_worker.device.pinning import Device
from sits_worker.device.runtime import SessionCache, limit_host_memory
from sits_worker.model.graph import static_profile
from sits_worker.serving.context import WorkerContext
from sits_worker.serving.request_runs import run_requests
from tests.leasing import lease_items
import onnx

limit_host_memory(64 * 2**20)
url, folder = sys.argv[1], sys.argv[2]
store = Store.connect(url, key_prefix="oversized")
for name in ("tok", "sized"):
    path = f"{folder}/{name}.onnx"
    profile = static_profile(onnx.load(path))
    registry.save_model_version(store, {"name": name, "version": "v1", "ref": f"{name}@v1", "path": path,
                                        "signature": profile["signature"], "static_profile": profile})
ctx = WorkerContext(settings=Settings(), store=store, device=Device("cpu"), streams=1,
                    sessions=SessionCache(Device("cpu"), 1))

def submit(model, request_id, tenant, inputs, tokens=None):
    rows = next(iter(inputs.values())).shape[0]
    spec = RequestSpec(request_id=request_id, model_name=model, model_version="v1", inputs=inputs, rows=rows,
                       tokens=tokens, bucket="b", factors={"level": 0, "enqueued_at": time.time()},
                       owner=f"{tenant}-key", tenant=tenant)
    requests.submit_request(store, spec, score=time.time(), now=time.time(), max_age_seconds=600)

def drain(model):
    items = lease_items(store, f"{model}@v1", now=time.time(), lease_seconds=30, max_items=32)
    run_requests(ctx, items)
    return len(items)

def status(request_id):
    record = store.client.hgetall(store.keys.request(request_id))
    return record.get("status"), record.get("error_code") or ""

ids = lambda length: np.arange(1, length + 1, dtype=np.int64).reshape(1, length) % 40 + 1
for n in range(25):  # acme's traffic: runs of 512 tokens work
    submit("tok", f"ok-{n}", "acme", {"input_ids": ids(512)}, tokens=512)
    drain("tok")
for n in range(3):
    submit("tok", f"along-{n}", "acme", {"input_ids": ids(512)}, tokens=512)
submit("tok", "long", "evil", {"input_ids": ids(6000)}, tokens=6000)  # its scores alone: 144 MB
merged_tok = drain("tok")  # (one batch, padded to 6,000 tokens a row)
now = time.time()
tok = {"merged": merged_tok, "breaker": ctx.breakers.breaker("tok@v1").state,
       "may_lease": ctx.breakers.may_lease("tok@v1", now=now), "ceiling": ctx.ceilings.rows("tok@v1", now=now),
       "acme": [status(f"along-{n}") for n in range(3)], "evil": status("long")}

row = lambda size: {"x": np.ones((1, 4), np.float32), "n": np.array([size])}
for n in range(25):  # acme's traffic: one-row runs work
    submit("sized", f"fine-{n}", "acme", row(1))
    drain("sized")
submit("sized", "alone", "evil", row(10**6))  # 4 GB of zeros, asked by one row of normal size
drain("sized")
alone = {"breaker": ctx.breakers.breaker("sized@v1").state, "evil": status("alone")}
for n in range(3):
    submit("sized", f"acme-{n}", "acme", row(1))
submit("sized", "bomb", "evil", row(10**6))
for n in range(3, 6):
    submit("sized", f"acme-{n}", "acme", row(1))
merged = drain("sized")
sized = {"merged": merged, "acme": [status(f"acme-{n}") for n in range(6)], "evil": status("bomb"),
         "breaker": ctx.breakers.breaker("sized@v1").state, "ceiling": ctx.ceilings.rows("sized@v1", now=time.time()),
         "oom_steps": dict(ctx.oom_steps)}
print(json.dumps({"tok": tok, "alone": alone, "sized": sized}))
"""


def value_sized_model() -> onnx.ModelProto:
    """x [batch, 4] -> y = x, after allocating max(n) x 1024 floats: an allocation the input's values size."""
    node = helper.make_node
    graph = helper.make_graph(
        [node("ReduceMax", ["n"], ["most"], keepdims=1), node("Concat", ["most", "width"], ["shape"], axis=0),
         node("ConstantOfShape", ["shape"], ["big"]), node("ReduceSum", ["big"], ["total"], keepdims=0),
         node("Mul", ["total", "zero"], ["nothing"]), node("Add", ["x", "nothing"], ["y"])],
        "value_sized", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
                        helper.make_tensor_value_info("n", TensorProto.INT64, ["batch"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor("width", TensorProto.INT64, [1], [1024]),
         helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_an_oversized_request_fails_alone_and_leaves_the_model_s_breaker_and_batches_to_the_others(
        redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    onnx.save(token_model(), tmp_path / "tok.onnx")
    onnx.save(value_sized_model(), tmp_path / "sized.onnx")

    done = subprocess.run([sys.executable, "-c", SCRIPT, redis_server.url, str(tmp_path)], capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])

    tok, alone, sized = outcome["tok"], outcome["alone"], outcome["sized"]
    assert tok["merged"] == 4 and tok["acme"] == [["succeeded", ""]] * 3, tok  # (its neighbours ran)
    assert tok["breaker"] == "closed" and tok["may_lease"], tok  # (larger than any run that worked: its own)
    assert tok["ceiling"] is None, tok  # (batches of the model keep their size: its rows were the cause)
    assert tok["evil"] == ["queued", ""], tok  # (its own failure: it waits out its class's backoff alone)
    assert alone == {"breaker": "closed", "evil": ["queued", ""]}, alone  # (one row of a size that ran)
    assert sized["merged"] == 7 and sized["breaker"] == "closed", sized
    assert sized["ceiling"] is None, sized  # (its neighbours' rows ran: the bomb's row was the cause, not their number)
    assert sized["acme"] == [["succeeded", ""]] * 6, sized  # (its neighbours' rows ran, their outputs kept)
    assert sized["evil"] == ["queued", ""], sized  # (failed on its own, retried later by its class)
