"""The device a worker process is pinned to, and what NVML says about it.

`--gpu N` selects the CUDA provider with `device_id=N`: the N-th GPU CUDA sees, which with
CUDA_VISIBLE_DEVICES set is the N-th one that variable lists, whatever NVML's number for it
(`sits_worker.device.cuda_visible` maps one to the other). A worker pinned to a GPU it cannot use (no CUDA
provider in this ONNX Runtime build, or no GPU N visible) is refused at start (`gpu_problem`),
rather than running on the CPU while it reports a GPU; `auto` (and `sitsctl up`) picks the CPU
there instead. NVML is optional: when it is missing or finds no driver, or when the GPU behind
a device number cannot be told (MIG), the configured capacity is used.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sits_worker.device.cuda_visible import CUDA_VISIBLE_DEVICES, NvmlGpu, VisibleGpus, missing_gpu, visible_gpus

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


def gpu_problem(device: Device, environ: Mapping[str, str] | None = None) -> str | None:
    """Why a worker cannot run on `device` (a GPU), or None when it can (and for the CPU).

    Where NVML is missing the GPU's existence cannot be checked beyond what CUDA_VISIBLE_DEVICES
    lists; ONNX Runtime then reports a missing one when the first session is made.
    """
    if device.kind != "gpu":
        return None
    if not cuda_provider_available():
        return (f"this ONNX Runtime build has no CUDA provider, so {device} would run on the CPU "
                "(install onnxruntime-gpu for GPUs)")
    env = _environment(environ)
    return missing_gpu(device.index, _visible_here(nvml_gpus(), env), env.get(CUDA_VISIBLE_DEVICES))


def usable_gpus(environ: Mapping[str, str] | None = None) -> list[str]:
    """'gpu:N' for every GPU CUDA sees (after CUDA_VISIBLE_DEVICES) when NVML is present and ONNX Runtime
    has the CUDA provider; [] otherwise."""
    count = gpu_count(environ)
    return [f"gpu:{i}" for i in range(count)] if count and cuda_provider_available() else []


def _nvml() -> Any | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # no library, no driver, no GPU: all mean "no NVML here"
        return None


def gpu_count(environ: Mapping[str, str] | None = None) -> int:
    """Number of GPUs CUDA (and ONNX Runtime) numbers here: NVML's, after CUDA_VISIBLE_DEVICES (0 without NVML)."""
    gpus = nvml_gpus()
    return 0 if gpus is None else len(_visible_here(gpus, _environment(environ)).gpus)


def device_memory(device: Device, configured_bytes: int, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """{"total_bytes", "free_bytes", "source"} of `device`: NVML for a GPU when present and the GPU behind
    the device number can be told, else configured (and a warning says why)."""
    nvml = _nvml() if device.kind == "gpu" else None
    gpus = _listed_gpus(nvml)
    if nvml is not None and gpus is not None:
        env = _environment(environ)
        visible = _visible_here(gpus, env)
        gpu = visible.gpus[device.index] if device.index < len(visible.gpus) else None
        if gpu is None:
            why = visible.note or missing_gpu(device.index, visible, env.get(CUDA_VISIBLE_DEVICES))
            log.warning("cannot tell which NVML GPU %s is (%s); using the configured %d bytes "
                        "(resources.device_memory) as its capacity", device, why, configured_bytes)
        else:
            try:
                info = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(gpu.index))
                return {"total_bytes": int(info.total), "free_bytes": int(info.free), "source": "nvml"}
            except Exception as err:  # a vanished device or a driver error: fall back, but say so
                log.warning("NVML could not read %s (NVML's GPU %d): %s", device, gpu.index, err)
    return {"total_bytes": configured_bytes, "free_bytes": configured_bytes, "source": "config"}


def gpu_reading(device: Device, environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """What NVML says of the GPU behind `device` now, for the heartbeat and `/metrics` (`sits_gpu_*`):
    {"utilization" (a fraction, over NVML's last sample period), "memory_used_bytes",
    "memory_total_bytes", "nvml_index"}. None for a CPU device, without NVML, or when the GPU behind the
    device number cannot be told: a worker without a GPU then has no such series, rather than zeros."""
    nvml = _nvml() if device.kind == "gpu" else None
    gpus = _listed_gpus(nvml)
    if nvml is None or gpus is None:
        return None
    visible = _visible_here(gpus, _environment(environ)).gpus
    gpu = visible[device.index] if device.index < len(visible) else None
    if gpu is None:
        return None
    index = gpu.index
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        rates, memory = nvml.nvmlDeviceGetUtilizationRates(handle), nvml.nvmlDeviceGetMemoryInfo(handle)
    except Exception as err:  # a vanished device or a driver error: no reading this beat
        log.warning("NVML could not read %s (NVML's GPU %d): %s", device, index, err)
        return None
    return {"utilization": float(rates.gpu) / 100, "memory_used_bytes": int(memory.used),
            "memory_total_bytes": int(memory.total), "nvml_index": index}


# --- NVML's GPUs, and which one CUDA's device number N is ---------------------------------


def _environment(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    """The variables CUDA reads: the process's own unless a test passes others."""
    return os.environ if environ is None else environ


def _visible_here(gpus: Sequence[NvmlGpu] | None, environ: Mapping[str, str]) -> VisibleGpus:
    """The GPUs CUDA numbers 0, 1, ... with these variables (`cuda_visible.visible_gpus`)."""
    return visible_gpus(environ.get(CUDA_VISIBLE_DEVICES), gpus, environ.get("CUDA_DEVICE_ORDER"))


def nvml_gpus() -> list[NvmlGpu] | None:
    """The physical GPUs NVML lists, in NVML's order; None without NVML (or when it fails to list them)."""
    return _listed_gpus(_nvml())


def _listed_gpus(nvml: Any | None) -> list[NvmlGpu] | None:
    if nvml is None:
        return None
    try:
        gpus = []
        for index in range(int(nvml.nvmlDeviceGetCount())):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            gpus.append(NvmlGpu(index, _text(nvml.nvmlDeviceGetUUID(handle)), _text(nvml.nvmlDeviceGetName(handle)),
                                _mig_enabled(nvml, handle)))
        return gpus
    except Exception as err:  # a driver error: as if there were no NVML, but say so
        log.warning("NVML could not list the GPUs: %s", err)
        return None


def _mig_enabled(nvml: Any, handle: Any) -> bool:
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    except nvml.NVMLError:  # NOT_SUPPORTED on GPUs without MIG
        return False
    return bool(current == nvml.NVML_DEVICE_MIG_ENABLE)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def main(argv: Sequence[str]) -> int:
    """`python -m sits_worker.device.pinning usable-gpus | problem DEVICE`: what `sitsctl` asks before it starts
    workers, answered in a subprocess so the API package never imports the worker's execution side.
    Prints JSON: the usable GPUs as a list, or the problem of one device as a string (null: none)."""
    import json

    if list(argv) == ["usable-gpus"]:
        print(json.dumps(usable_gpus()))
    elif len(argv) == 2 and argv[0] == "problem":
        try:
            problem = gpu_problem(Device.parse(argv[1]))
        except ValueError as err:
            problem = str(err)
        print(json.dumps(problem))
    else:
        print("usage: python -m sits_worker.device.pinning usable-gpus | problem DEVICE", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
