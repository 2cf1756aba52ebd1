"""`--gpu N` is CUDA's device N (ONNX Runtime's device_id): the N-th GPU CUDA_VISIBLE_DEVICES leaves
visible, mapped to its NVML GPU for capacity; NVML's own count and numbering ignore that variable.

The mapping is a pure function, tested here case by case; the NVML-calling part runs for real
where NVML is missing (as on CI), and against a small stand-in for NVML where it must read a GPU.
"""

from __future__ import annotations

import logging
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from sits_worker.device import pinning as devices
from sits_worker.device.cuda_visible import NvmlGpu, VisibleGpus, missing_gpu, visible_gpus
from sits_worker.device.pinning import Device

H100 = "NVIDIA H100 80GB HBM3"
GPUS = [NvmlGpu(0, "GPU-aaaa1111-0000-0000-0000-000000000000", H100),
        NvmlGpu(1, "GPU-aaaa2222-0000-0000-0000-000000000000", H100),
        NvmlGpu(2, "GPU-bbbb3333-0000-0000-0000-000000000000", H100)]
MIXED = [NvmlGpu(0, "GPU-aaaa1111-0000-0000-0000-000000000000", "NVIDIA A10"),
         NvmlGpu(1, "GPU-bbbb2222-0000-0000-0000-000000000000", H100)]


def physical(visible: VisibleGpus) -> list[int | None]:
    """NVML's index behind each CUDA device number (None: cannot be told)."""
    return [gpu.index if gpu else None for gpu in visible.gpus]


# --- the mapping -----------------------------------------------------------------------


@pytest.mark.parametrize(("variable", "expected"), [
    (None, [0, 1, 2]),                      # unset: every GPU, in NVML's (PCI) order
    ("2,0", [2, 0]),                        # numbered in the order listed
    ("1", [1]),
    (" 2 , 1 ", [2, 1]),                    # spaces around entries
    ("1a,2", [1, 2]),                       # an index is read as strtoul reads it
    ("+1", [1]),
    ("0,2,-1,1", [0, 2]),                   # the CUDA guide's example: the first invalid entry ends the list
    ("0,5,1", [0]),                         # an index past the last GPU is invalid too
    ("0,,1", [0]),
    ("GPU-bbbb3333-0000-0000-0000-000000000000", [2]),
    ("GPU-bbbb", [2]),                      # a unique UUID prefix
    ("GPU-aaaa2222,0", [1, 0]),             # UUIDs and indices
    ("GPU-aaaa,1", []),                     # an ambiguous prefix names no GPU
    ("0,GPU-cccc", [0]),                    # nor does an unknown UUID
])
def test_cuda_numbers_the_gpus_cuda_visible_devices_lists_in_its_order(variable: str | None,
                                                                       expected: list[int]) -> None:
    visible = visible_gpus(variable, GPUS)

    assert physical(visible) == expected
    assert visible.complete and visible.checked and visible.note == ""


@pytest.mark.parametrize("variable", ["", "-1", "NoDevFiles", " ", "none"])
def test_an_empty_or_invalid_first_entry_hides_every_gpu(variable: str) -> None:
    visible = visible_gpus(variable, GPUS)

    assert visible.gpus == () and visible.complete and visible.stopped_at == variable
    assert missing_gpu(0, visible, variable) == (
        f"CUDA_VISIBLE_DEVICES={variable!r} hides every GPU from CUDA"
        + (f" (its entry {variable.strip()!r} names no GPU here, so CUDA ignores it and any after it)"
           if variable.strip() else "")
        + ", so there is no gpu:0")


@pytest.mark.parametrize("variable", ["1,1", "0,2,0", "GPU-bbbb,2x,GPU-bbbb3333", "GPU-bbbb,2", "0,GPU-aaaa1111"])
def test_naming_a_gpu_twice_hides_every_gpu(variable: str) -> None:
    visible = visible_gpus(variable, GPUS)

    assert visible.gpus == () and visible.twice is not None
    assert "names one GPU twice" in str(missing_gpu(0, visible, variable))


def test_gpus_of_different_models_are_counted_but_mapped_only_in_pci_bus_order() -> None:
    """CUDA numbers GPUs fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID; NVML by PCI bus."""
    fastest_first = visible_gpus("1", MIXED)
    by_bus = visible_gpus("1", MIXED, cuda_device_order="PCI_BUS_ID")
    by_uuid = visible_gpus("GPU-bbbb", MIXED)

    assert physical(fastest_first) == [None] and fastest_first.complete
    assert "set CUDA_DEVICE_ORDER=PCI_BUS_ID" in fastest_first.note
    assert physical(visible_gpus(None, MIXED)) == [None, None]
    assert physical(by_bus) == [1] and by_bus.note == ""
    assert physical(by_uuid) == [1]  # a UUID names one GPU in any order
    assert physical(visible_gpus("5", MIXED)) == []  # counting does not depend on the order


def test_a_mig_instance_in_cuda_visible_devices_leaves_the_count_open_from_it() -> None:
    """A process sees one MIG instance at most, on a GPU not told here: nothing from it on is mapped or refused."""
    variable = "0,MIG-9d5c7a3e-0000-0000-0000-000000000000,MIG-GPU-aaaa1111-0000-0000-0000-000000000000/1/0"
    visible = visible_gpus(variable, GPUS)

    assert physical(visible) == [0, None] and not visible.complete
    assert "MIG instances" in visible.note
    assert missing_gpu(1, visible, variable) is None and missing_gpu(2, visible, variable) is None


def test_a_gpu_in_mig_mode_leaves_the_devices_from_it_on_unknown() -> None:
    """CUDA sees a MIG-mode GPU's instances instead of the GPU: as many as were made."""
    gpus = [GPUS[0], NvmlGpu(1, GPUS[1].uuid, H100, mig=True), GPUS[2]]

    everything = visible_gpus(None, gpus)
    only_it = visible_gpus("1", gpus)

    assert physical(everything) == [0, None] and not everything.complete
    assert f"NVML's GPU 1 ({GPUS[1].uuid}) is in MIG mode" in everything.note
    assert physical(only_it) == [None] and not only_it.complete
    assert missing_gpu(5, everything, None) is None  # not refused: it cannot be told
    assert physical(visible_gpus("2,0", gpus)) == [2, 0]  # GPUs not in MIG mode are mapped as ever


def test_without_nvml_the_variable_still_bounds_the_gpus_cuda_sees() -> None:
    unset = visible_gpus(None, None)
    listed = visible_gpus("3,1,-1,0", None)

    assert unset.gpus == () and not unset.complete and not unset.checked
    assert missing_gpu(7, unset, None) is None  # cannot be checked: ONNX Runtime will say
    assert listed.gpus == (None, None) and listed.complete and not listed.checked
    assert visible_gpus("", None).gpus == () and visible_gpus("0,0", None).twice == "0"
    assert missing_gpu(2, listed, "3,1,-1,0") == (
        "CUDA_VISIBLE_DEVICES='3,1,-1,0' lists at most 2 GPU(s) visible to CUDA (its entry '-1' names no GPU here, "
        "so CUDA ignores it and any after it), which it and ONNX Runtime number gpu:0 to gpu:1 in the order "
        "listed, so there is no gpu:2")


def test_a_gpu_number_past_the_visible_ones_is_refused_naming_cuda_visible_devices() -> None:
    assert missing_gpu(1, visible_gpus("2", GPUS), "2") == (
        "CUDA_VISIBLE_DEVICES='2' leaves 1 GPU(s) visible to CUDA, which it and ONNX Runtime number gpu:0 "
        "in the order listed, so there is no gpu:1")
    assert missing_gpu(0, visible_gpus("2", GPUS), "2") is None
    assert missing_gpu(3, visible_gpus(None, GPUS), None) == \
        "NVML sees 3 GPU(s) here, so there is no gpu:3"
    assert missing_gpu(0, visible_gpus(None, []), None) == \
        "NVML sees 0 GPU(s) here, so there is no gpu:0"


# --- NVML itself --------------------------------------------------------------------------


@pytest.mark.parametrize("setup", ["as installed here", "not installed"])
def test_without_an_nvml_that_answers_gpus_come_from_the_variable_alone(
        setup: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if setup == "not installed":  # as where nvidia-ml-py is not installed: `import pynvml` fails
        monkeypatch.setitem(sys.modules, "pynvml", None)
    elif devices.nvml_gpus() is not None:
        pytest.skip("NVML answers on this machine")
    monkeypatch.setattr(devices, "cuda_provider_available", lambda: True)  # so that the GPU check runs on
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")

    assert devices.nvml_gpus() is None
    assert devices.gpu_count() == 0 and devices.usable_gpus() == []
    assert devices.device_memory(Device("gpu", 0), 2**30)["source"] == "config"
    assert devices.gpu_problem(Device("gpu", 0)) is None
    assert "lists at most 1 GPU(s) visible to CUDA" in str(devices.gpu_problem(Device("gpu", 1)))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert devices.gpu_problem(Device("gpu", 1)) is None


class _Nvml(SimpleNamespace):
    """A stand-in for pynvml on a machine with these GPUs (there is no GPU on CI); handles are indices."""

    class NVMLError(Exception):
        pass

    NVML_DEVICE_MIG_ENABLE = 1

    def __init__(self, totals: list[int], mig: tuple[int, ...] = ()) -> None:
        super().__init__(totals=totals, mig=mig, read=[])

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.totals)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:
        return GPUS[handle].uuid.encode()  # older nvidia-ml-py answers bytes

    def nvmlDeviceGetName(self, handle: int) -> str:
        return H100

    def nvmlDeviceGetMigMode(self, handle: int) -> list[int]:
        if handle not in self.mig:
            raise self.NVMLError("Not Supported")
        return [1, 1]

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        self.read.append(handle)
        return SimpleNamespace(total=self.totals[handle], free=self.totals[handle] // 2,
                               used=self.totals[handle] - self.totals[handle] // 2)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        return SimpleNamespace(gpu=10 * (handle + 1), memory=5)


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> _Nvml:
    fake = _Nvml([10 * 2**30, 20 * 2**30, 30 * 2**30])
    monkeypatch.setattr(devices, "_nvml", lambda: fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    return fake


def test_a_gpu_s_capacity_is_read_from_the_nvml_gpu_cuda_numbers_it(nvml: _Nvml, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,GPU-aaaa2222")

    first, second = (devices.device_memory(Device("gpu", n), 2**30) for n in (0, 1))

    assert (first["total_bytes"], first["source"]) == (30 * 2**30, "nvml")
    assert (second["total_bytes"], second["source"]) == (20 * 2**30, "nvml")
    assert nvml.read == [2, 1]
    assert devices.nvml_gpus() == GPUS  # UUIDs as text, MIG mode off where NVML does not support it


def test_gpu_numbers_past_the_visible_ones_are_refused_and_get_no_capacity(
        nvml: _Nvml, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(devices, "cuda_provider_available", lambda: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")

    assert devices.gpu_count() == 1 and devices.usable_gpus() == ["gpu:0"]
    assert devices.gpu_problem(Device("gpu", 0)) is None
    assert devices.gpu_problem(Device("gpu", 1)) == (
        "CUDA_VISIBLE_DEVICES='1' leaves 1 GPU(s) visible to CUDA, which it and ONNX Runtime number gpu:0 "
        "in the order listed, so there is no gpu:1")
    with caplog.at_level(logging.WARNING, logger=devices.__name__):
        memory = devices.device_memory(Device("gpu", 1), 2**30)
    assert memory["source"] == "config" and nvml.read == []
    assert "cannot tell which NVML GPU gpu:1 is (CUDA_VISIBLE_DEVICES='1' leaves 1 GPU(s)" in caplog.text


def test_a_gpu_in_mig_mode_gets_the_configured_capacity_and_a_warning_saying_why(
        nvml: _Nvml, caplog: pytest.LogCaptureFixture) -> None:
    nvml.mig = (0,)

    with caplog.at_level(logging.WARNING, logger=devices.__name__):
        memory = devices.device_memory(Device("gpu", 0), 2**30)

    assert memory == {"total_bytes": 2**30, "free_bytes": 2**30, "source": "config"} and nvml.read == []
    assert f"NVML's GPU 0 ({GPUS[0].uuid}) is in MIG mode, so CUDA sees its MIG instances" in caplog.text


def test_an_nvml_that_fails_to_list_its_gpus_counts_as_none(nvml: _Nvml, caplog: pytest.LogCaptureFixture) -> None:
    def broken(index: int) -> int:
        raise nvml.NVMLError("GPU is lost")

    nvml.nvmlDeviceGetHandleByIndex = broken  # type: ignore[method-assign]

    with caplog.at_level(logging.WARNING, logger=devices.__name__):
        assert devices.nvml_gpus() is None and devices.gpu_count() == 0
    assert "NVML could not list the GPUs: GPU is lost" in caplog.text


def test_a_gpu_worker_reads_its_own_gpu_s_utilisation_and_memory_and_a_cpu_worker_none(
        nvml: _Nvml, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")

    assert devices.gpu_reading(Device("gpu", 0)) == {"utilization": 0.3, "memory_used_bytes": 15 * 2**30,
                                                      "memory_total_bytes": 30 * 2**30, "nvml_index": 2}
    assert devices.gpu_reading(Device("gpu", 1)) is None  # the variable names one GPU only
    assert devices.gpu_reading(Device("cpu")) is None
    monkeypatch.setattr(devices, "_nvml", lambda: None)  # no NVML on the host
    assert devices.gpu_reading(Device("gpu", 0)) is None
