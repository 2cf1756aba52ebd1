"""The `resources` settings section: what a worker may use on its device."""

from __future__ import annotations

from pydantic import Field

from broker.setting_types import Bytes, Integer, parse_size
from broker.setting_types import Section as _Section

MAX_CONCURRENT_STREAMS = 64
"""The most stream slots (batches in flight at once) one worker may have."""


class ResourceSettings(_Section):
    """What a worker may use on its device."""

    gpu_memory_granularity: Bytes = parse_size("128MiB")
    """The unit a GPU worker reserves batch memory in."""
    cpu_memory_granularity: Bytes = parse_size("2MiB")
    """The unit a CPU worker reserves batch memory in: CPU batches need a few MiB, so GPU-sized units
    would be almost all waste (fragmentation ~98 % at 128 MiB, ~22 % at 2 MiB, measured)."""
    max_concurrent_streams: Integer = Field(4, ge=1, le=MAX_CONCURRENT_STREAMS)
    """Most batches a worker runs at once; a CPU worker runs at most one per core (its streams x
    intra-op threads stay within its cores: `sits_worker/device/worker_settings.py`)."""
    intra_op_threads: Integer = Field(0, ge=0)
    """ONNX Runtime intra-op threads per session; 0 (auto): on a CPU worker its cores shared out among
    its streams, on a GPU worker ONNX Runtime's own choice."""
    device_memory: Bytes = parse_size("16GiB")
    """Capacity assumed for a device when NVML cannot tell (a CPU's, always)."""
    device_memory_limit: Bytes = 0
    """Most batch memory a worker may reserve on its device, whatever NVML reports (a device shared
    with other work); 0: the whole device."""
    host_memory_limit: Bytes = 0
    """Most host memory ONNX Runtime may hold in one worker process, all its sessions together (their
    weights, and what their runs allocate): a run that would pass it fails as out of memory (split, then
    failed, as any), rather than a model whose allocations follow its inputs' values taking the host's memory
    from every tenant. 0: three quarters of the host's physical memory."""
