"""The device a worker process is pinned to, and what NVML says about it.

`--gpu N` selects the CUDA provider with `device_id=N`. A worker pinned to a
GPU it cannot use (no CUDA provider in this ONNX Runtime build, or no GPU N)
is refused at start (`gpu_problem`), rather than running on the CPU while it
reports a GPU; `auto` (and `sitsctl up`) picks the CPU there instead. NVML is
optional: when it is missing or finds no driver the configured capacity is
used.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Device:
    """Where a worker runs its sessions: `cpu`, or `gpu` with an index."""

    kind: str = "cpu"
    index: int = 0

    @classmethod
    def parse(cls, text: str) -> Device:
        """'cpu', 'gpu', 'gpu:1' or 'auto' (first GPU when the CUDA provider is usable, else CPU)."""
        text = (text or "auto").strip().lower()
        if text == "auto":
            return cls("gpu", 0) if cuda_provider_available() and gpu_count() > 0 else cls("cpu", 0)
        kind, _, index = text.partition(":")
        if kind not in ("cpu", "gpu"):
            raise ValueError(f"device must be 'cpu', 'gpu:N' or 'auto', got {text!r}")
        return cls(kind, int(index or 0))

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"gpu:{self.index}"

    def providers(self) -> list[Any]:
        """ONNX Runtime providers for this device, CPU always last as the fallback."""
        if self.kind == "gpu" and cuda_provider_available():
            return [("CUDAExecutionProvider", {"device_id": self.index}), "CPUExecutionProvider"]
        if self.kind == "gpu":
            log.warning("device %s asked for, but this ONNX Runtime has no CUDA provider; using the CPU", self)
        return ["CPUExecutionProvider"]


def cuda_provider_available() -> bool:
    """True when the installed ONNX Runtime build has the CUDA provider (False without ONNX Runtime)."""
    try:
        import onnxruntime
    except ImportError:
        return False
    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


def gpu_problem(device: Device) -> str | None:
    """Why a worker cannot run on `device` (a GPU), or None when it can (and for the CPU).

    Without NVML the GPU's existence cannot be checked; ONNX Runtime then reports a missing one
    when the first session is made.
    """
    if device.kind != "gpu":
        return None
    if not cuda_provider_available():
        return (f"this ONNX Runtime build has no CUDA provider, so {device} would run on the CPU "
                "(install onnxruntime-gpu for GPUs)")
    nvml = _nvml()
    count = int(nvml.nvmlDeviceGetCount()) if nvml else None
    if count is not None and device.index >= count:
        return f"NVML sees {count} GPU(s) here, so there is no {device}"
    return None


def usable_gpus() -> list[str]:
    """'gpu:N' for every GPU NVML sees when ONNX Runtime has the CUDA provider; [] otherwise."""
    count = gpu_count()
    return [f"gpu:{i}" for i in range(count)] if count and cuda_provider_available() else []


def _nvml() -> Any | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # no library, no driver, no GPU: all mean "no NVML here"
        return None


def gpu_count() -> int:
    """Number of GPUs NVML sees (0 without NVML)."""
    nvml = _nvml()
    return int(nvml.nvmlDeviceGetCount()) if nvml else 0


def device_memory(device: Device, configured_bytes: int) -> dict[str, Any]:
    """{"total_bytes", "free_bytes", "source"} of `device`: NVML for a GPU when present, else configured."""
    nvml = _nvml() if device.kind == "gpu" else None
    if nvml is not None:
        try:
            info = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(device.index))
            return {"total_bytes": int(info.total), "free_bytes": int(info.free), "source": "nvml"}
        except Exception as err:  # a vanished device or a driver error: fall back, but say so
            log.warning("NVML could not read %s: %s", device, err)
    return {"total_bytes": configured_bytes, "free_bytes": configured_bytes, "source": "config"}
