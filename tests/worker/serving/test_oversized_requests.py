"""One tenant's oversized request in a merged batch (real Redis, a real `WorkerContext`, ONNX Runtime under a
64 MiB memory arena in a process of its own, as `resources.host_memory_limit` sets it on a worker).

A request whose run needs more memory than the worker has (a 6,000-token row of a sequence model, or an
allocation its input's values size) fails on its own. Before, it failed every request merged with it, each
losing an attempt, retried together with it until all failed; it counted on the model's breaker (one failure
in 20 runs opens it: every tenant's next request a 503) and cut the model's batches to one row for a minute.

A long row that fits alone, padded beside others' short rows, runs out of memory at two rows, never at one:
the model's ceiling is then learnt at that width, and batches of the usual width keep their rows.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import onnx
from onnx import TensorProto, helper

from broker.state.embedded import EmbeddedRedis
from tests.onnx_models import token_model

SETUP = """
import json, sys, time
from pathlib import Path
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
url, folder, prefix = sys.argv[1], sys.argv[2], sys.argv[3]
store = Store.connect(url, key_prefix=prefix)
for model_path in sorted(Path(folder).glob("*.onnx")):
    name, path = model_path.stem, str(model_path)
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
"""

SCRIPT = SETUP + """
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


PADDED_SCRIPT = SETUP + """
LONG = 1780  # one row of it fits in the arena alone; two padded to it do not (the window is about 1720-1840)
runs = []
run_on_device = ctx._run_on_device
def counted(model_ref, feed, output_names, session):
    runs.append(list(feed["input_ids"].shape))
    return run_on_device(model_ref, feed, output_names, session)
ctx._run_on_device = counted

def batch(prefix, tenant, lengths):
    for n, length in enumerate(lengths):
        submit("tok", f"{prefix}-{n}", tenant, {"input_ids": ids(length)}, tokens=length)
    return drain("tok")

for n in range(8):  # acme's traffic: runs of 512 tokens work
    batch(f"usual-{n}", "acme", [512])
batch("teach", "evil", [LONG])  # alone it fits: rows of its width have run here, so an OOM at them is the device's
for n in range(3):
    submit("tok", f"along-{n}", "acme", {"input_ids": ids(512)}, tokens=512)
submit("tok", "long", "evil", {"input_ids": ids(LONG)}, tokens=LONG)
merged = drain("tok")  # (one batch of 4 rows, padded to LONG tokens a row)
now = time.time()
padded = {"merged": merged, "oom_steps": dict(ctx.oom_steps), "in_force": ctx.ceilings.in_force(now=now),
          "ceiling_long": ctx.ceilings.rows("tok@v1", now=now, tokens_per_row=LONG),
          "ceiling_usual": ctx.ceilings.rows("tok@v1", now=now, tokens_per_row=512),
          "acme": [status(f"along-{n}") for n in range(3)], "evil": status("long")}
runs.clear()
after = batch("after", "acme", [512] * 3)  # (acme's 3 rows again, without the long one)
print(json.dumps({**padded, "after": after, "after_runs": runs,
                  "after_acme": [status(f"after-{n}") for n in range(3)]}))
"""


def _run(script: str, redis_server: EmbeddedRedis, folder: Path, key_prefix: str) -> dict[str, Any]:
    """The outcome `script` prints last, run in a process of its own under the 64 MiB arena."""
    done = subprocess.run([sys.executable, "-c", script, redis_server.url, str(folder), key_prefix],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    outcome: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return outcome


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

    outcome = _run(SCRIPT, redis_server, tmp_path, "oversized")

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


def test_a_long_row_padded_beside_short_ones_lowers_the_ceiling_at_its_width_not_for_the_usual_batches(
        redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    onnx.save(token_model(), tmp_path / "tok.onnx")

    padded = _run(PADDED_SCRIPT, redis_server, tmp_path, "padded")

    assert padded["merged"] == 4 and padded["oom_steps"].get("halve", 0) >= 1, padded  # (4 x 1,780 ran out)
    assert padded["acme"] == [["succeeded", ""]] * 3 and padded["evil"] == ["succeeded", ""], padded
    assert padded["in_force"] == {"tok@v1": 1} and padded["ceiling_long"] == 1, padded  # (as wide: cut as before)
    assert padded["ceiling_usual"] is None, padded  # (narrower batches are not bounded by it)
    assert padded["after"] == 3 and padded["after_runs"] == [[3, 512]], padded  # (acme's 3 rows: one run, not 3)
    assert padded["after_acme"] == [["succeeded", ""]] * 3, padded
