"""Token models shaped as exporters write them, through a real stack.

Outputs whose sequence dim an exporter named its own way (or left unnamed) are cut back to every merged
request's own length, as registration saw by running the model; an int input that holds no token ids
takes negative values; a model that lists its mask before its ids has the ids checked against its
vocabulary; a model that reads the last position (a decoder's next-token logits) is not padded at all.
Requests are queued while the one worker is frozen, so its one stream slot finds them all waiting and
merges them into one padded batch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from sits_api.cli.stack import Stack
from tests.e2e.stack_helpers import collect, frozen, register, stack_settings, wait_job
from tests.onnx_models import int_series_model, last_position_model, token_model

EXPORTER_DIMS = {"renamed": "Mullast_hidden_state_dim_1", "unnamed": None}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("tokens") / "home"
    settings = stack_settings(home, streams=1).with_overrides(
        scheduler={"worker_heartbeat_timeout": "30s", "ticket_timeout": "30s"})  # frozen while requests queue
    running = Stack(settings, worker_count=1, api_port=0).start()
    client = running.client()
    models = {**{name: token_model(output_sequence_dim=dim) for name, dim in EXPORTER_DIMS.items()},
              "series": int_series_model(), "mask_first": token_model(mask_first=True),
              "last_position": last_position_model()}
    for name, model in models.items():
        onnx.save(model, home / f"{name}.onnx")
        register(client, name, home / f"{name}.onnx")
    yield running
    running.stop()


@pytest.mark.parametrize("name", list(EXPORTER_DIMS))
def test_merged_requests_get_their_own_length_however_the_output_dims_are_named(stack, name):
    """Lengths 5, 8, 7 and 3 share the length class 8: one batch padded to 8, and every request gets back
    exactly its own length of every per-token output, with the values of a run of its own."""
    client = stack.client()
    rng = np.random.default_rng(5)
    sequences = [rng.integers(1, 50, (1, length)).astype(np.int64) for length in (5, 8, 7, 3)]
    with frozen(stack, "worker0"):
        ids = [client.post("/v1/requests", {"model": name, "inputs": {"input_ids": ids.tolist()}})["id"]
               for ids in sequences]
    results = collect(client, ids)

    session = ort.InferenceSession(str(stack.home / f"{name}.onnx"), providers=["CPUExecutionProvider"])
    names = [output.name for output in session.get_outputs()]
    for request_id, tokens in zip(ids, sequences, strict=True):
        result = results[request_id]
        assert result["status"] == "succeeded" and result["batch_size"] == 4, result
        alone = session.run(names, {"input_ids": tokens, "attention_mask": np.ones_like(tokens)})
        for output, expected in zip(names, alone, strict=True):
            got = np.array(result["outputs"][output], dtype=np.float32)
            assert got.shape == expected.shape, (output, tokens.shape)
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_a_model_that_reads_the_last_position_merges_requests_only_at_equal_lengths(stack):
    """Padded to 6, the length-3 request's logits would be a pad position's: it runs alone and gets its
    own, while the two requests of length 6 still share one batch."""
    client = stack.client()
    rng = np.random.default_rng(8)
    sequences = [rng.integers(1, 50, (1, length)).astype(np.int64) for length in (3, 6, 6)]
    with frozen(stack, "worker0"):  # (unpadded, the model's mask is a required input like any other)
        ids = [client.post("/v1/requests", {"model": "last_position", "inputs": {
            "input_ids": ids.tolist(), "attention_mask": np.ones_like(ids).tolist()}})["id"] for ids in sequences]
    results = collect(client, ids)

    session = ort.InferenceSession(str(stack.home / "last_position.onnx"), providers=["CPUExecutionProvider"])
    for request_id, tokens, batch_size in zip(ids, sequences, (1, 2, 2), strict=True):
        result = results[request_id]
        assert result["status"] == "succeeded" and result["batch_size"] == batch_size, result
        [alone] = session.run(["logits"], {"input_ids": tokens, "attention_mask": np.ones_like(tokens)})
        np.testing.assert_allclose(np.array(result["outputs"]["logits"], dtype=np.float32), alone,
                                   rtol=1e-5, atol=1e-6)


def test_an_int_input_that_holds_no_token_ids_takes_negative_values_in_requests_and_jobs(stack):
    client = stack.client()
    series = np.array([[3, -1, 4], [-5, 9, 2]], dtype=np.int64)
    result = client.post("/v1/requests", {"model": "series", "inputs": {"x": series.tolist()}, "wait": True})
    assert result["status"] == "succeeded", result
    assert result["outputs"]["total"] == [6, 6]

    rows = np.random.default_rng(6).integers(-100, 100, (40, 7)).astype(np.int64)
    np.save(stack.home / "series.npy", rows)
    job = client.post("/v1/jobs", {"model": "series", "input_batch": str(stack.home / "series.npy"),
                                   "output_dir": str(stack.home / "series-out"), "chunk_size": 20, "batch_size": 8})
    done = wait_job(client, job["id"], timeout=60)
    assert done["status"] == "succeeded", done
    np.testing.assert_array_equal(np.load(Path(stack.home) / "series-out" / "total.npy"), rows.sum(axis=1))


def test_a_model_listing_its_mask_first_checks_its_token_ids_against_the_vocabulary(stack):
    """An id past the vocabulary in row 30 of a job (past the first row the API checks) fails the job on
    the worker with the rows named, not a run that reads past the embedding table."""
    client = stack.client()
    ids = np.random.default_rng(7).integers(1, 50, (40, 6)).astype(np.int64)
    ids[30, 2] = 50
    np.save(stack.home / "past_vocabulary.npy", ids)
    job = client.post("/v1/jobs", {"model": "mask_first", "input_batch": str(stack.home / "past_vocabulary.npy"),
                                   "output_dir": str(stack.home / "past-out"), "chunk_size": 20, "batch_size": 10})
    done = wait_job(client, job["id"], timeout=60)
    assert done["status"] == "failed", done
    assert "rows 30-39" in done["error"] and "vocabulary has 50 ids" in done["error"], done["error"]
