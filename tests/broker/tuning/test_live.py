"""Live batching overrides: what a worker of each kind applies, when they run out, who may clear them."""

from __future__ import annotations

import time

from broker.online.batching import Batching
from broker.state.store import Store
from broker.tuning import live

BASE = Batching(max_batch_size=64, max_queue_delay=0.001, preferred_batch_sizes=(8, 32), max_batch_tokens=0,
                queue_capacity=1024, source="config")


def test_a_kind_gets_its_knobs_the_others_theirs_and_none_after_until() -> None:
    override = live.LiveBatching("trial", until=100.0, by_kind={"cpu": live.Knobs(16, 0.0, 1)}, others=live.BARRED)
    cpu = live.apply(BASE, override, "cpu", now=50.0)
    assert (cpu.max_batch_size, cpu.max_queue_delay, cpu.streams, cpu.source) == (16, 0.0, 1, "trial")
    assert cpu.preferred_batch_sizes == (8,)  # (32 is past the new ceiling)
    gpu = live.apply(BASE, override, "gpu", now=50.0)
    assert (gpu.max_batch_size, gpu.streams) == (64, 0)
    assert live.apply(BASE, override, "cpu", now=100.0) is BASE


def test_overrides_round_trip_and_a_sweep_clears_only_its_own(store: Store) -> None:
    ref = "mlp@abc"
    trial = live.LiveBatching("trial", until=time.time() + 60, by_kind={"cpu": live.Knobs(8)}, note="cell 1")
    live.write(store, ref, trial)
    assert live.read(store, ref) == trial and live.read_all(store) == {ref: trial}
    assert not live.clear(store, ref, source="controller")
    assert live.read(store, ref) == trial
    assert live.clear(store, ref, source="trial") and live.read(store, ref) is None
    store.client.hset(store.keys.live_batching, ref, "{not json")
    assert live.read(store, ref) is None  # a damaged override is no override
