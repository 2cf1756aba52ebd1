"""Device pinning: the same code runs on the CPU provider when there is no GPU or no CUDA provider."""

from __future__ import annotations

import pytest

from sits_worker.device.pinning import Device, cuda_provider_available, device_memory


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


def test_a_cpu_worker_reserves_in_cpu_units_within_the_configured_limit():
    from broker.config.settings import Settings
    from sits_worker.serving.context import memory_ledger

    settings = Settings().with_overrides(resources={"device_memory": "8GiB", "device_memory_limit": "1GiB",
                                                    "cpu_memory_granularity": "4MiB"})
    ledger = memory_ledger(settings, Device("cpu"))
    uncapped = memory_ledger(Settings().with_overrides(resources={"device_memory": "8GiB"}), Device("cpu"))

    assert (ledger.capacity_bytes, ledger.granularity) == (2**30, 4 * 2**20)
    assert (uncapped.capacity_bytes, uncapped.granularity) == (8 * 2**30, 2 * 2**20)


def test_a_gpu_worker_reserves_in_gpu_units_and_the_limit_caps_what_nvml_reports():
    from broker.config.settings import Settings
    from sits_worker.serving.context import memory_ledger

    settings = Settings().with_overrides(resources={"device_memory_limit": "256MiB"})
    ledger = memory_ledger(settings, Device("gpu", 0))  # NVML's capacity, or the configured 16 GiB without it

    assert (ledger.capacity_bytes, ledger.granularity) == (256 * 2**20, 128 * 2**20)
