"""Histograms counted in processes and summed in Redis (`broker.monitoring.histograms`): the buckets Python
counts match the scripts', tallies of several processes add up in one HASH, a flush Redis cannot take
keeps its counts, and the batch size and HTTP layouts decode as they were counted. Real Redis."""

from __future__ import annotations

import json
import socket

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from broker.errors import SitsError
from broker.monitoring import batch_sizes, http_stats
from broker.monitoring.histograms import Histogram, Tally, bucket_of, decode, summed
from broker.monitoring.sla_metrics import LATENCY_BUCKETS
from broker.state.keys import Keys
from broker.state.scripts import script_text
from broker.state.store import Store


def test_python_counts_a_value_into_the_bucket_the_scripts_count_it_in(store: Store) -> None:
    edges = [value for bound in LATENCY_BUCKETS for value in (bound, bound * 1.001, bound * 0.999)]
    edges += [0.0, -1.0, 1e6]
    lua = script_text("lib") + """
local edges, buckets = cjson.decode(ARGV[1]), {}
for i = 1, #edges do
  local tally = {}
  observe_latency(tally, 's', edges[i])
  for field, _ in pairs(tally) do
    if field ~= 's|ns' then buckets[i] = tonumber(string.sub(field, 3)) end
  end
end
return buckets
"""

    in_lua = store.client.eval(lua, 0, json.dumps(edges))

    assert in_lua == [bucket_of(value, LATENCY_BUCKETS) for value in edges]
    assert bucket_of(0.001, LATENCY_BUCKETS) == 1 and bucket_of(0.0011, LATENCY_BUCKETS) == 2
    assert bucket_of(601, LATENCY_BUCKETS) == len(LATENCY_BUCKETS) + 1  # +Inf


def test_the_tallies_of_several_processes_add_up_in_one_hash_read_as_cumulative_buckets(store: Store) -> None:
    bounds = (1.0, 2.0, 4.0)
    first, second = Tally(sum_field="sum"), Tally(sum_field="sum")
    for value in (1, 1, 3):
        first.observe("mlp@v1|rows", value, bounds)
    for value in (2, 9):
        second.observe("mlp@v1|rows", value, bounds)
    second.observe("cnn@v7|rows", 4, bounds)
    key = store.keys.batch_sizes

    assert first.flush(store, key) == 3  # fields: buckets 1 and 3, and the sum
    assert second.flush(store, key) == 5
    first.observe("mlp@v1|rows", 4, bounds)  # after a flush: counted again from nothing
    first.flush(store, key)

    histograms = decode(store.client.hgetall(key), len(bounds) + 1, sum_field="sum")
    assert histograms == {"mlp@v1|rows": Histogram([2, 3, 5, 6], 20), "cnn@v7|rows": Histogram([0, 0, 1, 1], 4)}
    assert first.pending() == {} and first.flush(store, key) == 0  # nothing to add: no round trip


def test_summed_histograms_add_their_cumulative_counts_and_sums() -> None:
    assert summed([Histogram([1, 2, 2], 0.5), Histogram([0, 3, 4], 7.0)]) == Histogram([1, 5, 6], 7.5)
    assert summed([]) == Histogram([], 0.0)


def test_a_flush_redis_cannot_take_keeps_its_counts_for_the_next(store: Store) -> None:
    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    away = Store(client=redis.Redis(port=port, decode_responses=True, socket_connect_timeout=1,
                                    retry=Retry(NoBackoff(), 0)), keys=Keys(prefix=store.keys.prefix))
    tally = Tally()
    tally.observe("s", 0.02, LATENCY_BUCKETS, scale=1e9)

    with pytest.raises(SitsError):
        tally.flush(away, away.keys.latency_buckets)
    tally.observe("s", 0.02, LATENCY_BUCKETS, scale=1e9)  # (counted meanwhile, on top)
    tally.flush(store, store.keys.latency_buckets)

    [histogram] = decode(store.client.hgetall(store.keys.latency_buckets), len(LATENCY_BUCKETS) + 1,
                         sum_scale=1e9).values()
    assert histogram.count == 2 and histogram.total == pytest.approx(0.04)
    assert histogram.cumulative[LATENCY_BUCKETS.index(0.01)] == 0
    assert histogram.cumulative[LATENCY_BUCKETS.index(0.025)] == 2


def test_a_run_s_size_is_its_rows_and_a_token_model_s_rows_times_its_padded_length(store: Store) -> None:
    axis = {"input": "input_ids", "axis": 1}

    assert batch_sizes.run_size({"features": (8, 64)}, None) == (8, None)
    assert batch_sizes.run_size({"input_ids": (3, 40), "attention_mask": (3, 40)}, axis) == (3, 120)
    assert batch_sizes.run_size({"input_ids": (3,)}, axis) == (3, None)  # (no such axis: rows alone)

    tally = batch_sizes.new_tally()
    batch_sizes.observe_run(tally, "bert@v2", 3, 120)
    batch_sizes.observe_run(tally, "bert@v2", 64, 8192)
    batch_sizes.observe_run(tally, "mlp@v1", 1000, None)
    tally.flush(store, store.keys.batch_sizes)
    found = batch_sizes.decode_batch_sizes(store.client.hgetall(store.keys.batch_sizes))

    assert set(found) == {("bert@v2", "rows"), ("bert@v2", "tokens"), ("mlp@v1", "rows")}
    rows = found[("bert@v2", "rows")]
    assert rows.count == 2 and rows.total == 67
    assert rows.cumulative[batch_sizes.ROW_BUCKETS.index(2)] == 0 and rows.cumulative[
        batch_sizes.ROW_BUCKETS.index(4)] == 1
    tokens = found[("bert@v2", "tokens")]
    assert tokens.cumulative[batch_sizes.TOKEN_BUCKETS.index(128)] == 1
    assert tokens.cumulative[batch_sizes.TOKEN_BUCKETS.index(8192)] == 2 and tokens.total == 8312
    assert found[("mlp@v1", "rows")].cumulative[batch_sizes.ROW_BUCKETS.index(1024)] == 1


def test_http_answers_decode_by_route_method_and_status_with_their_times(store: Store) -> None:
    tally = Tally()
    http_stats.observe_answer(tally, "/v1/jobs/<job_id>", "GET", 404, 0.003)
    http_stats.observe_answer(tally, "/v1/jobs/<job_id>", "GET", 200, 0.2)
    http_stats.observe_answer(tally, http_stats.UNMATCHED_ROUTE, http_stats.method_label("BREW"), 405, 0.001)
    tally.flush(store, store.keys.http_requests)

    found = http_stats.decode_http(store.client.hgetall(store.keys.http_requests))

    assert found.answers == {("/v1/jobs/<job_id>", "GET", "404"): 1, ("/v1/jobs/<job_id>", "GET", "200"): 1,
                             ("unmatched", "other", "405"): 1}
    job = found.seconds[("/v1/jobs/<job_id>", "GET")]
    assert job.count == 2 and job.total == pytest.approx(0.203)
    assert job.cumulative[LATENCY_BUCKETS.index(0.0025)] == 0 and job.cumulative[LATENCY_BUCKETS.index(0.005)] == 1
    assert http_stats.method_label("GET") == "GET" and http_stats.method_label("get") == "other"
