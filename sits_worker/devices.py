"""The device a worker process is pinned to, and what NVML says about it.

`--gpu N` selects the CUDA provider with `device_id=N`: the N-th GPU CUDA sees, which with
CUDA_VISIBLE_DEVICES set is the N-th one that variable lists, whatever NVML's number for it
(`visible_gpus` maps one to the other). A worker pinned to a GPU it cannot use (no CUDA
provider in this ONNX Runtime build, or no GPU N visible) is refused at start (`gpu_problem`),
rather than running on the CPU while it reports a GPU; `auto` (and `sitsctl up`) picks the CPU
there instead. NVML is optional: when it is missing or finds no driver, or when the GPU behind
a device number cannot be told (MIG), the configured capacity is used.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
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
    env = os.environ if environ is None else environ
    return missing_gpu(device, _visible_here(nvml_gpus(), env), env.get(CUDA_VISIBLE_DEVICES))


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
    return 0 if gpus is None else len(_visible_here(gpus, os.environ if environ is None else environ).gpus)


def device_memory(device: Device, configured_bytes: int, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """{"total_bytes", "free_bytes", "source"} of `device`: NVML for a GPU when present and the GPU behind
    the device number can be told, else configured (and a warning says why)."""
    nvml = _nvml() if device.kind == "gpu" else None
    gpus = _listed_gpus(nvml)
    if nvml is not None and gpus is not None:
        env = os.environ if environ is None else environ
        visible = _visible_here(gpus, env)
        gpu = visible.gpus[device.index] if device.index < len(visible.gpus) else None
        if gpu is None:
            why = visible.note or missing_gpu(device, visible, env.get(CUDA_VISIBLE_DEVICES))
            log.warning("cannot tell which NVML GPU %s is (%s); using the configured %d bytes "
                        "(resources.device_memory) as its capacity", device, why, configured_bytes)
        else:
            try:
                info = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(gpu.index))
                return {"total_bytes": int(info.total), "free_bytes": int(info.free), "source": "nvml"}
            except Exception as err:  # a vanished device or a driver error: fall back, but say so
                log.warning("NVML could not read %s (NVML's GPU %d): %s", device, gpu.index, err)
    return {"total_bytes": configured_bytes, "free_bytes": configured_bytes, "source": "config"}


# --- which GPU CUDA's device number N is ------------------------------------------------

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


def _visible_here(gpus: Sequence[NvmlGpu] | None, environ: Mapping[str, str]) -> VisibleGpus:
    return visible_gpus(environ.get(CUDA_VISIBLE_DEVICES), gpus, environ.get("CUDA_DEVICE_ORDER"))


@dataclass(frozen=True)
class NvmlGpu:
    """A physical GPU as NVML lists it: its NVML index, UUID ('GPU-…'), model name, and whether MIG mode is on."""

    index: int
    uuid: str
    name: str = ""
    mig: bool = False


@dataclass(frozen=True)
class VisibleGpus:
    """The devices CUDA numbers 0, 1, … (ONNX Runtime's `device_id`) and the NVML GPU behind each.

    `gpus[n]` is None where CUDA may see device n but which NVML GPU it is cannot be told (a MIG
    instance, an order NVML does not share, no NVML). `complete`: CUDA sees no device past `gpus`
    (it may see fewer where a slot is None); False where that cannot be told (a GPU in MIG mode
    shows CUDA its instances, as many as were made). `checked`: NVML confirmed that the GPUs
    listed exist (False without NVML: CUDA sees at most those). `stopped_at`: the CUDA_VISIBLE_DEVICES
    entry that names no GPU, which CUDA ignores with every entry after it; `twice`: the entry naming
    a GPU listed before, which hides every GPU. `note`: why some device cannot be mapped, for
    messages and logs.
    """

    gpus: tuple[NvmlGpu | None, ...]
    complete: bool = True
    checked: bool = True
    stopped_at: str | None = None
    twice: str | None = None
    note: str = ""


def visible_gpus(cuda_visible_devices: str | None, nvml_gpus: Sequence[NvmlGpu] | None,
                 cuda_device_order: str | None = None) -> VisibleGpus:
    """Which GPUs CUDA numbers 0..k-1 in this environment, from CUDA_VISIBLE_DEVICES and NVML's GPUs
    (None: NVML is missing); a pure function, so every case is tested without a GPU.

    CUDA's rules (CUDA programming guide, "CUDA Environment Variables"; torch.cuda's
    `_parse_visible_devices` for the parts it leaves out): entries are indices (read as strtoul
    does: '1a' is 1) or UUIDs, 'GPU-' ones by any unique prefix; the visible GPUs are numbered in the
    order listed; the first entry naming no GPU ('-1', 'NoDevFiles', an index past the last GPU)
    ends the list, so '' and '-1' hide every GPU; naming one twice hides every GPU. Indices count in
    CUDA's own order, fastest GPU first unless CUDA_DEVICE_ORDER=PCI_BUS_ID, while NVML counts by
    PCI bus: the two agree only when all GPUs are the same model or that order is set.
    """
    notes: list[str] = []
    checked = nvml_gpus is not None
    by_index = {gpu.index: gpu for gpu in nvml_gpus or ()}
    same_order = checked and ((cuda_device_order or "").strip().upper() == "PCI_BUS_ID"
                              or len({gpu.name for gpu in by_index.values()}) <= 1)
    if nvml_gpus is None:
        if cuda_visible_devices is None:
            return VisibleGpus((), complete=False, checked=False,
                               note="NVML is not available, so the GPUs here cannot be counted")
        notes.append("NVML is not available, so the GPUs CUDA_VISIBLE_DEVICES names cannot be checked")
    elif not same_order:
        notes.append("CUDA numbers GPUs of different models fastest first and NVML by PCI bus, so which NVML GPU "
                     "a device number is cannot be told: set CUDA_DEVICE_ORDER=PCI_BUS_ID")
    entries = ([str(index) for index in sorted(by_index)] if cuda_visible_devices is None
               else cuda_visible_devices.split(","))
    slots: list[NvmlGpu | None] = []
    seen: set[tuple[str, Any]] = set()
    for raw in entries:
        entry = raw.strip()
        gpu: NvmlGpu | None = None
        if entry.startswith("MIG-"):
            key: tuple[str, Any] = ("mig", entry)
            notes.append("CUDA_VISIBLE_DEVICES names MIG instances, which are not mapped to NVML GPUs here")
        elif entry.startswith("GPU-"):
            matches = [candidate for candidate in nvml_gpus or () if candidate.uuid.startswith(entry)]
            if checked and len(matches) != 1:
                return _stopped(slots, raw, notes, checked)
            gpu = matches[0] if matches else None
            key = ("uuid", gpu.index if gpu else entry)
        else:
            number = re.match(r"[+-]?\d+", entry)
            index = int(number.group()) if number else -1
            if index < 0 or (checked and index not in by_index):
                return _stopped(slots, raw, notes, checked)
            gpu = by_index.get(index) if same_order else None
            key = ("index", index)
        if key in seen:
            return VisibleGpus((), checked=checked, twice=entry,
                               note=f"CUDA_VISIBLE_DEVICES names one GPU twice ({entry!r}), which hides every GPU")
        seen.add(key)
        maybe_mig = gpu.mig if gpu is not None else key[0] != "mig" and any(other.mig for other in nvml_gpus or ())
        if maybe_mig:  # CUDA sees a MIG-mode GPU's instances, not the GPU: as many as were made, none if none were
            which = f"NVML's GPU {gpu.index} ({gpu.uuid})" if gpu is not None else "a GPU here"
            notes.append(f"{which} is in MIG mode, so CUDA sees its MIG instances, which are not mapped to NVML here")
            return VisibleGpus((*slots, None), complete=False, checked=checked, note=_joined(notes))
        slots.append(gpu)
    return VisibleGpus(tuple(slots), checked=checked, note=_joined(notes))


def _stopped(slots: list[NvmlGpu | None], entry: str, notes: list[str], checked: bool) -> VisibleGpus:
    return VisibleGpus(tuple(slots), checked=checked, stopped_at=entry, note=_joined(notes))


def _joined(notes: list[str]) -> str:
    return "; ".join(dict.fromkeys(notes))


def missing_gpu(device: Device, visible: VisibleGpus, cuda_visible_devices: str | None) -> str | None:
    """Why CUDA has no device number `device.index` here, or None when it has one (or may have:
    where MIG or a missing NVML leaves it open)."""
    if not visible.complete or device.index < len(visible.gpus):
        return None
    count = len(visible.gpus)
    if cuda_visible_devices is None:
        return f"NVML sees {count} GPU(s) here, so there is no {device}"
    named = f"{CUDA_VISIBLE_DEVICES}={cuda_visible_devices!r}"
    stopped = (f" (its entry {visible.stopped_at.strip()!r} names no GPU here, so CUDA ignores it and any after it)"
               if visible.stopped_at is not None and visible.stopped_at.strip() else "")
    if visible.twice is not None:
        return (f"{named} names one GPU twice ({visible.twice!r}), which hides every GPU from CUDA, "
                f"so there is no {device}")
    if count == 0:
        return f"{named} hides every GPU from CUDA{stopped}, so there is no {device}"
    numbers = "gpu:0" if count == 1 else f"gpu:0 to gpu:{count - 1}"
    leaves = "leaves" if visible.checked else "lists at most"
    return (f"{named} {leaves} {count} GPU(s) visible to CUDA{stopped}, which it and ONNX Runtime number "
            f"{numbers} in the order listed, so there is no {device}")


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
