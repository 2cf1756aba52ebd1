"""Padding token requests of different lengths into one batch, and cutting the results back.

A token model that declares an attention mask in its metadata (`sits.attention_mask = <input>`,
optionally `sits.pad_token_id = <id>`, default 0) gives the same outputs for a row padded on the right
as for the row alone. Such requests are grouped by length class (`bucket_length`), so one batch
wastes little compute on padding; the worker pads them (`pad_batch`), never the client, runs the
batch once and cuts every request's outputs back to its own rows and length (`unpad_outputs`).
A model without a declared mask gets no padding: its requests keep exact-shape buckets.

Pure numpy, no onnxruntime: the API imports this module to bucket requests at submit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from broker.errors import BadInput, InvalidModel

MASK_INPUT_KEY = "sits.attention_mask"
PAD_TOKEN_KEY = "sits.pad_token_id"
DEFAULT_PAD_TOKEN_ID = 0
MAX_SEQUENCE_KEY = "sits.max_sequence"
DEFAULT_MAX_SEQUENCE = 512
# Static profile key, set at registration (`sequence_probe`): [output, axis] pairs whose size followed the
# sequence length when the model ran; absent where the model was not run (`mask_spec` then matches names).
SEQUENCE_OUTPUTS_KEY = "sequence_outputs"
PADDING_EXACT_KEY = "padding_exact"
"""Static profile key: False when registration saw padding change a row's outputs (a model that
reads the last position): such a model is never padded (`MaskSpec.pads`), its requests merge only
at equal lengths."""


class MaskSpec(NamedTuple):
    """How to pad one model's requests; built from its static profile by `mask_spec`.

    `sequence_input` is padded with `pad_id` along `axis`; `other_inputs` ((name, axis) pairs: inputs
    besides the mask that carry the same sequence dim, e.g. token type ids) are padded with 0; the
    mask is padded with 0. `sequence_outputs` ((name, axis) pairs, an output once per such axis) are
    the outputs that carry the sequence dim, cut back to each request's length.
    """

    mask_input: str
    pad_id: int
    sequence_input: str
    axis: int
    mask_dtype: str = "int64"
    other_inputs: tuple[tuple[str, int], ...] = ()
    sequence_outputs: tuple[tuple[str, int], ...] = ()
    pads: bool = True
    """False when registration saw padding change the model's outputs (`PADDING_EXACT_KEY`): its
    requests merge only at their exact length, so nothing is ever padded; a mask a client leaves out
    is still built (all ones)."""


def bucket_length(length: int, max_sequence: int, *, granularity: int = 8, classes_per_octave: int = 4) -> int:
    """The padded length of a sequence's length class: at least `length`, at most `max_sequence`.

    Classes are multiples of `granularity` while that step is below a `classes_per_octave`-th of the
    length, then `classes_per_octave` per doubling (defaults: 8, 16, ..., 64, 80, 96, 112, 128, 160,
    ..., 448, 512). Geometric classes keep the share of padding bounded whatever the length: padding
    is below `granularity` tokens, or below 1/(classes_per_octave + 1) (20 %) of the padded length,
    while their count grows only with log(max_sequence), so requests still share buckets. Every
    class is a multiple of `granularity` (friendly to GPU kernels) and powers of two are classes.
    A length of `max_sequence` or more is its own class: nothing is padded past the model's limit,
    and over-long requests are left to fail on their own.
    """
    if length < 1:
        raise ValueError(f"sequence length must be >= 1, got {length}")
    if granularity < 1 or granularity & (granularity - 1) or classes_per_octave < 1 or (
            classes_per_octave & (classes_per_octave - 1)):
        # Powers of two make every step divide the next octave's start, so classes stay monotone.
        raise ValueError(f"granularity ({granularity}) and classes_per_octave ({classes_per_octave}) "
                         f"must be powers of two")
    octave_start = 1 << (length.bit_length() - 1)
    step = max(granularity, octave_start // classes_per_octave)
    padded = -(-length // step) * step
    return min(padded, max(max_sequence, length))


def mask_spec(static_profile: Mapping[str, Any] | None) -> MaskSpec | None:
    """The padding spec of a model from its registry record's `static_profile`; None without a mask.

    The mask input comes from the metadata (`sits.attention_mask`), the pad id from
    `sits.pad_token_id`, the sequence input and axis from the profile's `sequence_axis` (or, when
    that names the mask itself, the first other input with a dynamic axis). Other inputs carry the
    sequence axis when their dim has the sequence input's dim name. The outputs that carry it are
    the ones registration saw follow the sequence length when it ran the model
    (`SEQUENCE_OUTPUTS_KEY`, from `sequence_probe`): exporters name output dims their own way
    (`Mullast_hidden_state_dim_1`) or not at all. Where the model was not run (too large for the
    API to load, no onnxruntime there, a run that failed, or a record registered before the probe
    existed), outputs are matched by the sequence input's dim name, and an output dim named
    otherwise or unnamed is not cut back.
    """
    profile = static_profile or {}
    metadata = profile.get("metadata") or {}
    mask_input = metadata.get(MASK_INPUT_KEY)
    if not mask_input:
        return None
    signature = profile.get("signature") or {}
    inputs = {entry["name"]: entry for entry in signature.get("inputs", [])}
    try:
        pad_id = int(metadata.get(PAD_TOKEN_KEY, DEFAULT_PAD_TOKEN_ID))
    except ValueError as err:
        raise InvalidModel(f"metadata {PAD_TOKEN_KEY}={metadata[PAD_TOKEN_KEY]!r} is not an integer; "
                           f"re-export the model with an integer pad token id") from err
    sequence = _token_axis(profile)
    mask_entry = inputs.get(mask_input)
    if sequence is None or mask_entry is None or len(mask_entry["shape"] or []) != 2:
        raise InvalidModel(f"metadata {MASK_INPUT_KEY}={mask_input!r} needs a [batch, sequence] input of that "
                           f"name and a token input with a dynamic sequence axis; fix the model's metadata")
    name, axis = sequence
    label = inputs[name]["shape"][axis]

    def carrying(entries: Sequence[dict[str, Any]], skip: set[str]) -> tuple[tuple[str, int], ...]:
        return tuple((entry["name"], index) for entry in entries if entry["name"] not in skip
                     for index, dim in enumerate(entry["shape"] or []) if index > 0 and dim == label)

    named = isinstance(label, str) and label != "?"  # an unnamed dim cannot be matched by name
    observed = profile.get(SEQUENCE_OUTPUTS_KEY)
    if observed is not None:
        sequence_outputs = tuple((str(output), int(index)) for output, index in observed)
    else:
        sequence_outputs = carrying(signature.get("outputs", []), set()) if named else ()
    return MaskSpec(
        mask_input=mask_input, pad_id=pad_id, sequence_input=name, axis=axis, mask_dtype=mask_entry["dtype"],
        other_inputs=carrying(list(inputs.values()), {name, mask_input}) if named else (),
        sequence_outputs=sequence_outputs, pads=profile.get(PADDING_EXACT_KEY) is not False,
    )


def _token_axis(profile: Mapping[str, Any]) -> tuple[str, int] | None:
    """(input, axis) of the model's token sequence: the profile's `sequence_axis`, unless that names the
    declared attention mask (records profiled before `graph.sequence_axis` passed over a mask listed
    first): then the first other input with a dynamic axis after the batch axis."""
    sequence = profile.get("sequence_axis")
    if not sequence:
        return None
    mask_input = (profile.get("metadata") or {}).get(MASK_INPUT_KEY)
    if sequence["input"] != mask_input:
        return str(sequence["input"]), int(sequence["axis"])
    inputs = (profile.get("signature") or {}).get("inputs", [])
    return next(((entry["name"], axis) for entry in inputs if entry["name"] != mask_input
                 for axis in entry.get("dynamic_axes", []) if axis > 0), None)


class TokenLimits(NamedTuple):
    """What every row of a token model must keep to, with or without an attention mask: the length
    it declares (`sits.max_sequence`) and, for an input known to hold token ids, ids in its
    vocabulary (`graph.vocabulary_size`, where known).

    An int input with a dynamic sequence axis need not hold token ids (a series of counts or deltas
    may well be negative), so ids are checked only where there is evidence they are ids: the input
    indexes an embedding table (`vocabulary_size` is known), or the model's `sits.*` metadata
    declares it a token model (`declared_token_ids`: an attention mask or a pad token id).
    """

    token_input: str
    axis: int
    max_sequence: int | None = None
    vocabulary_size: int | None = None
    declared_token_ids: bool = False

    @property
    def holds_token_ids(self) -> bool:
        """Whether `token_input` is known to hold token ids, so ids are checked."""
        return self.vocabulary_size is not None or self.declared_token_ids

    def check(self, tensors: Mapping[str, np.ndarray], model: str | None = None) -> None:
        """BadInput for a sequence that is too long or, in token ids, one that is negative or past the
        vocabulary."""
        tokens = tensors.get(self.token_input)
        if tokens is None:
            return
        check_sequence_length(int(tokens.shape[self.axis]), self.max_sequence, model)
        if self.holds_token_ids:
            check_token_ids(tokens, self.token_input, self.vocabulary_size)


def token_limits(static_profile: Mapping[str, Any] | None) -> TokenLimits | None:
    """The `TokenLimits` of a model from its static profile; None for a model without a sequence axis."""
    profile = static_profile or {}
    if not profile.get("sequence_axis"):
        return None
    token = _token_axis(profile)
    if token is None:
        return None
    metadata = profile.get("metadata") or {}
    declared = bool(metadata.get(MASK_INPUT_KEY)) or PAD_TOKEN_KEY in metadata
    vocabulary = profile.get("vocabulary_size") if profile["sequence_axis"].get("input") == token[0] else None
    return TokenLimits(token[0], token[1], declared_max_sequence(profile), vocabulary, declared)


def max_sequence(static_profile: Mapping[str, Any] | None) -> int:
    """The longest sequence a token model takes (metadata `sits.max_sequence`, default 512)."""
    return declared_max_sequence(static_profile) or DEFAULT_MAX_SEQUENCE


def declared_max_sequence(static_profile: Mapping[str, Any] | None) -> int | None:
    """The model's own `sits.max_sequence` (a limit rows are checked against), or None."""
    value = ((static_profile or {}).get("metadata") or {}).get(MAX_SEQUENCE_KEY)
    return int(value) if value else None


def check_sequence_length(length: int, declared: int | None, model: str | None = None) -> None:
    """BadInput when a row's sequence is empty, or longer than the model declares it takes."""
    if length < 1:
        raise BadInput("the input's sequence is empty (0 tokens); send at least one token per row")
    if declared is not None and length > declared:
        which = f"model {model!r}" if model else "the model"
        raise BadInput(f"the input's sequence is {length} tokens long, more than {which} takes "
                       f"({MAX_SEQUENCE_KEY} = {declared}); split or truncate it")


def shape_bucket(tensors: Mapping[str, np.ndarray], mask: MaskSpec | None,
                 longest: int) -> tuple[str, int | None]:
    """The shape bucket rows must share to run in one batch, and the padded length of token rows.

    Exact per-row shapes, except for a model with an attention mask: there the sequence axis is
    replaced by its length class (`bucket_length`, at most `longest`), so rows of nearby lengths
    share a batch and the worker pads them to the longest. The API buckets every request with it
    at submit, and a worker buckets a job's mini-batch with it to find requests that can ride in
    that very batch: one function, so the two always agree.
    """
    if mask is None:
        exact = ";".join(f"{name}:{'x'.join(map(str, array.shape[1:]))}" for name, array in sorted(tensors.items()))
        return exact, None
    length = sequence_length(tensors, mask)
    padded = bucket_length(length, longest) if mask.pads else length  # (no padding: the exact length)
    axes = {mask.sequence_input: mask.axis, **dict(mask.other_inputs)}
    parts = []
    for name, array in sorted(tensors.items()):
        if name == mask.mask_input:
            continue  # rows with and without a client-sent mask pad alike
        dims = [f"~{padded}" if axis == axes.get(name) else str(dim) for axis, dim in enumerate(array.shape)]
        parts.append(f"{name}:{'x'.join(dims[1:])}")
    return ";".join(parts), padded


def check_mask(tensors: Mapping[str, np.ndarray], spec: MaskSpec) -> None:
    """Raise BadInput unless a client-sent mask has the shape of the sequence input (rows, length) and
    holds only 0 and 1, and every other input that carries the sequence is as long as the ids.

    The mask says which tokens of those very rows are real, so anything else is a client error
    that must be caught at submit, not when the worker pads a merged batch. (Token ids and lengths:
    `TokenLimits`.)
    """
    mask, tokens = tensors.get(spec.mask_input), tensors[spec.sequence_input]
    length = tokens.shape[spec.axis]
    for name, axis in spec.other_inputs:  # token type ids, position ids: padded along with the ids
        other = tensors.get(name)
        if other is not None and (other.ndim <= axis or other.shape[axis] != length):
            raise BadInput(f"input '{name}' has shape {list(other.shape)}, but '{spec.sequence_input}' holds "
                           f"{length} tokens per row; send one '{name}' value per token")
    if mask is not None and mask.shape != tokens.shape:
        raise BadInput(f"input '{spec.mask_input}' has shape {list(mask.shape)} but '{spec.sequence_input}' has "
                       f"{list(tokens.shape)}; send one mask value per token, or leave the mask out")
    if mask is not None and mask.size and not ((mask == 0) | (mask == 1)).all():  # (np.isin: 7x the time)
        raise BadInput(f"input '{spec.mask_input}' holds values other than 0 and 1; a mask says which tokens are "
                       "real (1) and which are padding (0)")


def check_token_ids(tokens: np.ndarray, name: str, vocabulary_size: int | None) -> None:
    """BadInput for a negative token id (ONNX's Gather would read it from the end of the embedding
    table) or, when the vocabulary size is known, one past its end (ONNX Runtime's error then)."""
    if tokens.dtype.kind not in "iu" or not tokens.size:
        return
    if tokens.dtype.kind == "i" and tokens.min() < 0:
        raise BadInput(f"input '{name}' holds a negative token id ({int(tokens.min())}); token ids start at 0")
    if vocabulary_size is not None and tokens.max() >= vocabulary_size:
        raise BadInput(f"input '{name}' holds token id {int(tokens.max())}, but the model's vocabulary has "
                       f"{vocabulary_size} ids (0 to {vocabulary_size - 1}); check the tokenizer matches the model")


def sequence_length(tensors: Mapping[str, np.ndarray], spec: MaskSpec) -> int:
    """A request's own sequence length: its sequence input's size along the sequence axis."""
    return int(tensors[spec.sequence_input].shape[spec.axis])


def _pad_to(array: np.ndarray, axis: int, length: int, value: int) -> np.ndarray:
    missing = length - array.shape[axis]
    if missing == 0:
        return array
    widths = [(0, 0)] * array.ndim
    widths[axis] = (0, missing)
    return np.pad(array, widths, constant_values=value)


def pad_batch(per_request_tensors: Sequence[Mapping[str, np.ndarray]],
              spec: MaskSpec) -> tuple[dict[str, np.ndarray], list[int]]:
    """One feed for requests of different lengths, padded on the right; returns (feed, lengths).

    Every request is padded to the longest one: the sequence input with the pad id, the other
    sequence inputs and the mask with 0. A request without a mask gets ones over its own tokens; a
    client-sent mask is kept as it is (its zeros stay zeros). Right padding leaves each real token's
    position unchanged, so with the mask the outputs equal those of each request alone. `lengths`
    is every request's own length, for `unpad_outputs`.
    """
    lengths = [sequence_length(tensors, spec) for tensors in per_request_tensors]
    longest = max(lengths)
    fills = {spec.sequence_input: (spec.axis, spec.pad_id), spec.mask_input: (spec.axis, 0),
             **{name: (axis, 0) for name, axis in spec.other_inputs}}
    names = [*per_request_tensors[0]]
    if spec.mask_input not in names:
        names.append(spec.mask_input)
    columns: dict[str, list[np.ndarray]] = {name: [] for name in names}
    for tensors in per_request_tensors:  # each checked already: requests at submit, job rows when read
        tokens = tensors[spec.sequence_input]
        for name in names:
            array = tensors.get(name)
            if array is None and name == spec.mask_input:
                array = np.ones(tokens.shape, dtype=spec.mask_dtype)
            elif array is None:
                raise BadInput(f"a request of the batch lacks input '{name}'; every request needs the same inputs")
            axis, value = fills.get(name, (None, 0))
            columns[name].append(array if axis is None else _pad_to(array, axis, longest, value))
    return {name: np.concatenate(arrays) for name, arrays in columns.items()}, lengths


def unpad_outputs(outputs: Mapping[str, np.ndarray], lengths: Sequence[int], rows_per_request: Sequence[int],
                  spec: MaskSpec) -> list[dict[str, np.ndarray]]:
    """Split a padded batch's outputs back per request, in order, as if each had run alone.

    Each request gets its own rows of every output; outputs that carry the sequence axis
    (`spec.sequence_outputs`) are also cut to the request's own length, dropping the padded
    positions. Pooled outputs (no sequence axis) need no cut: the model pools real tokens only.
    """
    cut: dict[str, list[int]] = {}
    for name, axis in spec.sequence_outputs:  # an output may carry it twice ([batch, heads, seq, seq])
        cut.setdefault(name, []).append(axis)
    per_request: list[dict[str, np.ndarray]] = []
    start = 0
    for length, rows in zip(lengths, rows_per_request, strict=True):
        own: dict[str, np.ndarray] = {}
        for name, array in outputs.items():
            part = array[start : start + rows]
            if name in cut:
                index = [slice(None)] * part.ndim
                for axis in cut[name]:
                    index[axis] = slice(0, length)
                part = part[tuple(index)]
            own[name] = part
        per_request.append(own)
        start += rows
    return per_request
