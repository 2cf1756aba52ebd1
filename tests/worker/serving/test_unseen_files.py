"""A job whose files one host cannot see: its workers there pass its items to the workers that see them,
and a file no worker sees fails the job after its transient attempts, naming the path and the workers
(real Redis, real `WorkerContext`s, a real ONNX model).

The hosts are two contexts in one process; a host "without the mount" is one whose `os.lstat` of the
file answers ENOENT while that context's item runs.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest

from broker.config.settings import Settings
from broker.jobs import output_layout
from broker.jobs import records as jobs
from broker.models import registry
from broker.queueing.reaping import reap_expired_leases
from broker.state.store import Store
from sits_worker.device.pinning import Device
from sits_worker.device.runtime import SessionCache
from sits_worker.model.graph import static_profile
from sits_worker.serving import execution
from sits_worker.serving.context import WorkerContext
from tests.leasing import lease_items
from tests.worker.serving.test_input_changes import ROWS, Hooks, submit

_host = threading.local()


def contexts(store: Store, zoo_dir: Path, settings: Settings) -> tuple[WorkerContext, WorkerContext]:
    """Worker contexts of 'host-a' and 'host-b' on one Redis, with the zoo MLP registered."""
    model = onnx.load(str(zoo_dir / "mlp.onnx"))
    profile = static_profile(model)
    registry.save_model_version(store, {"name": "mlp", "version": "v1", "ref": "mlp@v1",
                                        "path": str(zoo_dir / "mlp.onnx"), "signature": profile["signature"],
                                        "static_profile": profile})
    return tuple(WorkerContext(settings=settings, store=store, device=Device("cpu"), streams=1,  # type: ignore[return-value]
                               sessions=SessionCache(Device("cpu"), 1), name=name)
                 for name in ("host-a", "host-b"))


@pytest.fixture
def hidden(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, set[str]]]:
    """Host name -> the paths missing there; `os.lstat` answers ENOENT for them on that host."""
    missing: dict[str, set[str]] = {}
    real_lstat = os.lstat

    def lstat(path: os.PathLike[str] | str, *args: object, **kwargs: object) -> os.stat_result:
        if str(path) in missing.get(getattr(_host, "name", ""), set()):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_lstat(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "lstat", lstat)
    monkeypatch.setattr(execution, "UNSEEN_PAUSE_SECONDS", 0.0)
    yield missing


def run_on(ctx: WorkerContext, model_ref: str) -> str:
    """Lease the next item on `ctx`'s host and run it there; its commit is waited for."""
    [item] = lease_items(ctx.store, model_ref, now=time.time(), lease_seconds=60, max_items=1)
    _host.name = ctx.name
    try:
        outcome = execution.process_item(ctx, item, Hooks(lambda: None, at=0))
        assert ctx.commits.wait(timeout=10)
    finally:
        _host.name = ""
    return outcome


def reap(store: Store) -> None:
    """The reaper's pass once the retry backoffs (none here) have passed."""
    reap_expired_leases(store, now=time.time() + 1, max_attempts=5)


def test_a_chunk_whose_input_one_host_cannot_see_runs_on_the_host_that_sees_it(
        store: Store, zoo_dir: Path, tmp_path: Path, hidden: dict[str, set[str]]) -> None:
    settings = Settings().with_overrides(retry={"transient": {"backoff": "0s", "jitter": "0s"}})
    host_a, host_b = contexts(store, zoo_dir, settings)
    spec = submit(store, tmp_path, chunk_size=ROWS // 2)
    hidden["host-a"] = {spec.input_batch}

    assert run_on(host_a, spec.model_ref) == "retry"  # chunk 0: counted once, parked
    job = jobs.get_job(store, spec.job_id, now=time.time())
    error = job.retries["transient"]["last_error"]
    assert f"input '{spec.input_batch}' of job {spec.job_id} is missing on worker [host-a]" in error
    assert "same real path" in error

    assert run_on(host_a, spec.model_ref) == "passed"  # chunk 1: back in its queue, not counted
    assert jobs.get_job(store, spec.job_id, now=time.time()).retries["transient"]["attempts"] == 1
    assert store.client.zcard(store.keys.ready(spec.model_ref)) == 1

    assert run_on(host_b, spec.model_ref) in ("acked", "committing")  # chunk 1
    reap(store)
    assert run_on(host_b, spec.model_ref) in ("acked", "committing")  # chunk 0, back from its backoff
    assert run_on(host_b, spec.model_ref) == "finalized"

    job = jobs.get_job(store, spec.job_id, now=time.time())
    assert job.status == "succeeded" and job.workers == {"host-b": 2}, job
    assert output_layout.read_manifest(Path(spec.output_dir)) is not None


@pytest.mark.parametrize("what", ["input", "output folder"])
def test_a_file_no_host_sees_fails_its_job_naming_the_path_and_every_worker_that_missed_it(
        store: Store, zoo_dir: Path, tmp_path: Path, hidden: dict[str, set[str]], what: str) -> None:
    settings = Settings().with_overrides(retry={"transient": {"attempts": 3, "backoff": "0s", "jitter": "0s"}})
    host_a, host_b = contexts(store, zoo_dir, settings)
    spec = submit(store, tmp_path, chunk_size=ROWS)
    path = spec.input_batch if what == "input" else spec.output_dir
    hidden["host-a"] = hidden["host-b"] = {path, str(Path(path).parent)}  # (the mount is missing)

    assert run_on(host_a, spec.model_ref) == "retry"
    reap(store)
    assert run_on(host_b, spec.model_ref) == "retry"
    reap(store)
    host_a.unseen_jobs.clear()  # (its moment of passing the job on is over)
    assert run_on(host_a, spec.model_ref) == "failed"

    job = jobs.get_job(store, spec.job_id, now=time.time())
    assert job.status == "failed", job
    assert "failed 3 times (transient)" in job.error
    assert f"{what} '{path}' of job {spec.job_id} is missing on workers [host-a, host-b]" in job.error, job.error
    assert not (Path(spec.output_dir) / ".parts").exists()
    assert np.load(spec.input_batch).shape == (ROWS, 64)  # (the file was there all along: only hidden)
