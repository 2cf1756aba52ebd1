"""Device pinning: the same code runs on the CPU provider when there is no GPU or no CUDA provider."""

from __future__ import annotations

import pytest

from sits_worker.devices import Device, cuda_provider_available, device_memory


def test_device_names_parse_to_kind_and_index():
    assert Device.parse("cpu") == Device("cpu", 0)
    assert Device.parse("gpu:3") == Device("gpu", 3)
    assert str(Device.parse("gpu")) == "gpu:0"
    with pytest.raises(ValueError, match="cpu"):
        Device.parse("tpu:1")


def test_gpu_device_uses_cuda_device_id_or_falls_back_to_cpu():
    providers = Device("gpu", 2).providers()
    if cuda_provider_available():
        assert providers[0] == ("CUDAExecutionProvider", {"device_id": 2})
    else:
        assert providers == ["CPUExecutionProvider"]
    assert Device("cpu").providers() == ["CPUExecutionProvider"]


def test_auto_picks_cpu_without_a_usable_gpu():
    if cuda_provider_available():
        pytest.skip("this ONNX Runtime has the CUDA provider; 'auto' may pick a GPU here")
    assert Device.parse("auto") == Device("cpu", 0)


def test_device_memory_uses_configured_capacity_without_nvml():
    memory = device_memory(Device("cpu"), 8 * 2**30)
    assert memory == {"total_bytes": 8 * 2**30, "free_bytes": 8 * 2**30, "source": "config"}
