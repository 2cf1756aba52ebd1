"""A tenant at its limit is held back even with the device idle, through a real stack.

Tenant `capped` (made with `PUT /v1/tenants/capped`) is guaranteed 30 % of the fleet with a limit of
1.0: the most it may use, others idle or not, is its 30 %. Alone, flooding one model on one stream
slot, it is billed about 30 % of the wall time, and the slot stays idle the rest (its work waits in
the queue, nothing is failed). Raised to a limit of 3.0 at run time, it borrows the idle share. The
device is made slow and steady by fault injection, as in `test_fair_share.py`, and usage decays fast
(a 2 s half-life), so the held state settles within seconds.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from broker.tenants.apikeys import create_api_key
from sits_api.cli.client import ApiClient
from sits_api.cli.stack import Stack
from tests.e2e.stack_helpers import register, stack_settings, wait_job
from tests.e2e.test_fair_share import billed_over, in_tenant_folder

ROWS = 40_000
CHUNK = 16
"""Rows of a chunk: 2 mini-batches, about 20 ms of device time, so the held state is checked often."""
MINI_BATCH = 8
SHARE = 0.3


@pytest.fixture(scope="module")
def capped_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from sits_worker.model.zoo import build_zoo

    home = tmp_path_factory.mktemp("tenant-limit") / "home"
    settings = stack_settings(home, streams=1).with_overrides(
        fair_share={"usage_half_life": "2s"}, faults={"enabled": True, "run_latency": "10ms"})
    running = Stack(settings, worker_count=1, api_port=0).start()
    register(running.client(), "mlp", build_zoo(home / "models")["mlp"])
    np.save(home / "features.npy", np.random.default_rng(5).standard_normal((ROWS, 64), dtype=np.float32))
    yield running
    running.stop()


def test_a_tenant_at_its_limit_waits_with_the_device_idle_and_borrows_once_its_limit_is_raised(
        capped_stack: Stack) -> None:
    stack, store = capped_stack, capped_stack.store
    admin = stack.client()
    admin.request("PUT", "/v1/tenants/capped", {"guaranteed_share": SHARE, "limit": 1.0})  # (as an admin would)
    capped = ApiClient(stack.api_url, create_api_key(store, "capped-key", "user", tenant="capped"))
    job = capped.post("/v1/jobs", {"model": "mlp",
                                   "input_batch": str(in_tenant_folder(stack.home, "capped", "features.npy")),
                                   "output_dir": str(stack.home / "capped" / "out"), "chunk_size": CHUNK,
                                   "batch_size": MINI_BATCH})
    time.sleep(4.0)  # two half-lives: its usage reaches its limit, and it is held from then on

    held = billed_over(store, 6.0)["capped"] / 6.0
    assert 0.2 <= held <= 0.4, held  # its 30 %, the slot idle the rest
    assert capped.get(f"/v1/jobs/{job['id']}")["status"] == "running"  # waiting, not failed
    assert store.client.zcard(store.keys.ready("mlp@" + job["model_version"])) > 0

    admin.request("PUT", "/v1/tenants/capped", {"guaranteed_share": SHARE, "limit": 3.0})
    time.sleep(3.0)  # the workers read the tenants again (within a second) and the usage climbs
    borrowed = billed_over(store, 4.0)["capped"] / 4.0
    # up to 90 % now, all the idle slot it can use; on a loaded host each 20 ms chunk's overheads take
    # more of the slot (0.447 seen with other tests beside it), but never back down to its held 30 %
    assert borrowed >= max(0.40, held + 0.12), (held, borrowed)

    capped.delete(f"/v1/jobs/{job['id']}")
    assert wait_job(admin, job["id"])["status"] == "cancelled"
    assert store.client.zcard(store.keys.ready("mlp@" + job["model_version"])) == 0  # nothing left behind
