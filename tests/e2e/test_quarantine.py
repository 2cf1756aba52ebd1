"""Bad-row quarantine through a real stack (Redis, API, a Celery worker): a 20,000-row transformer job
with 5 token ids past the vocabulary succeeds with exactly those rows quarantined and every other
row as a direct ONNX Runtime run gives it; a merged online batch with one bad request (a value the
worker's `faults.fail_values` fails through the real error path) answers the others."""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest

from sits_api.cli.client import ApiError
from sits_api.cli.stack import Stack
from sits_worker.model.zoo import TRANSFORMER_VOCAB, mlp_reference
from tests.e2e.stack_helpers import collect, direct_run, frozen, start_zoo_stack, wait_job

BAD_VALUE = 7.5
BAD_ROWS = [17, 4096, 9999, 10000, 19999]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    running = start_zoo_stack(tmp_path_factory.mktemp("quarantine") / "home", streams=2,
                              jobs={"max_bad_rows": len(BAD_ROWS)},
                              faults={"enabled": True, "fail_values": [BAD_VALUE]})
    yield running
    running.stop()


def test_a_job_with_five_bad_rows_among_20000_quarantines_exactly_those(stack: Stack) -> None:
    client = stack.client()
    ids = np.random.default_rng(0).integers(1, TRANSFORMER_VOCAB, (20_000, 8)).astype(np.int64)
    bad_ids = ids.copy()
    bad_ids[BAD_ROWS, 3] = TRANSFORMER_VOCAB + np.arange(len(BAD_ROWS))  # past the embedding table
    np.save(stack.home / "ids.npy", bad_ids)
    out = stack.home / "ids-out"

    job = client.post("/v1/jobs", {"model": "transformer", "input_batch": str(stack.home / "ids.npy"),
                                   "chunk_size": 2000, "batch_size": 256, "output_dir": str(out)})
    done = wait_job(client, job["id"], timeout=90)

    assert done["status"] == "succeeded" and done["rows_quarantined"] == len(BAD_ROWS), done
    assert done["rows_done"] == 20_000 and done["manifest"]["quarantined_rows"] == BAD_ROWS
    assert done["retries"] == {}  # the bad rows were settled within their chunks' runs
    entries = [json.loads(line) for line in (out / "quarantine.jsonl").read_text().splitlines()]
    assert [entry["row"] for entry in entries] == BAD_ROWS
    assert all("vocabulary" in entry["error"] for entry in entries), entries
    [output] = done["manifest"]["outputs"].values()
    results = np.load(out / output["file"])
    expected = direct_run(stack.home / "models" / "transformer.onnx", ids, 256)
    good = np.setdiff1d(np.arange(20_000), BAD_ROWS)
    np.testing.assert_allclose(results[good], expected[good], rtol=1e-5, atol=1e-6)
    assert np.isnan(results[BAD_ROWS]).all()


def test_a_merged_online_batch_with_one_bad_request_answers_the_others(stack: Stack) -> None:
    client = stack.client()
    rows = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    rows[5, 3] = BAD_VALUE
    with frozen(stack, "worker0"):  # all eight wait, then run as one merged batch
        ids = [client.post("/v1/requests", {"model": "mlp", "inputs": {"features": rows[row : row + 1].tolist()}})[
            "id"] for row in range(len(rows))]
    results = [collect(client, ids)[request_id] for request_id in ids]

    bad = results.pop(5)
    assert bad["status"] == "failed" and bad["error_code"] == "bad_input" and "holds 7.5" in bad["error"], bad
    assert all(result["status"] == "succeeded" and result["batch_size"] == 8 for result in results), results
    good = np.delete(rows, 5, axis=0)
    np.testing.assert_allclose(np.array([result["outputs"]["logits"][0] for result in results]), mlp_reference(good),
                               rtol=1e-4, atol=1e-5)

    with pytest.raises(ApiError, match="holds 7.5") as refused:  # v2: the model's own error, as a 400
        client.post("/v2/models/mlp/infer", {"inputs": [{"name": "features", "shape": [1, 64], "datatype": "FP32",
                                                        "data": rows[5].tolist()}]})
    assert refused.value.http_status == 400
