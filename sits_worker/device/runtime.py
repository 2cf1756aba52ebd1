"""ONNX Runtime sessions: one per model version per process, shared by the worker's threads.

ONNX Runtime allows `run()` on one session from several threads at once, so
the up-to-`max_concurrent_streams` batches of a worker share it. Errors of
onnxruntime are translated here into `broker.errors`, so no caller catches
an onnxruntime type.
"""

from __future__ import annotations

import os
import re
import threading
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from broker.errors import BadInput, DeviceOutOfMemory, HostMemoryCapped, InferenceTimeout, InvalidModel
from sits_worker.device.pinning import Device
from sits_worker.device.run_limits import RunLimits, RunWatch

INTRA_OP_SPIN_MICROSECONDS = 100
"""How long an idle intra-op thread spins for more work before it sleeps: long enough to span the gap
between a job's mini-batches (about 30 us), short against the milliseconds between online batches.
ONNX Runtime's default (about 40 ms) and 1 ms both took CPU from the rest of the worker between runs
(docs/benchmarks.md, "Where an online request's CPU goes")."""


_HOST_LIMIT: list[int] = []
"""The bytes `limit_host_memory` capped this process's sessions at (empty: not capped)."""


CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
"""Where a container's memory limit is read (cgroup v2, then v1): the host's own memory is not the worker's
when it runs in one."""


def host_memory_cap(configured: int) -> int:
    """The cap `limit_host_memory` takes: `resources.host_memory_limit`, or (0) three quarters of the memory
    this process may have (the host's, or its container's limit when lower), leaving the rest to Redis, the
    API and the system beside it. Several workers on one host should each be given their share."""
    if configured:
        return configured
    try:
        memory = int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, AttributeError):  # (no such counters here: no cap)
        return 0
    for path in CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            memory = min(memory, int(text))
    return memory * 3 // 4


def limit_host_memory(max_bytes: int) -> None:
    """Put every session made after this in the process on one CPU memory arena of at most `max_bytes`
    (`resources.host_memory_limit`): an allocation past it fails the run as out of memory. Without it each
    session grows its own arena as far as its runs ask, and a graph whose allocation sizes come from its
    inputs' values (a `ConstantOfShape` fed by an input) takes as much of the host as a request names.
    Once per process: ONNX Runtime keeps one such allocator, so a second call keeps the first's limit. The
    arena holds the sessions' weights too: `max_bytes` must leave room for the models a worker loads. 0: no
    cap."""
    if _HOST_LIMIT or max_bytes <= 0:
        return
    info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
    ort.create_and_register_allocator(info, ort.OrtArenaCfg(int(max_bytes), -1, -1, -1))
    _HOST_LIMIT.append(int(max_bytes))


def session_options(intra_op_threads: int, *, optimized_model_path: Path | None = None) -> ort.SessionOptions:
    """Options SITS uses for every session: full graph optimisation, the configured threads, a short spin,
    the process's capped arena once `limit_host_memory` made it."""
    options = ort.SessionOptions()
    if _HOST_LIMIT:
        options.add_session_config_entry("session.use_env_allocators", "1")
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if intra_op_threads:
        options.intra_op_num_threads = intra_op_threads
    # Read by onnxruntime >= 1.26; older versions ignore the key and keep their own spin.
    options.add_session_config_entry("session.intra_op.spin_duration_us", str(INTRA_OP_SPIN_MICROSECONDS))
    if optimized_model_path is not None:
        options.optimized_model_filepath = str(optimized_model_path)
    return options


def build_session(model_path: Path, device: Device, intra_op_threads: int,
                  *, optimized_model_path: Path | None = None) -> ort.InferenceSession:
    """A new session for `model_path` on `device`; InvalidModel when ONNX Runtime cannot load it."""
    try:
        return ort.InferenceSession(
            str(model_path),
            sess_options=session_options(intra_op_threads, optimized_model_path=optimized_model_path),
            providers=device.providers(),
        )
    except Exception as err:  # onnxruntime raises its own exception types
        if _is_out_of_memory(err):
            raise DeviceOutOfMemory(f"not enough memory on {device} to load {model_path.name}") from err
        raise InvalidModel(f"ONNX Runtime cannot load {model_path}: {err}") from err


def run_session(session: ort.InferenceSession, feed: Mapping[str, np.ndarray],
                output_names: list[str] | None = None, limits: RunLimits | None = None) -> list[np.ndarray]:
    """`session.run` with onnxruntime's errors translated into SITS errors; each `session.run` under
    `limits`' time limit when given (a run it stopped is an `InferenceTimeout`, `sits_worker/device/run_limits.py`).

    A model whose inputs fix the batch axis (exported without a dynamic batch: `[1, 3, 224, 224]`)
    runs exactly that many rows at a time, so a batch of any other size is run in pieces of that
    size, the last one padded with zero rows, and the outputs cut back and joined: merged requests
    and job mini-batches work on such a model as on any other.

    Every output must come back with the rows fed along axis 0, since that is where each request's
    (or job row's) outputs are cut from; one that does not (registration refuses the models whose
    declared shapes show it, but a dynamic first axis may still turn out to be something else) is an
    InvalidModel naming it, not outputs handed to the wrong rows.
    """
    rows_per_run = fixed_batch_rows(session)
    rows = _rows(feed)
    if rows_per_run is None or rows in (0, rows_per_run):
        return _batch_outputs(session, _run(session, feed, output_names, limits), rows, output_names)
    pieces = []
    for start in range(0, rows, rows_per_run):
        piece = {name: array[start : start + rows_per_run] for name, array in feed.items()}
        real = _rows(piece)
        if real < rows_per_run:
            piece = {name: _padded(array, rows_per_run) for name, array in piece.items()}
        outputs = _batch_outputs(session, _run(session, piece, output_names, limits), rows_per_run, output_names)
        pieces.append([output[:real] for output in outputs])
    return [np.concatenate(parts) for parts in zip(*pieces, strict=True)]


_FIXED_BATCH: weakref.WeakKeyDictionary[Any, int | None] = weakref.WeakKeyDictionary()


def fixed_batch_rows(session: ort.InferenceSession) -> int | None:
    """The rows every run of the session's model must have, when its inputs fix the batch axis
    (axis 0 a number); None when any number of rows goes. Read once per session."""
    try:
        return _FIXED_BATCH[session]
    except KeyError:
        fixed = {dims[0] for dims in (node.shape for node in session.get_inputs())
                 if dims and isinstance(dims[0], int) and dims[0] > 0}
        _FIXED_BATCH[session] = rows = max(fixed) if fixed else None  # (registration refuses two sizes)
        return rows


def _batch_outputs(session: ort.InferenceSession, outputs: list[np.ndarray], rows: int,
                   output_names: list[str] | None) -> list[np.ndarray]:
    """`outputs`, once each is checked to hold `rows` rows along axis 0 (see `run_session`)."""
    for name, output in zip(output_names or [node.name for node in session.get_outputs()], outputs, strict=True):
        if output.ndim == 0 or output.shape[0] != rows:
            raise InvalidModel(f"model output '{name}' came back with shape {list(output.shape)} from a batch of "
                               f"{rows} rows; SITS cuts each request's (and job row's) outputs from axis 0, so every "
                               f"output needs the batch axis first: re-export the model with outputs of shape "
                               f"[batch, ...]")
    return outputs


def _padded(array: np.ndarray, rows: int) -> np.ndarray:
    """`array` with zero rows appended up to `rows`."""
    filler = np.zeros((rows - array.shape[0], *array.shape[1:]), dtype=array.dtype)
    return np.concatenate([array, filler])


def _run(session: ort.InferenceSession, feed: Mapping[str, np.ndarray],
         output_names: list[str] | None, limits: RunLimits | None = None) -> list[np.ndarray]:
    if limits is None:
        return _run_watched(session, feed, output_names, None)
    with limits.watch() as watch:
        return _run_watched(session, feed, output_names, watch)


def _run_watched(session: ort.InferenceSession, feed: Mapping[str, np.ndarray],
                 output_names: list[str] | None, watch: RunWatch | None) -> list[np.ndarray]:
    try:
        return session.run(output_names, dict(feed), watch.options if watch is not None else None)
    except Exception as err:
        if watch is not None and watch.timed_out:
            raise InferenceTimeout(f"a run of {_rows(feed)} rows passed scheduler.run_time_limit "
                                   f"({watch.limit_seconds:g}s) and was stopped") from err
        if _is_capped(err) and _asked_bytes(err) * 2 > _HOST_LIMIT[0]:
            raise HostMemoryCapped(f"device out of memory running a batch of {_rows(feed)} rows: it would take "
                                   f"the worker past resources.host_memory_limit ({_HOST_LIMIT[0]} bytes)") from err
        if _is_out_of_memory(err):
            raise DeviceOutOfMemory(f"device out of memory running a batch of {_rows(feed)} rows") from err
        raise BadInput(f"ONNX Runtime rejected the batch: {err}") from err


def _rows(feed: Mapping[str, np.ndarray]) -> int:
    return next((int(array.shape[0]) for array in feed.values()), 0)


def _is_out_of_memory(err: Exception) -> bool:
    text = str(err).lower()
    return "out of memory" in text or "failed to allocate" in text or "bad_alloc" in text or _is_capped(err)


def _is_capped(err: Exception) -> bool:
    """Whether `err` is the capped arena's refusal (`limit_host_memory`), not the device's own shortage."""
    return bool(_HOST_LIMIT) and "smaller than requested bytes" in str(err).lower()


def _asked_bytes(err: Exception) -> int:
    """What the capped arena's refusal says the run asked for (0 when it does not say). One allocation of
    more than half the whole cap is the run's own (HostMemoryCapped); a smaller one refused means the arena
    is full (the models' weights, the other runs), which is the worker's state, not the request's."""
    found = re.search(r"requested bytes of (\d+)", str(err))
    return int(found.group(1)) if found else 0


class SessionCache:
    """Sessions by model version for this process; built once, under a lock, on first use."""

    def __init__(self, device: Device, intra_op_threads: int) -> None:
        self.device = device
        self.intra_op_threads = intra_op_threads
        self._sessions: dict[tuple[str, str], ort.InferenceSession] = {}
        self._lock = threading.Lock()

    def get(self, model_ref: str, model_path: Path, *, device: Device | None = None) -> ort.InferenceSession:
        """The session of `model_ref` on `device` (default: this worker's device)."""
        device = device or self.device
        key = (model_ref, str(device))
        session = self._sessions.get(key)
        if session is None:
            with self._lock:
                session = self._sessions.get(key)
                if session is None:
                    session = build_session(model_path, device, self.intra_op_threads)
                    self._sessions[key] = session
        return session

    def offload(self, model_ref: str, model_path: Path) -> ort.InferenceSession:
        """The CPU session that runs what did not fit the device (`cpu-offload-on-oom`). It is a
        session of its own also on a CPU worker, so that faults injected into the device's runs
        stay out of it (docs/failures.md, "Device out of memory")."""
        key = (model_ref, "cpu-offload")
        session = self._sessions.get(key)
        if session is None:
            with self._lock:
                session = self._sessions.get(key)
                if session is None:
                    session = build_session(model_path, Device("cpu"), self.intra_op_threads)
                    self._sessions[key] = session
        return session

    def loaded(self) -> list[str]:
        """Model refs with a session in this process."""
        return sorted({ref for ref, _ in self._sessions})

    def providers_of(self, model_ref: str) -> Any:
        """The providers the session of `model_ref` really uses (for status and tests)."""
        session = self._sessions.get((model_ref, str(self.device)))
        return session.get_providers() if session else None
