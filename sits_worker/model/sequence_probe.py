"""Which outputs of a padded token model carry the sequence, seen by running the model at registration.

A worker pads merged token requests to the longest and cuts every output that carries the sequence
back to each request's own length (`padding.unpad_outputs`). Which outputs those are cannot be told
from dim names: torch's exporter names an output dim `Mullast_hidden_state_dim_1` when
`dynamic_axes` lists only the inputs, others leave it unnamed, and such outputs came back at the
padded length. So the API runs a model that declares an attention mask on two tiny feeds of
different sequence lengths and records, per output, the axes whose size was the length both times:
the static profile's `padding.SEQUENCE_OUTPUTS_KEY`, read by `padding.mask_spec`.

Padding on the right is exact only for a model whose outputs at real tokens see real tokens alone. A
model whose output reads a fixed position from the end (a causal decoder's `logits[:, -1, :]`) reads a
pad position there for every shorter merged request, and nothing in its shapes says so. So the probe
also runs the shorter row padded to the longer length as a worker pads it (`padding.pad_batch`), cuts
its outputs back on the observed axes (`padding.unpad_outputs`) and compares them with the row's own
run: a difference is the profile's `padding.PADDING_EXACT_KEY` = False, and such a model is never padded
(its requests merge only at equal lengths).

The probe runs in the API process, on a request thread, so it is bounded: a feed that would hold
more than `PROBE_FEED_MAX_BYTES` (all inputs at the longer length; fixed dims are kept, so a model
declaring [1, 20000, 20000] asks for gigabytes) is not built and the model is not run (the probe holds
its three feeds together, each within the bound: both lengths and the shorter padded to the longer),
and each of its three runs is stopped after `PROBE_SECONDS`. That stop is ONNX Runtime's
`RunOptions.terminate`, checked only between nodes: one node runs to its end (a MatMul of two fixed
[1, 3000, 3000] inputs ran 1.1 s past a 0.3 s limit), which the feed bound keeps short for nodes that
work on the inputs. Nodes that expand small inputs (Expand, Tile, ConstantOfShape) or multiply them by
large weights are bounded only by the model's size (`servable.RUNTIME_CHECK_MAX_BYTES`). A model not
run keeps name matching.

onnxruntime is imported only when a model is probed: the API imports this module
(docs/architecture.md, "The light model package").
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from sits_worker.model.padding import MaskSpec, declared_max_sequence, mask_spec, pad_batch, unpad_outputs
from sits_worker.model.servable import RUNTIME_CHECK_MAX_BYTES

log = logging.getLogger(__name__)

PROBE_LENGTHS = (3, 5)
"""The two sequence lengths the model runs at: small, different, neither 1 (a batch of one row)."""
PROBE_SECONDS = 10.0
"""A probe run that takes longer is stopped (ONNX Runtime's `RunOptions.terminate`) and not used."""
PROBE_FEED_MAX_BYTES = 4 * 2**20
"""The most a probe feed may hold, all inputs together at the longer length; a model that asks for more is not
run. Token models' feeds are a few hundred bytes; only fixed dims (or many inputs) reach this."""


class SequenceProbe(NamedTuple):
    """What running a masked token model at registration showed: the static profile's
    `padding.SEQUENCE_OUTPUTS_KEY` (`outputs`) and `padding.PADDING_EXACT_KEY` (`padding_exact`)."""

    outputs: list[list[str | int]]
    """[output, axis] pairs whose size followed the sequence length over the two runs."""
    padding_exact: bool
    """Whether the shorter row, padded on the right and cut back, gave its own outputs."""


def observe_sequence_outputs(serialized_model: bytes, profile: Mapping[str, Any],
                             session: Any = None) -> SequenceProbe | None:
    """Which outputs followed the sequence length over two runs of the model, and whether padding kept
    a row's outputs (`padding_keeps_outputs`, a third run).

    Runs only a model that declares an attention mask (`padding.mask_spec`; no other model is
    padded), on `session` (the one `servable.check_runtime_loads` built) or one built as cheaply: one row, the token
    input, the mask and the inputs that carry the same sequence (by dim name) at each of
    `PROBE_LENGTHS`, every other dynamic dim 1. None when the model was not run: no declared mask,
    larger than `servable.RUNTIME_CHECK_MAX_BYTES`, no onnxruntime in this process, a declared
    `sits.max_sequence` under 2, a feed over `PROBE_FEED_MAX_BYTES` (never built), or one of the two
    runs failed or outlasted `PROBE_SECONDS`; `mask_spec` then matches output dims by name and pads, as
    before the probe. A padded run that fails or outlasts `PROBE_SECONDS` counts as padding not exact:
    the worker would pad such a batch the same way.
    """
    spec = mask_spec(profile)
    lengths = probe_lengths(declared_max_sequence(profile))
    if spec is None or lengths is None or len(serialized_model) > RUNTIME_CHECK_MAX_BYTES:
        return None
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    signature = profile.get("signature") or {}
    try:
        feed_bytes = probe_feed_bytes(signature, spec, max(lengths))
        if feed_bytes > PROBE_FEED_MAX_BYTES:
            log.info("token model not run at registration: its feed would hold %d bytes, over the %d-byte bound "
                     "(PROBE_FEED_MAX_BYTES); its outputs are cut back by dim name", feed_bytes, PROBE_FEED_MAX_BYTES)
            return None
        session = session or probe_session(serialized_model, ort)
        feeds = [probe_feed(signature, spec, length, profile.get("vocabulary_size")) for length in lengths]
        runs = [run_within(session, feed, ort) for feed in feeds]
    except Exception as err:  # onnxruntime raises its own types; the model keeps name matching
        log.info("token model not run at registration (%s); its outputs are cut back by dim name", err)
        return None
    names = [output.name for output in session.get_outputs()]
    observed: list[list[str | int]] = []
    for name, first, second in zip(names, *runs, strict=True):
        if first.ndim == second.ndim:
            observed.extend([name, axis] for axis in range(1, first.ndim)
                            if first.shape[axis] == lengths[0] and second.shape[axis] == lengths[1])
    cut_spec = spec._replace(sequence_outputs=tuple((str(name), int(axis)) for name, axis in observed))
    try:
        padding_exact = padding_keeps_outputs(session, cut_spec, feeds[0], feeds[1], runs[0], ort)
    except Exception as err:  # a worker padding a merged batch would meet the same failure
        log.info("token model not padded: its padded run at registration failed (%s); its requests merge at "
                 "equal lengths", err)
        return SequenceProbe(observed, False)
    if not padding_exact:
        log.info("token model not padded: a row padded on the right gave other outputs than the row alone "
                 "(an output reads a pad position, e.g. the last token's); its requests merge at equal lengths")
    return SequenceProbe(observed, padding_exact)


def padding_keeps_outputs(session: Any, spec: MaskSpec, short_feed: Mapping[str, np.ndarray],
                          long_feed: Mapping[str, np.ndarray], short_outputs: list[np.ndarray], ort: Any) -> bool:
    """Whether `short_feed`, padded on the right to `long_feed`'s length as a worker pads a merged batch
    (`padding.pad_batch`) and its outputs cut back on `spec.sequence_outputs` (`padding.unpad_outputs`),
    gives `short_outputs`, its own run's outputs (`same_values`).

    Not so for a model whose output reads a position past the row's end: a decoder's last-token logits
    (`logits[:, -1, :]`) are a pad's there. Raises what the run raises (TimeoutError after `PROBE_SECONDS`).
    """
    # A request of no rows at the longer length sets the padded length; every input keeps its own rows.
    feed, lengths = pad_batch([short_feed, {name: array[:0] for name, array in long_feed.items()}], spec)
    names = [output.name for output in session.get_outputs()]
    padded = dict(zip(names, run_within(session, feed, ort), strict=True))
    [cut] = unpad_outputs(padded, lengths[:1], [len(short_feed[spec.sequence_input])], spec)
    return all(same_values(cut[name], alone) for name, alone in zip(names, short_outputs, strict=True))


def same_values(got: np.ndarray, expected: np.ndarray) -> bool:
    """Whether two runs' outputs are the same: equal shapes, and floats within rtol 1e-3 (1e-2 below
    float32) and an atol of 1e-4 times `expected`'s largest finite magnitude (at least 1); other
    dtypes exactly. `batch_probe` compares rows with it too."""
    if got.shape != expected.shape:
        return False
    if expected.dtype.kind not in "fc":
        return bool(np.array_equal(got, expected))
    loose = expected.dtype.kind == "f" and expected.dtype.itemsize < 4
    scale = float(np.max(np.abs(expected[np.isfinite(expected)]), initial=1.0))
    return bool(np.allclose(got, expected, rtol=1e-2 if loose else 1e-3, atol=1e-4 * scale, equal_nan=True))


def probe_lengths(declared_max_sequence: int | None) -> tuple[int, int] | None:
    """The two lengths to run at: `PROBE_LENGTHS` within the model's declared limit; None under 2."""
    if declared_max_sequence is None or declared_max_sequence >= PROBE_LENGTHS[1]:
        return PROBE_LENGTHS
    if declared_max_sequence < 2:
        return None
    return declared_max_sequence - 1, declared_max_sequence


def probe_feed(signature: Mapping[str, Any], spec: MaskSpec, length: int,
               vocabulary_size: int | None) -> dict[str, np.ndarray]:
    """A feed of one row (or the model's fixed batch) at sequence `length`.

    The token input, the mask and the other inputs of `spec` get `length` on their sequence axes;
    other dynamic dims get 1. Token ids are 1 (0 for a vocabulary of one, or where 1 is the pad id, so a
    pad differs from the real tokens), the mask all ones (every token real), other inputs zeros (token
    type 0). Check `probe_feed_bytes` first: fixed dims are kept
    whatever their size.
    """
    feed: dict[str, np.ndarray] = {}
    for name, dims, dtype in _probe_shapes(signature, spec, length):
        if name == spec.sequence_input:
            feed[name] = np.full(dims, 0 if vocabulary_size == 1 or spec.pad_id == 1 else 1, dtype=dtype)
        elif name == spec.mask_input:
            feed[name] = np.ones(dims, dtype=dtype)
        else:
            feed[name] = np.zeros(dims, dtype=dtype)
    return feed


def probe_feed_bytes(signature: Mapping[str, Any], spec: MaskSpec, length: int) -> int:
    """The bytes `probe_feed` would allocate for the same arguments, counted without allocating them.

    A negative dim (numpy refuses it) counts by its size, so it cannot cancel another input's."""
    return sum(math.prod(abs(dim) for dim in dims) * dtype.itemsize
               for _, dims, dtype in _probe_shapes(signature, spec, length))


def _probe_shapes(signature: Mapping[str, Any], spec: MaskSpec,
                  length: int) -> list[tuple[str, list[int], np.dtype[Any]]]:
    """(name, dims, dtype) of each input of the probe feed at sequence `length`."""
    sequence_axes = {(spec.sequence_input, spec.axis), (spec.mask_input, 1), *spec.other_inputs}
    shapes: list[tuple[str, list[int], np.dtype[Any]]] = []
    for entry in signature.get("inputs", []):
        name, shape = entry["name"], entry["shape"] or []
        dims = [length if (name, axis) in sequence_axes and axis > 0 else dim if isinstance(dim, int) else 1
                for axis, dim in enumerate(shape)]
        shapes.append((name, dims, np.dtype(entry["dtype"])))
    return shapes


def probe_session(serialized_model: bytes, ort: Any) -> Any:
    """A cheap CPU session for runs at registration: no graph optimisation, one thread, quiet (a run
    that fails here is answered by the caller's fallback, not an error)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.log_severity_level = 4
    return ort.InferenceSession(serialized_model, sess_options=options, providers=["CPUExecutionProvider"])


def run_within(session: Any, feed: dict[str, np.ndarray], ort: Any) -> list[np.ndarray]:
    """`session.run`, stopped after `PROBE_SECONDS`: the registration request waits for it, and a Python
    exception cannot interrupt native code, but ONNX Runtime checks `terminate` between nodes.
    TimeoutError when it was stopped."""
    run_options = ort.RunOptions()
    run_options.log_severity_level = 4
    timer = threading.Timer(PROBE_SECONDS, setattr, (run_options, "terminate", True))
    timer.daemon = True
    timer.start()
    try:
        return [np.asarray(output) for output in session.run(None, feed, run_options)]
    except Exception as err:
        if run_options.terminate:
            raise TimeoutError(f"its run outlasted PROBE_SECONDS ({PROBE_SECONDS:g} s) and was stopped") from err
        raise
    finally:
        timer.cancel()
