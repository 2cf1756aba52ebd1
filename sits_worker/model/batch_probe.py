"""Whether a model's rows are independent, seen by running it at registration.

SITS merges requests (and job rows) into one batch and cuts each one's outputs back from axis 0.
That is right only when a row's outputs depend on that row alone and come one per row. Some valid
models break it, and their declared shapes cannot tell: pairwise scores (CLIP's
`logits[image_batch, text_batch]`, a Gram matrix), ops across the batch (dynamic quantization
scales the whole batch by its largest value, a Scan or an RNN over axis 0, a time-major LSTM whose
axis 0 is time), data-dependent first axes (NonMaxSuppression's detections). Merged, such a model
hands one request results computed with another's data, under a success status.

So the API runs the model on two rows of different scale, each alone and both together (in both
orders), and refuses it (InvalidModel) when an output of a row is not the same, or not one row per
input row. A model that answers one feed differently twice (random ops) is not judged.
The run is bounded like `sequence_probe`'s (`PROBE_FEED_MAX_BYTES`, `PROBE_SECONDS`); a model that
cannot be run here (too large, a feed over the bound, a failing or slow run, no onnxruntime) is not
judged, as before this check, and a model with a fixed batch axis needs none (it runs in pieces of
its own size: `runtime.run_session`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from broker.errors import InvalidModel
from sits_worker.model.sequence_probe import PROBE_FEED_MAX_BYTES, probe_session, run_within, same_values
from sits_worker.model.servable import RUNTIME_CHECK_MAX_BYTES

log = logging.getLogger(__name__)

DYNAMIC_LENGTH = 3
"""The size every dynamic axis after the batch gets in the probe's rows."""
ROW_SCALES = (0.01, 100.0)
"""The two rows' float values are standard normal numbers times these: a batch-wide statistic (a
dynamic quantization scale) set by the larger row flattens the smaller one's outputs."""


def check_rows_independent(serialized_model: bytes, signature: Mapping[str, Any], name: str,
                           session: Any = None) -> None:
    """InvalidModel when running two rows together changes an output of either from its run alone
    (see the module); nothing when they agree or the model was not run. `session`: the one
    `servable.check_runtime_loads` built (else one is built here)."""
    try:
        problem = _rows_interact(serialized_model, signature, session)
    except ProbeOutOfMemory as err:
        raise InvalidModel(f"model '{name}' ran out of the memory a registration may take while it ran on two "
                           f"rows ({err}); a model whose run on two rows takes that much cannot be served") from err
    if problem:
        raise InvalidModel(
            f"model '{name}' does not batch: {problem}. SITS merges requests and job rows into one batch, so "
            f"it would answer one request with results computed from another's data; re-export the model so "
            f"that each row's outputs depend on that row alone (no pairwise outputs across the batch, no "
            f"dynamic quantization, RNN, Scan or NonMaxSuppression across axis 0; batch axis first)")


class ProbeOutOfMemory(Exception):
    """A probe's run on two rows ran out of the memory its process may take (registration's checks run under
    a limit: `sits_api.intake.model_checks`)."""


def _out_of_memory(err: Exception) -> bool:
    """Whether an ONNX Runtime error says an allocation failed, as `device.runtime` reads it (the worker's rooms
    stand below the model package, which may not import them)."""
    text = str(err).lower()
    return "out of memory" in text or "failed to allocate" in text or "bad_alloc" in text


def _rows_interact(serialized_model: bytes, signature: Mapping[str, Any], session: Any) -> str | None:
    inputs = signature.get("inputs") or []
    if len(serialized_model) > RUNTIME_CHECK_MAX_BYTES or not inputs or any(
            entry["shape"] and isinstance(entry["shape"][0], int) for entry in inputs):
        return None
    if _feed_bytes(inputs) > PROBE_FEED_MAX_BYTES:
        log.info("model not run at registration to check its rows: its feed would exceed %d bytes",
                 PROBE_FEED_MAX_BYTES)
        return None
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    try:
        both = _two_rows(inputs)
        swapped = {key: value[::-1] for key, value in both.items()}  # a row may see the rows before it, or after
        session = session or probe_session(serialized_model, ort)
        names = [output.name for output in session.get_outputs()]
        runs = [run_within(session, feed, ort) for feed in (both, swapped, both)]
        alone = [run_within(session, {key: value[row : row + 1] for key, value in both.items()}, ort)
                 for row in (0, 1)]
    except MemoryError as err:
        raise ProbeOutOfMemory(str(err)) from err
    except Exception as err:  # onnxruntime raises its own types; an unrunnable probe judges nothing
        if _out_of_memory(err):  # (but one that ran out of memory on two rows judges the model: too big to run)
            raise ProbeOutOfMemory(str(err)) from err
        log.info("model not run at registration to check its rows (%s)", err)
        return None
    if not all(same_values(again, first) for again, first in zip(runs[2], runs[0], strict=True)):
        log.info("model not judged at registration: one feed run twice gave other outputs (random ops)")
        return None  # a sampler or a dropout in training mode: its rows may be independent all the same
    for index, name in enumerate(names):
        problem = (_compare(name, runs[0][index], alone[0][index], alone[1][index])
                   or _compare(name, runs[1][index], alone[1][index], alone[0][index]))
        if problem:
            return problem
    return None


def _shape(entry: Mapping[str, Any], rows: int) -> list[int]:
    """A feed's shape: `rows`, then the declared dims, `DYNAMIC_LENGTH` for a dynamic (or a nonsensical
    non-positive) one."""
    return [rows] + [dim if isinstance(dim, int) and dim > 0 else DYNAMIC_LENGTH
                     for dim in (entry["shape"] or [None])[1:]]


def _feed_bytes(inputs: list[Mapping[str, Any]]) -> int:
    return sum(math.prod(_shape(entry, 2)) * np.dtype(entry["dtype"]).itemsize for entry in inputs)


def _two_rows(inputs: list[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """Two rows per input, different in value and in scale: floats standard normal times
    `ROW_SCALES`, integers 0 and 1 (valid token ids and indices), booleans all false and all true."""
    rng = np.random.default_rng(0)
    feed: dict[str, np.ndarray] = {}
    for entry in inputs:
        dtype, shape = np.dtype(entry["dtype"]), _shape(entry, 2)
        if dtype.kind == "f":
            scales = np.array(ROW_SCALES).reshape(2, *[1] * (len(shape) - 1))
            feed[entry["name"]] = (rng.standard_normal(shape) * scales).astype(dtype)
        elif dtype.kind == "b":
            feed[entry["name"]] = np.stack([np.zeros(shape[1:], bool), np.ones(shape[1:], bool)])
        else:
            feed[entry["name"]] = np.stack([np.zeros(shape[1:]), np.ones(shape[1:])]).astype(dtype)
    return feed


def _compare(name: str, together: np.ndarray, first: np.ndarray, second: np.ndarray) -> str | None:
    """Why output `name` of the two rows run together is not their outputs alone, stacked."""
    if first.ndim == 0 or first.shape[0] != 1 or second.shape[0] != 1:
        return f"output '{name}' has {first.shape[0] if first.ndim else 'no'} rows for one input row"
    if together.shape != (2, *first.shape[1:]) or first.shape != second.shape:
        return (f"output '{name}' has shape {list(first.shape)} for one row but {list(together.shape)} for two "
                f"(its other axes follow the batch too)")
    for row, alone in ((0, first), (1, second)):
        if not same_values(together[row : row + 1], alone):
            return f"output '{name}' of a row changes when another row shares its batch"
    return None
