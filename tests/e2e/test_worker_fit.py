"""A real CPU worker at the default resources fits its streams and threads to its cores."""

from __future__ import annotations

from pathlib import Path

from broker.config import Settings
from sits_api.cli.stack import Stack
from sits_worker.worker_settings import fit_to_cores, usable_cores


def test_a_default_cpu_worker_runs_no_more_streams_than_its_cores(tmp_path: Path) -> None:
    settings = Settings().with_overrides(paths={"home": tmp_path}, api={"port": 0})  # resources: the defaults
    with Stack(settings, worker_count=1, api_port=0) as stack:  # (started: its worker sends heartbeats)
        (worker,) = stack.client().get("/v1/status")["workers"]

    streams, threads = fit_to_cores(settings.resources.max_concurrent_streams, 0, usable_cores())
    assert worker["streams"] == streams and streams * threads <= usable_cores()
