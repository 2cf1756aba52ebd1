"""The points a `profile_mode: full` sweep measures: median latency, throughput and the P99 beside them."""

from __future__ import annotations

from pathlib import Path

import onnx

from sits_worker.device.pinning import Device
from sits_worker.device.runtime import build_session
from sits_worker.model.graph import static_profile
from sits_worker.serving.profiler import measure, pareto_points


def test_each_measured_point_keeps_its_keys_and_adds_a_p99_at_or_above_the_median(zoo_dir: Path) -> None:
    path = zoo_dir / "mlp.onnx"
    signature = static_profile(onnx.load(str(path)))["signature"]
    session = build_session(path, Device("cpu"), 1)

    points = measure(session, signature, budget_seconds=0.05, batch_sizes=(1, 8, 64))

    assert [point["batch_size"] for point in points] == [1, 8, 64]
    for point in points:
        assert set(point) == {"batch_size", "latency_ms", "rows_per_second", "p99_ms"}
        assert point["p99_ms"] >= point["latency_ms"] > 0
    assert all("p99_ms" in point for point in pareto_points(points))
