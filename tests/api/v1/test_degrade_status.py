"""A degraded worker as the edge shows it: `/v1/status`, `sitsctl status` and `/metrics` carry the step
its memory watch took (real Redis; the heartbeat holds what a worker's `MemoryWatch` reports after
reading memory that swings by a quarter of its capacity)."""

from __future__ import annotations

import itertools
import time
from typing import Any

from click.testing import CliRunner

from broker.config.settings import Settings
from broker.queueing import workers
from broker.state.store import Store
from sits_worker.device.memory_watch import MemoryWatch
from tests.api.api_helpers import Api

GIB = 2**30


def _degraded_watch(store: Store) -> MemoryWatch:
    readings = itertools.cycle([4 * GIB, 8 * GIB])  # a 4 GiB swing on a 16 GiB device: 25 %
    watch = MemoryWatch(Settings().with_overrides(degrade={"step_interval": "1s"}), store, readings.__next__,
                        16 * GIB)
    for tick in range(12):
        watch.sample(1000.0 + tick * 0.5)
    assert watch.step == 2
    return watch


def test_status_sitsctl_status_and_metrics_show_a_worker_s_degrade_step(
        api: Api, store: Store, served_api: str, admin_key: str, monkeypatch: Any) -> None:
    watch = _degraded_watch(store)
    workers.record_heartbeat(store, "jittery@host", {"device": "cpu", "streams": 1, "pid": 1,
                                                     "degrade": watch.info()}, now=time.time())
    calm = MemoryWatch(Settings(), store, lambda: GIB, 16 * GIB)
    calm.sample(1000.0)
    workers.record_heartbeat(store, "calm@host", {"device": "cpu", "streams": 1, "pid": 2, "degrade": calm.info()},
                             now=time.time())

    by_name = {worker["name"]: worker for worker in api.get("/v1/status").get_json()["workers"]}
    metrics = api.get("/metrics").get_data(as_text=True)
    from sits_api.cli.main import cli

    monkeypatch.setenv("SITS_API_URL", served_api)
    monkeypatch.setenv("SITS_API_KEY", admin_key)
    shown = CliRunner().invoke(cli, ["status"])

    jittery = by_name["jittery@host"]["degrade"]
    assert (jittery["step"], jittery["name"], jittery["jitter"], jittery["lowest_level"]) == (2, "p2-paused", 0.25, 8)
    assert [change["name"] for change in jittery["changes"]] == ["p1-as-p2", "p2-paused"]
    assert by_name["calm@host"]["degrade"]["step"] == 0
    assert 'sits_degrade_step{device="cpu",worker="jittery@host"} 2.0' in metrics
    assert 'sits_memory_jitter_ratio{device="cpu",worker="jittery@host"} 0.25' in metrics
    assert 'sits_degrade_changes_total{device="cpu",worker="jittery@host"} 2.0' in metrics
    assert shown.exit_code == 0, shown.output
    assert "p2-paused (jitter 25%)" in shown.output and "normal" in shown.output
