"""The fleet benchmark (`benchmarks/fleet.py`): its core against the session's real Redis, and its quick run.

The smoke test runs four simulated workers for a second, in this process, with both kinds of work (the
mixed mix), and checks that the table's figures are sane; the quick run, under `-m slow`, runs the script
itself as a user would.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.fleet import StepConfig, run_step, saturation, table_row
from broker.state.embedded import EmbeddedRedis
from broker.state.store import Store

ROOT = Path(__file__).resolve().parents[2]


def test_four_simulated_workers_for_a_second_lease_ack_and_measure_redis(redis_server: EmbeddedRedis,
                                                                         store: Store) -> None:
    slowlog_before = store.client.config_get("slowlog-log-slower-than")
    config = StepConfig(mix="mixed", workers=4, streams=2, seconds=1.0, warmup=0.3, probe=0.2, processes=0,
                        models=2, chunk_seconds=0.2, request_rate=40.0)
    step = run_step(config, redis_server.url, store.keys.prefix)

    assert not step.errors and step.threads_left == 0, (step.errors, step.threads_left)
    assert step.events["leases"] > 0 and step.events["chunks"] > 0, step.events
    assert step.events["requests"] > 0 and step.events["submitted"] > 0, step.events
    p50, p99 = step.lease_ms
    assert 0 < p50 <= p99 < 1000, step.lease_ms
    assert step.request_ms[0] <= step.request_ms[1]
    assert 0 < step.redis_cpu <= step.redis_cpu_all + 0.05 and step.client_cpu > 0
    assert step.commands > step.acks > 0 and step.rows > 0
    assert "lease_batch" in step.redis_us and step.redis_us["lease_batch"][0] > 0, step.redis_us
    # every loop ended with the window, and the probe gave Redis its own setting back
    assert store.client.config_get("slowlog-log-slower-than") == slowlog_before

    cells = [cell.strip() for cell in table_row(step).strip("|").split("|")]
    assert len(cells) == 15 and cells[:2] == ["4", "8"]
    assert float(cells[2].replace(",", "")) > 0  # leases/s
    point = saturation([step])
    assert point.us_per_row > 0 and point.cpu_per_worker > 0 and point.workers_at_core > 0


@pytest.mark.slow
def test_the_quick_run_prints_a_table_per_mix_within_a_minute() -> None:
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fleet.py"), "--quick"], cwd=ROOT,
                            capture_output=True, text=True, timeout=180)
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stdout + result.stderr
    for mix in ("offline", "online", "mixed"):
        assert f"### {mix}" in result.stdout
        assert f"{mix}: Redis's main thread reached" in result.stdout and "one core serves about" in result.stdout
    rows = [line for line in result.stdout.splitlines() if line.startswith(("| 8 |", "| 32 |"))]
    assert len(rows) >= 3, result.stdout  # (a mix's steps end at the first one the client cannot drive)
    assert elapsed < 75, f"the quick run took {elapsed:.0f} s"
