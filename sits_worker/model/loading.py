"""Loading an ONNX file safely: inside the model roots, external data inside its folder, checked.

The API process loads every upload through here before anything is stored or profiled, so it
imports only `onnx` (no onnxruntime), and every onnx/protobuf/OS exception becomes a SITS error.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

import onnx
from onnx import TensorProto
from onnx.external_data_helper import ExternalDataInfo, load_external_data_for_model, uses_external_data

from broker.errors import FileMissing, InvalidModel, PathNotAllowed, PayloadTooLarge
from broker.models.settings import MAX_SERIALIZED_BYTES
from sits_worker.model.safe_files import Folder, open_folder


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or path.is_relative_to(folder)


def _all_tensors(graph: onnx.GraphProto) -> Iterator[TensorProto]:
    """Every TensorProto a graph holds: initializers and attribute tensors, subgraphs included."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            if attribute.HasField("g"):
                yield from _all_tensors(attribute.g)
            for subgraph in attribute.graphs:
                yield from _all_tensors(subgraph)


MAX_MODEL_BYTES = MAX_SERIALIZED_BYTES


def _check_external_data(model: onnx.ModelProto, model_file: Path, max_bytes: int, *,
                         opened_folder: Path | None = None) -> None:
    """Every external data file must exist inside the model's own folder (no `../`, no symlink escape),
    and the model with its data must fit `MAX_MODEL_BYTES` and `max_bytes`: told from the files' sizes,
    before any data is read into the process. `opened_folder` is where the folder is looked at: the
    folder opened without following links (`/proc/self/fd/N`), where the caller holds it open."""
    folder = model_file.parent
    looked_at = (opened_folder or folder).resolve()
    data_bytes = 0
    for tensor in _all_tensors(model.graph):
        if not uses_external_data(tensor):
            continue
        info = ExternalDataInfo(tensor)
        location = info.location
        try:
            target: Path | None = (looked_at / location).resolve()
        except (OSError, ValueError):  # NUL bytes, symlink loops
            target = None
        if target is None or not location or Path(location).is_absolute() or not _inside(target, looked_at):
            raise InvalidModel(
                f"external data '{location}' of tensor '{tensor.name}' points outside the model folder "
                f"{folder} in {model_file.name}; store the data file next to the model and reference it "
                f"by a relative name")
        if not target.is_file():
            what = ("is a directory, not a data file" if target.is_dir() else
                    "is not a regular file" if target.exists() else f"does not exist in {folder}")
            raise InvalidModel(
                f"external data '{location}' of tensor '{tensor.name}' in {model_file.name} {what}; "
                f"copy the data file next to the model and reference it by its name")
        data_bytes += info.length if info.length else max(target.stat().st_size - (info.offset or 0), 0)
    if data_bytes + model.ByteSize() > MAX_MODEL_BYTES:
        raise InvalidModel(f"{model_file.name} holds {data_bytes + model.ByteSize():,} bytes with its external data, "
                           f"more than the {MAX_MODEL_BYTES:,} one ONNX message can be serialized to (protobuf's "
                           f"2 GB); SITS cannot register models of over 2 GB yet")
    total = data_bytes + (looked_at / model_file.name).stat().st_size
    if total > max_bytes:
        raise PayloadTooLarge(f"{model_file.name} and its external data hold {total:,} "
                              f"bytes, more than models.max_file_size ({max_bytes:,}); nothing of it was read "
                              "beyond the graph: register a smaller model, or raise models.max_file_size")


def load_model_checked(path: Path, model_roots: Sequence[Path], *, max_bytes: int = MAX_MODEL_BYTES
                       ) -> onnx.ModelProto:
    """Load an ONNX file that lies inside `model_roots`, after checking it is safe and well formed.

    A file over `max_bytes` (`models.max_file_size`) is refused (PayloadTooLarge) from its size alone,
    before a byte of it is read; the same limit holds for the file with its external data.

    The path is resolved (symlinks included) and checked against the roots
    before its existence is reported, so callers cannot probe for files
    outside the roots. External data locations are checked before any of
    them is read.
    """
    resolved = Path(path).resolve()
    roots = [Path(root).resolve() for root in model_roots]
    if not any(_inside(resolved, root) for root in roots):
        allowed = ", ".join(str(root) for root in roots) or "(none configured)"
        raise PathNotAllowed(f"model path {path} is outside the model roots {allowed} (or leads there through a "
                             f"symbolic link); place the model under one of them")
    # The file and its folder are read from here on through descriptors opened without following a link
    # (the folder held open, as `/proc/self/fd/N`): a folder swapped for a link since the check above
    # (another tenant's) is refused, never read.
    try:
        folder = open_folder(resolved.parent, what="model", fix=MODEL_FIX)
    except OSError as err:
        raise FileMissing(f"model file {path} does not exist; check the path or upload the model first") from err
    with folder:
        return _load_opened(folder, resolved, path, max_bytes)


MODEL_FIX = "give the path of the model file itself, in a real folder"
"""What to do about a model path found to lead through a symbolic link (`safe_files.symlink_found`)."""


def _load_opened(folder: Folder, resolved: Path, path: Path, max_bytes: int) -> onnx.ModelProto:
    """`load_model_checked` past its roots check: the model in the folder held open as `folder`."""
    pinned = Path(f"/proc/self/fd/{folder.fd}")
    try:
        handle = folder.read_file(resolved.name)
    except PathNotAllowed:
        raise
    except OSError as err:
        what = "is not a file" if folder.is_folder(resolved.name) else "does not exist"
        raise FileMissing(f"model file {path} {what}; check the path or upload the model first") from err
    with handle:
        status = os.fstat(handle.fileno())
        if not stat.S_ISREG(status.st_mode):
            raise FileMissing(f"model file {path} is not a file; check the path or upload the model first")
        if status.st_size > max_bytes:
            raise PayloadTooLarge(f"model file {path} holds {status.st_size:,} bytes, more than models.max_file_size "
                                  f"({max_bytes:,}); it was not read: register a smaller model, or raise "
                                  "models.max_file_size")
        try:
            model = onnx.load_model_from_string(handle.read())  # (no external data loaded yet: that comes below)
        except Exception as err:  # onnx/protobuf raise many unrelated types for a bad file
            raise InvalidModel(f"{resolved.name} is not a readable ONNX model ({err}); "
                               f"re-export it as an ONNX ModelProto file") from err
    _check_external_data(model, resolved, max_bytes, opened_folder=pinned)
    resolved = pinned / resolved.name  # (the checker and the external data: read in the folder held open)
    try:
        # By path, so the checker resolves external data next to the model (not the cwd)
        # and never needs the weights in memory (ModelProtos over 2 GB cannot be checked there).
        # full_check adds strict type and shape inference: a graph whose types clash (Add of float
        # and int64, a declared type or shape the ops cannot produce) never loads in ONNX Runtime.
        onnx.checker.check_model(str(resolved), full_check=True)
    except Exception as err:  # ValidationError, InferenceError, and ValueError/TypeError from the C++ binding
        raise InvalidModel(f"{resolved.name} fails the ONNX checker: {first_line(err)}; "
                           f"fix or re-export the model") from err
    try:
        load_external_data_for_model(model, str(resolved.parent))
    except (OSError, ValueError) as err:
        raise InvalidModel(f"could not read the external data of {resolved.name} ({err}); "
                           f"check that the data files are complete") from err
    for tensor in _all_tensors(model.graph):
        # Loading leaves data_location=DEFAULT set explicitly; clear it so the same weights
        # serialise identically (and get the same version) whether they came inline or external.
        tensor.ClearField("data_location")
    return model


def first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
