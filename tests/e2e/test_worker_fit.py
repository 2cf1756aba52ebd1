"""A real CPU worker at the default resources fits its streams and threads to its cores, and keeps what it
made at start-up out of full garbage collections."""

from __future__ import annotations

import re
import time
from pathlib import Path

from broker.config.settings import Settings
from sits_api.cli.stack import Stack
from sits_worker.device.worker_settings import fit_to_cores, usable_cores


def test_a_default_cpu_worker_runs_no_more_streams_than_its_cores(tmp_path: Path) -> None:
    settings = Settings().with_overrides(paths={"home": tmp_path}, api={"port": 0})  # resources: the defaults
    with Stack(settings, worker_count=1, api_port=0) as stack:  # (started: its worker sends heartbeats)
        (worker,) = stack.client().get("/v1/status")["workers"]
        frozen = _frozen_at_start(stack.home / "logs" / "worker0.log")

    streams, threads = fit_to_cores(settings.resources.max_concurrent_streams, 0, usable_cores())
    assert worker["streams"] == streams and streams * threads <= usable_cores()
    assert frozen > 10_000  # (the worker's imports: Celery, ONNX Runtime, numpy, SITS)


def _frozen_at_start(log: Path, timeout: float = 15.0) -> int:
    """How many objects the worker's `worker_ready` hook froze, as its log says (0 if it never did)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(r"froze (\d+) objects made at start-up", log.read_text(errors="replace"))
        if found:
            return int(found.group(1))
        time.sleep(0.1)
    return 0
