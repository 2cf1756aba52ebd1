"""Which physical GPU CUDA's device number N is: CUDA_VISIBLE_DEVICES read against NVML's GPUs.

`--gpu N` is CUDA's (and ONNX Runtime's `device_id`) device N, the N-th GPU CUDA_VISIBLE_DEVICES
lists when it is set, while NVML numbers every physical GPU by PCI bus. The memory capacity a
worker reserves against, and the check that GPU N exists at all, need the NVML GPU behind N.
Pure functions over the variable's text and NVML's list (`sits_worker.device.pinning` reads both), so
every case is tested without a GPU.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


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

    CUDA's rules (CUDA programming guide, "CUDA Environment Variables"): entries are indices (read
    as strtoul does: '1a' is 1) or UUIDs, 'GPU-' ones by any unique prefix; the visible GPUs are
    numbered in the order listed; the first entry naming no GPU ('-1', 'NoDevFiles', an index past
    the last GPU) ends the list, so '' and '-1' hide every GPU; naming one twice (by index or by
    UUID) hides every GPU. A 'MIG-' entry makes CUDA see one MIG instance, whose GPU is not told
    here: the count stays open from there (`complete` False). Indices count in
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
        if entry.startswith("MIG-"):  # a process sees one MIG instance at most, and which GPU it is on is not told
            notes.append("CUDA_VISIBLE_DEVICES names MIG instances, which are not mapped to NVML GPUs here")
            return VisibleGpus((*slots, None), complete=False, checked=checked, note=_joined(notes))
        if entry.startswith("GPU-"):
            matches = [candidate for candidate in nvml_gpus or () if candidate.uuid.startswith(entry)]
            if checked and len(matches) != 1:
                return _stopped(slots, raw, notes, checked)
            gpu = matches[0] if matches else None
            key: tuple[str, Any] = ("gpu", gpu.index) if gpu else ("uuid", entry)
        else:
            number = re.match(r"[+-]?\d+", entry)
            index = int(number.group()) if number else -1
            if index < 0 or (checked and index not in by_index):
                return _stopped(slots, raw, notes, checked)
            gpu = by_index.get(index) if same_order else None
            # In NVML's order an index names the GPU its UUID would; in CUDA's own order it cannot be told.
            key = ("gpu", index) if same_order else ("cuda index", index)
        if key in seen:
            return VisibleGpus((), checked=checked, twice=entry,
                               note=f"CUDA_VISIBLE_DEVICES names one GPU twice ({entry!r}), which hides every GPU")
        seen.add(key)
        maybe_mig = gpu.mig if gpu is not None else any(other.mig for other in nvml_gpus or ())
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


def missing_gpu(index: int, visible: VisibleGpus, cuda_visible_devices: str | None) -> str | None:
    """Why CUDA has no device number `index` (`gpu:<index>`) here, or None when it has one (or may have:
    where MIG or a missing NVML leaves it open)."""
    device = f"gpu:{index}"
    if not visible.complete or index < len(visible.gpus):
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
