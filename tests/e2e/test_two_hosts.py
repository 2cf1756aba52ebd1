"""Two worker hosts, made of network namespaces, on one stack whose embedded Redis listens on the
bridge between them (`redis.bind`): both run a job's chunks, and a host whose link is cut mid-job loses
nothing (its leases expire, the other host runs its chunks, every row equals a direct ONNX Runtime run).

No speed is asserted here: on two cores shared with other work, a timed bound would fail for reasons of
its own. That the work spreads over both hosts is what is checked; how fast two hosts are is
`benchmarks/two_hosts.py`'s to measure (docs/benchmarks.md).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from sits_api.cli.stack import Stack
from sits_worker.model.zoo import build_zoo
from tests.e2e.netns_hosts import Hosts, fake_hosts, leftovers, why_no_namespaces
from tests.e2e.stack_helpers import direct_run, register, stack_settings, wait_job

ROWS = 3_072
CHUNK = 256
BATCH = 64


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[Stack, Hosts]]:
    """A stack with no worker of its own and one single-stream CPU worker in each of two hosts; its
    Redis on the bridge's address. The workers are stopped by PID, then the hosts deleted."""
    if reason := why_no_namespaces():
        pytest.skip(reason)
    with fake_hosts(2) as hosts:
        settings = stack_settings(tmp_path / "home", streams=1).with_overrides(
            redis={"bind": hosts.redis_address})
        stack = Stack(settings, worker_count=0, api_port=0).start()
        try:
            for host in range(2):
                stack.start_worker(host, launcher=hosts.launcher(host))
            stack.wait_for_workers(2, timeout=60)
            yield stack, hosts
        finally:
            for child in list(stack.children):  # a cut-off worker would only time out its warm shutdown
                if child.name.startswith("worker"):
                    stack.stop_child(child.name, kill=True)
            stack.stop()
    assert not leftovers(hosts)


def assert_redis_listens_only_on(stack: Stack, address: str) -> None:
    """The stack's Redis listens on `address` alone, and the URL it records (password included) names it."""
    assert stack.redis is not None
    recorded = (stack.home / "redis-url").read_text().strip()
    assert recorded == stack.settings.redis.url == stack.redis.url and f"@{address}:{stack.redis.port}/" in recorded
    listening = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True).stdout
    assert f"{address}:{stack.redis.port} " in listening and f"127.0.0.1:{stack.redis.port} " not in listening


def test_a_host_cut_off_mid_job_loses_nothing_and_the_other_host_finishes_it(fleet: tuple[Stack, Hosts]) -> None:
    stack, hosts = fleet
    assert_redis_listens_only_on(stack, hosts.redis_address)
    client = stack.client()
    register(client, "convnet", build_zoo(stack.home / "models")["convnet"])
    images = np.random.default_rng(7).standard_normal((ROWS, 3, 32, 32), dtype=np.float32)
    np.save(stack.home / "images.npy", images)
    job = client.post("/v1/jobs", {"model": "convnet", "input_batch": str(stack.home / "images.npy"),
                                   "output_dir": str(stack.home / "out"), "chunk_size": CHUNK, "batch_size": BATCH})

    both = wait_job(client, job["id"], timeout=60,
                    until=lambda j: j["status"] not in ("queued", "running")
                    or (len(j["workers"]) == 2 and j["chunks_done"] >= 3))
    assert both["status"] == "running" and len(both["workers"]) == 2, both  # each host ran chunks
    hosts.cut(0)  # mid-batch: its worker holds a leased chunk it can neither ack nor extend
    cut_off = next(name for name in both["workers"] if name.startswith("sits0-"))
    done = wait_job(client, job["id"], timeout=90)

    assert done["status"] == "succeeded", done
    assert done["rows_done"] == ROWS and done["chunks_done"] == done["chunks_total"] == ROWS // CHUNK
    survivor = next(name for name in done["workers"] if name.startswith("sits1-"))
    assert done["workers"][survivor] + done["workers"][cut_off] == ROWS // CHUNK
    assert done["workers"][survivor] > both["workers"][survivor]  # it ran the rest
    model_ref = f"convnet@{done['model_version']}"
    assert stack.store.client.zcard(stack.store.keys.inflight(model_ref)) == 0  # no lease left behind
    outputs = np.load(stack.home / "out" / "logits.npy")
    np.testing.assert_allclose(outputs, direct_run(stack.home / "models" / "convnet.onnx", images, BATCH),
                               rtol=1e-5, atol=1e-5)
