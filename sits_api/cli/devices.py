"""What `sitsctl` asks about this machine's devices, answered by the worker package in a subprocess.

`sitsctl up` starts a worker per usable GPU, and `sitsctl worker --gpu N` refuses a GPU a worker
could not use before Celery prints its banner. Both questions need NVML and ONNX Runtime, which
belong to the worker side (`sits_worker/device/pinning.py`); asking in a child process keeps the API
package free of worker imports (the import contracts in pyproject.toml) and this process free of
ONNX Runtime.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from broker.errors import SitsError

_QUERY_TIMEOUT_SECONDS = 60.0
"""NVML and ONNX Runtime load in a second or two; a stuck driver must not hang `sitsctl` for good."""


def _ask(*args: str) -> Any:
    try:
        done = subprocess.run([sys.executable, "-m", "sits_worker.device.pinning", *args], capture_output=True,
                              text=True, timeout=_QUERY_TIMEOUT_SECONDS, check=False)
    except subprocess.TimeoutExpired as err:
        raise SitsError(f"asking which devices a worker can use took over {_QUERY_TIMEOUT_SECONDS:.0f} s "
                        "(a stuck GPU driver?); pin workers with --cpu or --gpu N") from err
    if done.returncode != 0:
        raise SitsError(f"could not ask which devices a worker can use: {done.stderr.strip()}")
    return json.loads(done.stdout)


def usable_gpus() -> list[str]:
    """'gpu:N' for every GPU a worker can run on here; [] on a CPU-only machine or ONNX Runtime build."""
    return list(_ask("usable-gpus"))


def gpu_problem(device: str) -> str | None:
    """Why a worker cannot run on `device` ('gpu:N'), or None when it can."""
    problem = _ask("problem", device)
    return str(problem) if problem else None
