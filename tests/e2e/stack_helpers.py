"""Helpers for end-to-end tests: a real stack (Redis, API, Celery workers) in tmp folders."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from broker.config.settings import Settings
from sits_api.cli.client import ApiClient
from sits_api.cli.stack import Stack

FAST_RECOVERY = {
    "lease_timeout": "3s",
    "reap_interval": "0.5s",
    "ticket_timeout": "6s",
    "ticket_time_slice": "1s",
    "worker_heartbeat_timeout": "5s",
}


def stack_settings(home: Path, *, streams: int = 2, model_roots: tuple[Path, ...] = (), api_processes: int = 1,
                   grpc: bool = False) -> Settings:
    """Settings for a test stack: everything under `home`, fast lease recovery, one ORT thread per stream.

    One API process and no gRPC server unless asked (`api_processes`, `grpc`): each is a Python process that
    imports the API (about 2 s of CPU), and the tests start about a hundred stacks on two cores. The
    modules that test what several API processes share, and the gRPC server, ask for them."""
    roots = (home,)
    return Settings().with_overrides(
        paths={"home": home, "model_roots": roots + model_roots, "input_roots": roots, "output_roots": roots},
        scheduler=FAST_RECOVERY,
        resources={"max_concurrent_streams": streams, "intra_op_threads": 1},
        api={"port": 0, "workers": api_processes, **({} if grpc else {"grpc_port": 0})},
    )


def start_stack(home: Path, *, workers: int = 2, streams: int = 2, model_roots: tuple[Path, ...] = (),
                api_processes: int = 1, grpc: bool = False) -> Stack:
    """A running stack with `workers` CPU workers (`stack_settings` for the rest)."""
    settings = stack_settings(home, streams=streams, model_roots=model_roots, api_processes=api_processes, grpc=grpc)
    return Stack(settings, worker_count=workers, api_port=0).start()


def start_zoo_stack(home: Path, *, streams: int = 1, **overrides: Any) -> Stack:
    """One CPU worker with `streams` stream slots, the settings sections in `overrides` on top of the
    test settings, and the zoo's mlp, transformer and convnet registered."""
    from sits_worker.model.zoo import build_zoo

    settings = stack_settings(home, streams=streams).with_overrides(**overrides)
    stack = Stack(settings, worker_count=1, api_port=0).start()
    models = build_zoo(home / "models")
    for name in ("mlp", "transformer", "convnet"):
        register(stack.client(), name, models[name])
    return stack


def register(client: ApiClient, name: str, path: Path) -> dict[str, Any]:
    """Register a model (static profile)."""
    return client.post("/v1/models", {"name": name, "path": str(path)})


def wait_job(client: ApiClient, job_id: str, *, until: Any = None, timeout: float = 120.0) -> dict[str, Any]:
    """Poll a job until `until(job)` (default: a final status) or time out."""
    until = until or (lambda job: job["status"] in ("succeeded", "failed", "cancelled"))
    deadline = time.monotonic() + timeout
    while True:
        job = client.get(f"/v1/jobs/{job_id}")
        if until(job):
            return job
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} did not get there in {timeout}s: {job}")
        time.sleep(0.1)


def direct_run(model_path: Path, inputs: np.ndarray, batch_size: int) -> np.ndarray:
    """The reference: a plain ONNX Runtime loop over the same model and batch size.

    `inputs` feeds the model's first input; a declared attention mask (`sits.attention_mask`) is all
    ones, every token real, as for a request sent without one.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    mask_name = session.get_modelmeta().custom_metadata_map.get("sits.attention_mask")
    parts = []
    for first in range(0, len(inputs), batch_size):
        feed = {name: inputs[first : first + batch_size]}
        if mask_name:
            feed[mask_name] = np.ones_like(feed[name])
        parts.append(session.run(None, feed)[0])
    return np.concatenate(parts)


@contextlib.contextmanager
def frozen(stack: Stack, child_name: str) -> Iterator[None]:
    """SIGSTOP a child of the stack for the block, SIGCONT after: what is queued meanwhile is all there
    when the worker's stream slots first look, however fast or slow the API queued it."""
    pid = next(child.process.pid for child in stack.children if child.name == child_name)
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def collect(client: ApiClient, ids: list[str], timeout: float = 60.0) -> dict[str, dict[str, Any]]:
    """Poll until every request is done; request id -> its result."""
    done: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(done) < len(ids):
        for request_id in ids:
            if request_id not in done and (result := client.get(f"/v1/requests/{request_id}"))["status"] != "queued":
                done[request_id] = result
        assert time.monotonic() < deadline, f"{len(ids) - len(done)} requests not done in {timeout}s"
        time.sleep(0.02)
    return done
