"""`scheduler.policy` through a real stack where memory binds: graph-aware-backfill fills the memory the
head of the priority order cannot use with batches of other models, round-robin waits for it; both
give every request its exact result.

The worker's ledger holds 254 MiB in 2 MiB units. A full transformer batch (64 rows within 8192
tokens: 16 requests of 512 tokens, 250.1 MiB by the static profile) reserves 126 units and leaves one
beside it: too small for one transformer sequence (128 tokens, 3.9 MiB), room for one convnet row
(1.9 MiB) or 64 mlp rows. The transformer's requests have priority 10, so under the dynamic ordering
they head the priority order while one waits. The same traffic for both policies: 48 transformer, 64
mlp and 64 convnet one-row requests, all queued before the worker looks at them.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from broker.memory.ledger import round_up
from broker.memory.reservation import BatchCost
from broker.models.model_record import ModelRecord
from sits_api.cli.client import ApiClient
from sits_api.cli.stack import Stack
from sits_worker.model.zoo import build_zoo, mlp_reference
from tests.e2e.stack_helpers import collect, direct_run, frozen, register, stack_settings

CAPACITY = 254 * 2**20
UNIT = 2 * 2**20
MAX_ROWS, MAX_TOKENS = 64, 8192
TRANSFORMER_PRIORITY = 10
COUNTS = {"transformer": 48, "mlp": 64, "convnet": 64}
INPUT_NAMES = {"transformer": "input_ids", "mlp": "features", "convnet": "pixels"}
OUTPUT_NAMES = {"transformer": "embedding", "mlp": "logits", "convnet": "logits"}


def make_inputs(seed: int = 0, counts: dict[str, int] = COUNTS) -> dict[str, np.ndarray]:
    """Model -> its requests' rows, one row per request."""
    rng = np.random.default_rng(seed)
    return {"transformer": rng.integers(1, 1000, size=(counts["transformer"], 512)).astype(np.int64),
            "mlp": rng.standard_normal((counts["mlp"], 64)).astype(np.float32),
            "convnet": rng.standard_normal((counts["convnet"], 3, 32, 32)).astype(np.float32)}


def check_premise(records: dict[str, dict[str, Any]]) -> None:
    """The arithmetic of the module docstring, by the profile costs the worker admits batches with (each
    record as the API answered it)."""
    def cost(name: str) -> BatchCost:
        return BatchCost.of(ModelRecord.of(records[name]), max_rows=MAX_ROWS, max_tokens=MAX_TOKENS)

    assert round_up(cost("transformer").full_need(), UNIT) == CAPACITY - UNIT, "a full batch must leave one unit"
    assert cost("transformer").within("transformer", UNIT, math.inf) is None, "one unit must not hold a sequence"
    assert cost("convnet").within("convnet", UNIT, math.inf) is not None, "one unit must hold a convnet row"
    assert cost("mlp").within("mlp", UNIT, math.inf) is not None, "one unit must hold mlp rows"


def submit_all(client: ApiClient, inputs: dict[str, np.ndarray]) -> dict[str, list[str]]:
    """Queue every request without waiting, the models interleaved; model -> request ids by row."""
    counts = {name: len(rows) for name, rows in inputs.items()}
    order = [(name, row) for row in range(max(counts.values())) for name in counts if row < counts[name]]

    def submit(name_row: tuple[str, int]) -> str:
        name, row = name_row
        body = {"model": name, "inputs": {INPUT_NAMES[name]: inputs[name][row : row + 1].tolist()},
                "priority": TRANSFORMER_PRIORITY if name == "transformer" else 0}
        return client.post("/v1/requests", body)["id"]

    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(submit, order))
    by_model: dict[str, list[str]] = {name: [] for name in counts}
    for (name, _), request_id in zip(order, ids, strict=True):
        by_model[name].append(request_id)
    return by_model


def ledger_after(client: ApiClient, moment: float, timeout: float = 10.0) -> dict[str, Any]:
    """The worker's ledger stats in `GET /v1/status`, from its first heartbeat after `moment`."""
    deadline = time.monotonic() + timeout
    while (worker := client.get("/v1/status")["workers"][0])["last_heartbeat"] <= moment:
        assert time.monotonic() < deadline, worker
        time.sleep(0.1)
    return worker["memory"]


def run_queued(tmp_path: Path, policy: str, inputs: dict[str, np.ndarray]) -> tuple[
        dict[str, Path], dict[str, list[str]], dict[str, dict[str, Any]], dict[str, Any]]:
    """A stack under `policy` with the module's memory cap: queue `inputs` while the worker is frozen,
    collect every result; (model paths, request ids by model, results by id, the worker's ledger stats)."""
    home = tmp_path / "home"
    settings = stack_settings(home, streams=2).with_overrides(
        # the worker is frozen while the traffic is queued: not long enough to be taken for dead
        scheduler={"policy": policy, "worker_heartbeat_timeout": "30s", "ticket_timeout": "30s"},
        resources={"device_memory": CAPACITY, "device_memory_limit": CAPACITY, "cpu_memory_granularity": UNIT},
        online={"batching": {"max_batch_size": MAX_ROWS, "max_batch_tokens": MAX_TOKENS}})
    with Stack(settings, worker_count=1, api_port=0) as stack:
        models = build_zoo(home / "models")
        client = stack.client()
        check_premise({name: register(client, name, models[name]) for name in COUNTS})
        with frozen(stack, "worker0"):
            ids = submit_all(client, inputs)
        results = collect(client, [request_id for model_ids in ids.values() for request_id in model_ids])
        memory = ledger_after(client, time.time())
    return models, ids, results, memory


@pytest.mark.parametrize("policy", [pytest.param("round-robin", marks=pytest.mark.slow),  # (the baseline: -m slow)
                                    "graph-aware-backfill"])
def test_backfill_fills_memory_the_head_cannot_use_where_round_robin_waits(tmp_path: Path, policy: str):
    """graph-aware-backfill runs the convnet one row at a time in the unit a transformer batch leaves
    free (counted as backfills); round-robin runs the convnet as one full batch in its turn, and the
    transformer's turn waits for memory (memory waits, no backfills). Every result is exact."""
    inputs = make_inputs()
    models, ids, results, memory = run_queued(tmp_path, policy, inputs)

    expected = {"transformer": direct_run(models["transformer"], inputs["transformer"], 16),
                "mlp": mlp_reference(inputs["mlp"]),
                "convnet": direct_run(models["convnet"], inputs["convnet"], 16)}
    for name, model_ids in ids.items():
        for row, request_id in enumerate(model_ids):
            result = results[request_id]
            assert result["status"] == "succeeded", result
            np.testing.assert_allclose(np.array(result["outputs"][OUTPUT_NAMES[name]])[0], expected[name][row],
                                       rtol=1e-4, atol=1e-5, err_msg=f"{name} request {row} under {policy}")

    assert (memory["capacity_bytes"], memory["granularity_bytes"]) == (CAPACITY, UNIT), memory
    convnet_batches = sorted({results[request_id]["batch_size"] for request_id in ids["convnet"]})
    if policy == "graph-aware-backfill":
        assert memory["backfills"] > 0, memory
        assert convnet_batches[0] == 1, f"convnet batch sizes {convnet_batches}: none cut to the one free unit"
    else:
        assert memory["backfills"] == 0 and memory["memory_waits"] > 0, memory
        assert convnet_batches[0] > 1, f"convnet batch sizes {convnet_batches}: round-robin cut one to a hole"


def test_the_head_runs_the_batch_that_waits_for_it_when_that_fits_beside_a_running_batch(tmp_path: Path):
    """Round-robin, 4 transformer requests (62.5 MiB) among convnet and mlp traffic: a full transformer
    batch (250 MiB) never fits beside a running convnet batch, but the 4 waiting requests always do
    (32 + 61 units of 127), so the transformer's turn runs them at once instead of waiting for an
    idle device: hardly a memory wait, one batch of 4, every result exact."""
    inputs = make_inputs(1, {"transformer": 4, "mlp": 64, "convnet": 64})
    models, ids, results, memory = run_queued(tmp_path, "round-robin", inputs)

    expected = direct_run(models["transformer"], inputs["transformer"], 4)
    for row, request_id in enumerate(ids["transformer"]):
        assert results[request_id]["status"] == "succeeded", results[request_id]
        np.testing.assert_allclose(np.array(results[request_id]["outputs"]["embedding"])[0], expected[row],
                                   rtol=1e-4, atol=1e-5)
    assert {results[request_id]["batch_size"] for request_id in ids["transformer"]} == {4}
    assert all(results[request_id]["status"] == "succeeded" for model_ids in ids.values() for request_id in model_ids)
    # A slot that decides during another's whole-batch hold (the round trip of its lease, the hold
    # covering the free memory) waits about a millisecond: 0-1 here. Waiting for an idle device, as
    # the head did before it could run its waiting batch, gave 59-82 on the same test.
    assert memory["memory_waits"] <= 20 and memory["backfills"] == 0, memory
