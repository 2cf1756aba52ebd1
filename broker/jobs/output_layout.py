"""Where a job's outputs lie in its output folder: file names, part paths, the manifest.

The API reads this layout (a job's manifest, which chunks already have parts, which files a new
job would replace) and the worker writes it (`sits_worker/serving/outputs.py`). It lives in `broker/`, beside
the output-folder claim, so the API needs nothing of the worker for it.
Parts: `<output_dir>/.parts/<job id>/<stem>.<chunk:06d>.npy`; merged outputs:
`<output_dir>/<stem>.npy`; `manifest.json` written last. A chunk with quarantined rows also writes
`.parts/<job id>/quarantine.<chunk:06d>.jsonl`, merged into `<output_dir>/quarantine.jsonl`.
A job with `output_format: parquet` writes one part per chunk, `.parts/<job id>/outputs.<chunk:06d>.arrow`
(an Arrow IPC file of every output and the id column), merged into `<output_dir>/outputs.parquet`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from broker.errors import StorageUnavailable

PARTS_DIR = ".parts"
MANIFEST_NAME = "manifest.json"
QUARANTINE_NAME = "quarantine.jsonl"
TABLE_OUTPUT_NAME = "outputs.parquet"
"""The one output file of a job with `output_format: parquet`."""
TABLE_ROW_COLUMN = "row"
"""The id column of `TABLE_OUTPUT_NAME` when the input names no `id_column`: the row numbers."""
_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}")


def file_stem(name: str) -> str:
    """Return the file stem for an output name.

    ONNX output names may hold '/' or ':' (e.g. "dense/Softmax:0"); such names get a sanitised stem
    made unique by a hash of the name. The manifest records the file actually used.
    """
    if _SAFE_NAME.fullmatch(name):
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:80].lstrip(".") + "-" + digest


def output_file_name(name: str) -> str:
    """The name of the file a job's output `name` is merged into: `<stem>.npy`."""
    return f"{file_stem(name)}.npy"


def output_path(output_dir: Path, name: str) -> Path:
    """The file a job's output `name` is merged into: `<output_dir>/<stem>.npy`."""
    return Path(output_dir) / output_file_name(name)


def parts_folder(output_dir: Path, job_id: str) -> Path:
    """Where `job_id`'s parts (and its merge's temp files) lie: `.parts/<job_id>/`."""
    return Path(output_dir) / PARTS_DIR / job_id


def part_name(name: str, chunk_index: int) -> str:
    """The file name of output `name`'s part of chunk `chunk_index`: `<stem>.<chunk:06d>.npy`."""
    return f"{file_stem(name)}.{chunk_index:06d}.npy"


def table_part_name(chunk_index: int) -> str:
    """The file name of chunk `chunk_index`'s part of a Parquet job's outputs: `outputs.<chunk:06d>.arrow`."""
    return f"outputs.{chunk_index:06d}.arrow"


def part_path(output_dir: Path, name: str, chunk_index: int, job_id: str = "") -> Path:
    return parts_folder(output_dir, job_id) / part_name(name, chunk_index)


def quarantine_part_name(chunk_index: int) -> str:
    """The file name of one chunk's quarantined rows (`.jsonl`, so never taken for an output part)."""
    return f"quarantine.{chunk_index:06d}.jsonl"


def quarantine_part_path(output_dir: Path, chunk_index: int, job_id: str = "") -> Path:
    """Where one chunk's quarantined rows lie until the merge."""
    return parts_folder(output_dir, job_id) / quarantine_part_name(chunk_index)


def storage_error(output_dir: Path, err: OSError) -> StorageUnavailable:
    return StorageUnavailable(
        f"writing outputs under '{output_dir}' failed ({err}); check free space and permissions there, "
        "the work will be retried"
    )


def part_exists(output_dir: Path, chunk_index: int, output_names: Sequence[str], *, job_id: str = "") -> bool:
    """Whether every output's part for this chunk is on disk.

    Parts appear atomically, so existing means complete: a worker can skip a chunk whose parts exist.
    """
    return all(part_path(Path(output_dir), name, chunk_index, job_id).is_file() for name in output_names)


def chunks_with_parts(output_dir: Path, output_names: Sequence[str], *, job_id: str = "",
                      output_format: str = "npy") -> set[int]:
    """Indexes of the chunks whose parts are all on disk, from one listing of the job's parts folder
    (a stat per part, as `part_exists` does, takes long for 100,000 chunks on a network disk); for a
    Parquet job (`output_format`), those whose one part (`table_part_name`) is."""
    try:
        present = {entry.name for entry in os.scandir(parts_folder(Path(output_dir), job_id))}
    except FileNotFoundError:
        return set()
    except OSError as err:
        raise storage_error(Path(output_dir), err) from err
    if output_format == "parquet":
        return {int(name.split(".")[1]) for name in present
                if name.startswith("outputs.") and name.endswith(".arrow") and name.split(".")[1].isdigit()}
    stems = [file_stem(name) for name in output_names]
    found = {int(name.rsplit(".", 2)[1]) for name in present
             if name.endswith(".npy") and name.count(".") >= 2 and name.rsplit(".", 2)[1].isdigit()}
    return {index for index in found if all(f"{stem}.{index:06d}.npy" in present for stem in stems)}


def read_manifest(output_dir: Path) -> dict[str, Any] | None:
    """The folder's manifest.json as a dict; None when there is none or it is unreadable."""
    try:
        return parse_manifest((output_dir / MANIFEST_NAME).read_bytes())
    except OSError:  # missing, or unreadable: merge again from the parts, if they are still there
        return None


def parse_manifest(data: bytes) -> dict[str, Any] | None:
    """A manifest.json's bytes as a dict; None when they are not a JSON object."""
    try:
        manifest = json.loads(data)
    except ValueError:
        return None
    return manifest if isinstance(manifest, dict) else None
