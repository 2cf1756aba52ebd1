"""On a GPU: sessions use the CUDA provider, the ledger takes NVML's capacity, and a worker pinned to
the GPU serves jobs and online requests with the CPU's results (within float tolerance).

Skipped where there is no GPU or ONNX Runtime has no CUDA provider (CI never has one): these run on
the `device` machine through `benchmarks/gpu/on_device.sh` (docs/benchmarks.md, "On a GPU").
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from broker.config.settings import Settings
from sits_api.cli.stack import Stack
from sits_worker.device.cuda_visible import visible_gpus
from sits_worker.device.pinning import Device, cuda_provider_available, gpu_count, nvml_gpus
from sits_worker.device.runtime import build_session
from sits_worker.serving.context import memory_ledger
from tests.e2e.stack_helpers import direct_run, register, stack_settings, wait_job

pytestmark = pytest.mark.skipif(not (cuda_provider_available() and gpu_count() > 0),
                                reason="needs a GPU that NVML sees and onnxruntime-gpu")


def test_a_gpu_session_runs_on_the_cuda_provider_and_matches_the_cpu(zoo_dir: Path) -> None:
    rows = np.random.default_rng(0).standard_normal((64, 3, 32, 32), dtype=np.float32)
    outputs = {}
    for device in (Device("gpu", 0), Device("cpu", 0)):
        session = build_session(zoo_dir / "convnet.onnx", device, 1)
        assert session.get_providers()[0] == ("CUDAExecutionProvider" if device.kind == "gpu"
                                              else "CPUExecutionProvider")
        outputs[device.kind] = session.run(None, {"pixels": rows})[0]
    np.testing.assert_allclose(outputs["gpu"], outputs["cpu"], rtol=1e-3, atol=1e-4)


def test_a_gpu_worker_s_ledger_takes_nvml_s_capacity_in_gpu_units() -> None:
    import pynvml

    pynvml.nvmlInit()
    first = visible_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"), nvml_gpus(), os.environ.get("CUDA_DEVICE_ORDER"))
    nvml_index = first.gpus[0].index if first.gpus and first.gpus[0] else 0  # gpu:0 is CUDA's first visible GPU
    total = int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(nvml_index)).total)
    settings = Settings()
    ledger = memory_ledger(settings, Device("gpu", 0))
    assert ledger.capacity_bytes == total
    assert ledger.granularity == settings.resources.gpu_memory_granularity


def test_a_worker_on_the_gpu_serves_a_job_and_requests_with_the_cpu_s_results(tmp_path: Path, zoo_dir: Path) -> None:
    home = tmp_path / "home"
    settings = stack_settings(home, model_roots=(zoo_dir,))
    inputs = np.random.default_rng(1).standard_normal((5_000, 3, 32, 32), dtype=np.float32)
    data = home / "pixels.npy"
    with Stack(settings, worker_count=1, api_port=0) as stack:
        client = stack.client()
        register(client, "convnet", zoo_dir / "convnet.onnx")
        np.save(data, inputs)
        job = client.post("/v1/jobs", {"model": "convnet", "input_batch": str(data),
                                       "output_dir": str(home / "out"), "chunk_size": 1_000})
        answers = [client.post("/v1/requests", {"model": "convnet", "inputs": {"pixels": inputs[i : i + 1].tolist()},
                                                "wait": True}) for i in range(8)]
        job = wait_job(client, job["id"])
        worker = client.get("/v1/status")["workers"][0]

    assert worker["device"] == "gpu:0", worker
    expected = direct_run(zoo_dir / "convnet.onnx", inputs, 256)  # the CPU provider
    assert job["status"] == "succeeded", job
    np.testing.assert_allclose(np.load(home / "out" / "logits.npy"), expected, rtol=1e-3, atol=1e-4)
    for row, answer in enumerate(answers):
        assert answer["status"] == "succeeded", answer
        np.testing.assert_allclose(np.array(answer["outputs"]["logits"])[0], expected[row], rtol=1e-3, atol=1e-4)
