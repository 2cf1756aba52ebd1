"""A tenant's model, checked in a process of its own: loaded, run on its probes, profiled and stored there.

Registration runs what a tenant sent. ONNX's checker and shape inference hold the GIL for seconds on a
large graph, during which every request thread of the API process waits; and the probes run the graph,
whose allocations its own values may choose (a graph of a few hundred bytes can ask for gigabytes). So
that work runs in a child process forked from multiprocessing's fork server (its modules loaded once,
so a child starts in milliseconds), under a CPU-time limit of `CHECK_SECONDS` and, once the model is
loaded (its size bounded by `models.max_file_size` before a byte is read), an address-space limit of
`CHECK_MEMORY_BYTES` beyond what it holds then, plus three times the model's size (its serialized copy, its
ONNX Runtime session, its written copy). A child past its memory fails its allocation; one past its time is
killed, as is one still running `CHECK_SECONDS` after it began, and one whose fork server (so whose API
process) died; either way its registration is refused (422) saying so, and the API process is untouched.
"""

from __future__ import annotations

import ctypes
import hashlib
import multiprocessing
import os
import resource
import secrets
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import onnx

from broker.errors import InvalidModel, SitsError, error_for_code
from sits_worker.model.batch_probe import check_rows_independent
from sits_worker.model.graph import model_signature, static_profile
from sits_worker.model.loading import load_model_checked
from sits_worker.model.padding import PADDING_EXACT_KEY, SEQUENCE_OUTPUTS_KEY
from sits_worker.model.sequence_probe import observe_sequence_outputs
from sits_worker.model.servable import check_runtime_loads, check_servable

CHECK_MEMORY_BYTES = 2 << 30
"""Address space a model's checks may take beyond their process's once the model is loaded, besides three
times the model's size (serialized, loaded by ONNX Runtime and written)."""
CHECK_SECONDS = 600
"""Most seconds, of CPU and of the clock, a model's checks may take."""


@dataclass(frozen=True)
class CheckedModel:
    """A model that passed its checks: its static profile (with what its probes saw), its version (the
    hash of its serialized graph), where its copy in the store is, and whether these checks wrote it."""

    profile: dict[str, Any]
    version: str
    stored: Path
    copied: bool


def check_and_store(source: Path, folders: Sequence[Path], *, name: str, max_bytes: int, store: Path) -> CheckedModel:
    """Load the model at `source` (inside `folders`, at most `max_bytes`), refuse it if it could never serve
    (InvalidModel, 422, and the errors `load_model_checked` raises), profile it and store a copy under
    `store`/`name`/its version: in a child process under `CHECK_MEMORY_BYTES` and `CHECK_SECONDS` (module
    docstring)."""
    memory_bytes, seconds = CHECK_MEMORY_BYTES, CHECK_SECONDS
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(send, source, tuple(folders), name, max_bytes, store, memory_bytes,
                                                 seconds), name=f"sits-model-check-{name}", daemon=True)
    child.start()
    send.close()
    try:
        if not receive.poll(seconds):
            raise InvalidModel(f"checking model '{name}' took over {seconds} s, the most a registration may take; "
                               "a model whose checks take that long cannot be registered")
        kind, payload = receive.recv()
    except EOFError:  # (it died without answering: killed at its CPU limit, or by its allocations' failure)
        child.join(5)
        raise InvalidModel(f"checking model '{name}' ended its process (exit code {child.exitcode}): running it on "
                           "two rows took more memory or CPU time than a registration may; a model must run its "
                           "probes within them") from None
    finally:
        if child.is_alive():
            child.kill()
        child.join(5)
        receive.close()
    if kind == "error":
        code, message = payload
        raise error_for_code(code, message)
    checked: CheckedModel = payload
    return checked


def checked_model(source: Path, folders: Sequence[Path], *, name: str, max_bytes: int, store: Path) -> CheckedModel:
    """What `check_and_store` does, in this process."""
    return _checked_loaded(load_model_checked(source, folders, max_bytes=max_bytes), source, name=name, store=store)


def _checked_loaded(model: onnx.ModelProto, source: Path, *, name: str, store: Path) -> CheckedModel:
    """The checks, probes, profile and stored copy of `model`, loaded from `source`."""
    check_servable(model)
    serialized = model.SerializeToString(deterministic=True)  # (over 2 GB: refused by load_model_checked)
    session = check_runtime_loads(serialized, source.name)  # (one CPU session for the probes below)
    check_rows_independent(serialized, model_signature(model), name, session)
    profile = static_profile(model)
    sequence_probe = observe_sequence_outputs(serialized, profile, session)
    del session
    if sequence_probe is not None:  # else mask_spec matches output dims by name, and pads
        profile[SEQUENCE_OUTPUTS_KEY] = sequence_probe.outputs
        profile[PADDING_EXACT_KEY] = sequence_probe.padding_exact
    version = content_hash(serialized)
    stored, copied = store_copy(model, store / name / version)
    return CheckedModel(profile, version, stored, copied)


def content_hash(serialized_model: bytes) -> str:
    """Version of a model: hash of its deterministically serialised graph with external data inlined."""
    return hashlib.sha256(serialized_model).hexdigest()[:12]


def store_copy(model: onnx.ModelProto, folder: Path) -> tuple[Path, bool]:
    """Write the model into the store (atomically, once per version); large models keep external data.

    Returns the stored file and whether this call wrote it. The temporary name is unique per call:
    registrations of the same file at once each write their own, and the first `os.replace` wins with
    identical bytes.
    """
    target = folder / "model.onnx"
    if target.exists():
        return target, False
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".model.onnx.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    large = model.ByteSize() > 1_800_000_000
    try:
        onnx.save_model(model, str(tmp), save_as_external_data=large,
                        location="model.onnx.data" if large else None)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target, True


def _child(send: Connection, source: Path, folders: tuple[Path, ...], name: str, max_bytes: int, store: Path,
           memory_bytes: int, seconds: int) -> None:
    """The child's work: its limits set, the checks run, their outcome sent (an error as its code and message)."""
    _die_with_fork_server()
    resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + 5))
    try:
        model = load_model_checked(source, folders, max_bytes=max_bytes)
        resource.setrlimit(resource.RLIMIT_AS, (_address_space() + memory_bytes + 3 * model.ByteSize(),
                                                resource.RLIM_INFINITY))
        outcome: tuple[str, Any] = ("ok", _checked_loaded(model, source, name=name, store=store))
    except MemoryError:
        outcome = ("error", (InvalidModel.code, f"model '{name}' took more memory than a registration may while it "
                                                "was checked and run on two rows; a model must run its probes "
                                                "within it"))
    except SitsError as err:
        outcome = ("error", (err.code, err.message))
    except Exception as err:  # (no SitsError: answered as the API answers an unexpected error)
        outcome = ("error", (SitsError.code, f"checking model '{name}' failed: {type(err).__name__}: {err}"))
    send.send(outcome)
    send.close()


def _die_with_fork_server() -> None:
    """Be killed when the fork server dies (it dies with its API process): a check must not run on, up to
    `CHECK_SECONDS` and its memory, for a process that is gone (Linux's `PR_SET_PDEATHSIG`)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    server = os.getppid()
    prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != server:  # (it died before the prctl took effect)
        os._exit(1)


_PR_SET_PDEATHSIG = 1


def _address_space() -> int:
    """This process's address space now (bytes), from /proc."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0
