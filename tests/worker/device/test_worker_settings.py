"""A worker process's settings, read once from its environment; its heartbeat (real Redis)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from broker.errors import ConfigError
from broker.monitoring.batch_sizes import decode_batch_sizes
from broker.queueing import workers
from broker.state.store import Store
from sits_worker.device.pinning import Device
from sits_worker.device.worker_settings import fit_to_cores, worker_settings
from sits_worker.upkeep.heartbeat import Heartbeat
from tests.worker.worker_helpers import mlp_worker_context


def test_the_device_and_streams_come_from_the_variables_sitsctl_sets() -> None:
    settings = worker_settings({"SITS_WORKER_DEVICE": "cpu", "SITS_WORKER_STREAMS": "3",
                                "SITS_RESOURCES__MAX_CONCURRENT_STREAMS": "2"}, cores=8)

    assert (settings.device, settings.streams, settings.intra_op_threads) == (Device("cpu"), 3, 2)
    assert settings.settings.resources.max_concurrent_streams == 2


def test_without_the_variables_a_worker_takes_the_configured_streams_and_any_device() -> None:
    settings = worker_settings({"SITS_RESOURCES__MAX_CONCURRENT_STREAMS": "2"}, cores=8)

    assert settings.streams == 2 and settings.device == Device.parse("auto")


@pytest.mark.parametrize(("streams", "threads", "cores", "fitted"), [
    (4, 0, 2, (2, 1)),   # the defaults on 2 cores: a stream per core, one thread each
    (4, 0, 16, (4, 4)),  # more cores than streams: each stream's runs get several
    (1, 0, 2, (1, 2)),
    (4, 2, 2, (1, 2)),   # threads set: as many streams as fit beside them
    (4, 4, 2, (1, 4)),   # threads set past the cores: one stream, the threads as asked
    (3, 0, 1, (1, 1)),
])
def test_a_cpu_worker_fits_its_streams_and_threads_to_its_cores(
        streams: int, threads: int, cores: int, fitted: tuple[int, int]) -> None:
    assert fit_to_cores(streams, threads, cores) == fitted
    variables = {"SITS_WORKER_DEVICE": "cpu", "SITS_WORKER_STREAMS": str(streams),
                 "SITS_RESOURCES__INTRA_OP_THREADS": str(threads)}
    settings = worker_settings(variables, cores=cores)
    assert (settings.streams, settings.intra_op_threads) == fitted


@pytest.mark.parametrize(("variables", "named"), [
    ({"SITS_WORKER_DEVICE": "tpu:1"}, "SITS_WORKER_DEVICE"),
    ({"SITS_WORKER_STREAMS": "four"}, "SITS_WORKER_STREAMS"),
])
def test_a_variable_that_does_not_parse_is_a_config_error_naming_it(variables: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        worker_settings(variables)


def test_a_heartbeat_records_what_the_worker_is_and_holds(store: Store, zoo_dir: Path) -> None:
    ctx = mlp_worker_context(store, zoo_dir)
    Heartbeat(ctx, "w1@host").beat_once(now=1000.0)

    (worker,) = workers.list_workers(store, now=1001.0, timeout=15.0)
    assert worker["name"] == "w1@host" and worker["alive"] and worker["device"] == "cpu"
    assert worker["streams"] == 1 and worker["commits_pending"] == 0 and "memory" in worker


def test_a_heartbeat_adds_the_sizes_of_the_runs_since_the_last_beat_to_redis_once(store: Store, zoo_dir: Path) -> None:
    ctx = mlp_worker_context(store, zoo_dir)
    heartbeat = Heartbeat(ctx, "w1@host")
    ctx.run("mlp@v1", {"features": np.zeros((3, 64), dtype=np.float32)}, ["logits"])

    heartbeat.beat_once(now=1000.0)
    heartbeat.beat_once(now=1002.0)  # (nothing ran since: nothing added again)

    [(series, rows)] = decode_batch_sizes(store.client.hgetall(store.keys.batch_sizes)).items()
    assert series == ("mlp@v1", "rows") and rows.count == 1 and rows.total == 3
