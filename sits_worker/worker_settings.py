"""What one worker process runs with: the shared settings, its device and its stream count.

The one place a worker reads its environment: the `SITS_*` settings (through `load_settings`), and
the two variables `sitsctl worker` sets for the Celery process it starts, `SITS_WORKER_DEVICE`
(`cpu`, `gpu:N` or `auto`) and `SITS_WORKER_STREAMS`. Everything below takes the object this
returns, never the environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from broker.config import Settings
from broker.config_loading import load_settings
from broker.errors import ConfigError
from sits_worker.devices import Device

DEVICE_VARIABLE = "SITS_WORKER_DEVICE"
STREAMS_VARIABLE = "SITS_WORKER_STREAMS"


@dataclass(frozen=True)
class WorkerSettings:
    """A worker process's settings: the deployment's, plus what pins this process."""

    settings: Settings
    device: Device
    streams: int
    """Batches this process runs at once (its stream slots): `SITS_WORKER_STREAMS`, else
    `resources.max_concurrent_streams`."""


def device_text(environ: Mapping[str, str] | None = None) -> str:
    """The device this process is pinned to, as the environment spells it (`auto` when unset)."""
    return (os.environ if environ is None else environ).get(DEVICE_VARIABLE, "auto")


def worker_device(environ: Mapping[str, str] | None = None) -> Device:
    """The device this process is pinned to; `ConfigError` for one that does not parse."""
    try:
        return Device.parse(device_text(environ))
    except ValueError as err:
        raise ConfigError(f"{DEVICE_VARIABLE}: {err}") from err


def worker_settings(environ: Mapping[str, str] | None = None) -> WorkerSettings:
    """Read this process's settings once; raise `ConfigError` for a device or stream count that does
    not parse."""
    env = os.environ if environ is None else environ
    settings = load_settings(environ=env)
    device = worker_device(env)
    streams_text = env.get(STREAMS_VARIABLE) or ""
    try:
        streams = int(streams_text) if streams_text else settings.resources.max_concurrent_streams
    except ValueError as err:
        raise ConfigError(f"{STREAMS_VARIABLE} must be a whole number of stream slots, got '{streams_text}'") from err
    return WorkerSettings(settings=settings, device=device, streams=streams)
