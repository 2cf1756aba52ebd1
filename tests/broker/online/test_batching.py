"""Batching settings: `auto` values from the measured profile, and Triton's preferred-size rules."""

from __future__ import annotations

import numpy as np
import pytest

from broker.config.loading import load_settings
from broker.errors import ConfigError
from broker.models.model_record import ModelRecord
from broker.online import requests
from broker.online.batching import FALLBACK_MAX_BATCH_SIZE, MAX_AUTO_DELAY, Batching, resolve
from broker.online.requests import RequestSpec
from broker.online.settings import ModelBatching
from broker.queueing import queues
from broker.state.store import Store
from tests.broker.broker_helpers import NOW
from tests.leasing import lease_items


def record(points: list[tuple[int, float]], source: str = "measured", device: str = "cpu") -> dict:
    """A registry record whose profile measured (batch size, latency ms) points."""
    return {"profile": {"source": source, "device": device, "points": [
        {"batch_size": size, "latency_ms": latency, "rows_per_second": size / latency * 1000}
        for size, latency in points]}}


CNN_LIKE = record([(1, 1.5), (2, 3.0), (4, 6.1), (8, 12.0), (16, 24.5), (32, 49.0), (64, 98.0)])
MLP_LIKE = record([(1, 0.02), (8, 0.03), (128, 0.15), (1024, 1.1)])


def test_auto_max_batch_size_is_the_largest_measured_batch_that_runs_within_the_latency_budget():
    assert resolve(ModelBatching(), ModelRecord.of(CNN_LIKE)).max_batch_size == 32  # 49 ms fits 50 ms, 98 ms does not
    assert resolve(ModelBatching(max_batch_latency="10ms"), ModelRecord.of(CNN_LIKE)).max_batch_size == 4
    assert resolve(ModelBatching(), ModelRecord.of(MLP_LIKE)).max_batch_size == 1024
    # even one row runs longer than the budget: batches of the smallest measured size
    assert resolve(ModelBatching(max_batch_latency="1ms"), ModelRecord.of(CNN_LIKE)).max_batch_size == 1


def test_auto_delay_is_one_row_s_run_time_when_that_is_worth_a_wait_and_capped():
    assert resolve(ModelBatching(), ModelRecord.of(CNN_LIKE)).max_queue_delay == pytest.approx(0.0015)
    assert resolve(ModelBatching(), ModelRecord.of(MLP_LIKE)).max_queue_delay == 0.0  # 20 µs: shorter than a round trip
    slow = record([(1, 80.0), (2, 150.0)])
    assert resolve(ModelBatching(), ModelRecord.of(slow)).max_queue_delay == MAX_AUTO_DELAY


def test_without_a_measured_profile_auto_means_the_static_defaults():
    for unmeasured in ({}, {"profile": {"source": "static"}}, record([(128, 1.0), (1024, 8.0)], source="observed")):
        batching = resolve(ModelBatching(), ModelRecord.of(unmeasured))
        assert (batching.max_batch_size, batching.max_queue_delay, batching.source) == (
            FALLBACK_MAX_BATCH_SIZE, 0.0, "config")


def test_auto_values_ignore_a_profile_of_another_kind_of_device_and_token_models_profiles():
    on_gpu = record([(1, 0.5), (64, 0.6), (1024, 4.0)], device="gpu:0")
    assert resolve(ModelBatching(), ModelRecord.of(on_gpu), "gpu").max_batch_size == 1024
    assert resolve(ModelBatching(), ModelRecord.of(on_gpu), "cpu").max_batch_size == FALLBACK_MAX_BATCH_SIZE
    assert resolve(ModelBatching(), ModelRecord.of(on_gpu)).to_dict()["profile_device"] == "gpu:0"  # the API's view
    token_model = CNN_LIKE | {"static_profile": {"sequence_axis": {"input": "input_ids", "axis": 1}}}
    assert resolve(ModelBatching(), ModelRecord.of(token_model)).source == "config"
    damaged = {"profile": {"source": "measured", "points": [{"batch_size": 1, "latency_ms": "inf"}, None]}}
    assert resolve(ModelBatching(), ModelRecord.of(damaged)).max_batch_size == FALLBACK_MAX_BATCH_SIZE
    assert resolve(ModelBatching(), ModelRecord.of({"profile": "junk"})).source == "config"


def test_configured_values_win_over_the_profile():
    configured = ModelBatching(max_batch_size=8, max_queue_delay="3ms", preferred_batch_sizes=[4, 2])
    batching = resolve(configured, ModelRecord.of(CNN_LIKE))
    assert (batching.max_batch_size, batching.max_queue_delay, batching.preferred_batch_sizes, batching.source) == (
        8, 0.003, (2, 4), "config")
    assert resolve(ModelBatching(max_batch_size=8), ModelRecord.of(CNN_LIKE)).source == "profile"  # the delay's


def test_preferred_sizes_above_an_auto_max_batch_size_are_dropped():
    batching = resolve(ModelBatching(preferred_batch_sizes=[4, 16, 64]), ModelRecord.of(CNN_LIKE))
    assert (batching.max_batch_size, batching.preferred_batch_sizes) == (32, (4, 16))


def batching(max_batch_size: int = 8, delay: float = 0.0, preferred: tuple[int, ...] = ()) -> Batching:
    return Batching(max_batch_size=max_batch_size, max_queue_delay=delay, preferred_batch_sizes=preferred,
                    max_batch_tokens=0, queue_capacity=1024, source="config")


def test_the_head_waits_for_company_until_a_full_or_preferred_batch_or_the_delay():
    preferring = batching(16, delay=0.01, preferred=(4, 8))
    assert not preferring.wait_over(3, 0.005)
    assert preferring.wait_over(4, 0.0)  # a preferred batch runs at once
    assert preferring.wait_over(3, 0.01)  # the delay is up: what is there runs
    assert batching(16, delay=0.01).wait_over(16, 0.0)
    assert not batching(16, delay=0.01).wait_over(15, 0.0)
    assert batching(16).wait_over(1, 0.0)  # no delay: never waits


@pytest.mark.parametrize("entry, message", [
    ("{max_batch_size: 0}", "neither a batch size"),
    ("{max_batch_size: 1000000}", "neither a batch size"),
    ("{max_queue_delay: 2s}", "longer than 1s"),
    ("{max_batch_size: big}", "neither a batch size"),
    ("{max_queue_delay: -5ms}", "not a duration"),
    ("{max_queue_delay: .nan}", "not a finite duration"),
    ("{preferred_batch_sizes: [0, 4]}", "not a list of batch sizes"),
    ("{preferred_batch_sizes: 4}", "not a list of batch sizes"),
    ("{max_batch_size: 8, preferred_batch_sizes: [4, 16]}", "go beyond max_batch_size 8"),
    ("{max_batch_latency: 0}", "greater than 0"),
])
def test_bad_batching_settings_are_refused_with_the_reason(tmp_path, entry, message):
    path = tmp_path / "sits.yaml"
    path.write_text(f"online:\n  models:\n    mlp: {entry}\n")
    with pytest.raises(ConfigError, match=message):
        load_settings(path)


# --- in Redis: the lease's preferred cut and the head's company -------------------------------


def _submit(store: Store, request_id: str, *, rows: int = 1, bucket: str = "features:64", score: float) -> None:
    spec = RequestSpec(request_id=request_id, model_name="mlp", model_version="v1",
                       inputs={"features": np.zeros((rows, 64), dtype=np.float32)}, rows=rows, tokens=0,
                       bucket=bucket, factors={"enqueued_at": NOW})
    requests.submit_request(store, spec, score=score, now=NOW, max_age_seconds=60)


def _lease(store: Store, preferred: tuple[int, ...], max_items: int = 16) -> list[str]:
    return [item.item_id for item in lease_items(store, "mlp@v1", now=NOW, lease_seconds=30,
                                                        max_items=max_items, preferred_sizes=preferred)]


def test_a_lease_takes_the_largest_preferred_batch_its_rows_reach_and_leaves_the_rest_waiting(store: Store):
    for index in range(13):
        _submit(store, f"r{index:02}", score=float(index))

    batches = [_lease(store, (4, 8)) for _ in range(4)]

    assert [len(batch) for batch in batches] == [8, 4, 1, 0]  # 13 -> 8, 5 -> 4, then the 1 left (none fills)
    assert sorted(sum(batches, [])) == [f"r{index:02}" for index in range(13)]  # none lost, none twice


def test_the_preferred_cut_counts_rows_and_never_drops_the_head(store: Store):
    _submit(store, "big", rows=3, score=0.0)
    for index in range(3):
        _submit(store, f"two{index}", rows=2, score=1.0 + index)

    assert _lease(store, (2, 4)) == ["big"]  # 3 + 2 + 2 + 2 rows reach 4: cut to 3 rows (4 would split a request)
    assert _lease(store, (2, 4)) == ["two0", "two1"]
    assert _lease(store, (2, 4)) == ["two2"]


def test_the_head_s_company_counts_the_rows_of_its_bucket_only(store: Store):
    _submit(store, "head", rows=2, score=0.0)
    _submit(store, "other", bucket="features:32", score=1.0)
    _submit(store, "same", rows=3, score=2.0)

    rows, waited = queues.head_company(store, "mlp@v1", now=NOW + 0.25, window=8, enough=64)

    assert rows == 5 and waited == pytest.approx(0.25)
    assert queues.head_company(store, "mlp@v1", now=NOW, window=2, enough=64) == (2, 0.0)  # "same": past the window
    assert queues.head_company(store, "mlp@v1", now=NOW, window=8, enough=2) == (2, 0.0)  # 2 rows are enough
    assert queues.head_company(store, "nothing@v1", now=NOW, window=8, enough=64) is None
