"""What one worker process runs with: the shared settings, its device, its streams and threads.

The one place a worker reads its environment: the `SITS_*` settings (through `load_settings`), the
two variables `sitsctl worker` sets for the Celery process it starts, `SITS_WORKER_DEVICE`
(`cpu`, `gpu:N` or `auto`) and `SITS_WORKER_STREAMS`, and the cores this process may run on.
Everything below takes the object this returns, never the environment.

A CPU worker fits its streams and ONNX Runtime threads to its cores (`fit_to_cores`): streams x
intra-op threads never exceed them. Each stream's run has a core of its own then, instead of
threads of several runs taking turns on one (4 streams x 2 threads on 2 cores cost an offline job
about 15 % of the bare loop's throughput).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from broker.config.loading import load_settings
from broker.config.settings import Settings
from broker.errors import ConfigError
from sits_worker.device.pinning import Device

DEVICE_VARIABLE = "SITS_WORKER_DEVICE"
STREAMS_VARIABLE = "SITS_WORKER_STREAMS"


@dataclass(frozen=True)
class WorkerSettings:
    """A worker process's settings: the deployment's, plus what pins this process."""

    settings: Settings
    device: Device
    streams: int
    """Batches this process runs at once (its stream slots): `SITS_WORKER_STREAMS`, else
    `resources.max_concurrent_streams`; on a CPU at most one per core."""
    intra_op_threads: int
    """ONNX Runtime threads of each session: `resources.intra_op_threads`; where that is 0 (auto), on
    a CPU the cores each stream has, on a GPU ONNX Runtime's own choice (0)."""


def fit_to_cores(streams: int, intra_op_threads: int, cores: int) -> tuple[int, int]:
    """(streams, intra-op threads) of a CPU worker with `cores` cores, so that their product stays
    within the cores: with threads 0 (auto) the streams are capped at the cores and share them out;
    with threads set, the streams are capped at the cores divided by them (at least one)."""
    cores = max(1, cores)
    if intra_op_threads == 0:
        streams = min(streams, cores)
        return streams, max(1, cores // streams)
    return max(1, min(streams, cores // intra_op_threads)), intra_op_threads


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, as a container's cpuset sets it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def device_text(environ: Mapping[str, str] | None = None) -> str:
    """The device this process is pinned to, as the environment spells it (`auto` when unset)."""
    return (os.environ if environ is None else environ).get(DEVICE_VARIABLE, "auto")


def worker_device(environ: Mapping[str, str] | None = None) -> Device:
    """The device this process is pinned to; `ConfigError` for one that does not parse."""
    try:
        return Device.parse(device_text(environ))
    except ValueError as err:
        raise ConfigError(f"{DEVICE_VARIABLE}: {err}") from err


def worker_settings(environ: Mapping[str, str] | None = None, cores: int | None = None) -> WorkerSettings:
    """Read this process's settings once (`cores`: its usable cores unless given); raise `ConfigError`
    for a device or stream count that does not parse."""
    env = os.environ if environ is None else environ
    settings = load_settings(environ=env)
    device = worker_device(env)
    streams_text = env.get(STREAMS_VARIABLE) or ""
    try:
        streams = int(streams_text) if streams_text else settings.resources.max_concurrent_streams
    except ValueError as err:
        raise ConfigError(f"{STREAMS_VARIABLE} must be a whole number of stream slots, got '{streams_text}'") from err
    threads = settings.resources.intra_op_threads
    if device.kind == "cpu":
        streams, threads = fit_to_cores(streams, threads, usable_cores() if cores is None else cores)
    return WorkerSettings(settings=settings, device=device, streams=streams, intra_op_threads=threads)
