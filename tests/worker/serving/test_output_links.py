"""An output folder, its `.parts/`, its job's parts folder or a file in it swapped for a symbolic link:
parts, merge and cleanup refuse it, and nothing where the link points is written, renamed or removed."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from broker.errors import PathNotAllowed
from sits_worker.serving.outputs import finalize_outputs, remove_parts, write_part
from tests.file_trees import tree

EXTRA = {"job": "j1", "model": "mlp", "model_version": "v1", "input_batch": "in.npy", "input_checksum": "sha256:0"}
CHUNKS = [(0, 4), (4, 8)]


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder out of the tenant's reach, holding what a job's outputs would replace or remove."""
    folder = tmp_path / "outside"
    (folder / ".parts" / "j1").mkdir(parents=True)
    (folder / "logits.npy").write_bytes(b"sentinel logits")
    (folder / "quarantine.jsonl").write_bytes(b'{"row": 0, "error": "sentinel"}\n')
    (folder / ".parts" / "j1" / "logits.000000.npy").write_bytes(b"sentinel part")
    return folder


def rows(chunk: tuple[int, int]) -> dict[str, np.ndarray]:
    return {"logits": np.arange(*chunk, dtype=np.float32).reshape(-1, 1)}


def write_all(out: Path) -> None:
    for index, chunk in enumerate(CHUNKS):
        write_part(out, index, rows(chunk), job_id="j1")


def swap_for_link(path: Path, target: Path) -> None:
    """Move `path` aside and put a link to `target` in its place, as a tenant can in its own folder."""
    path.rename(path.with_name(path.name + ".moved"))
    path.symlink_to(target)


@pytest.mark.parametrize("swapped", ["out", "out/.parts", "out/.parts/j1"])
def test_a_part_is_not_written_through_a_swapped_folder(tmp_path: Path, outside: Path, swapped: str) -> None:
    write_all(tmp_path / "out")
    before = tree(outside)
    target = {"out": outside, "out/.parts": outside / ".parts", "out/.parts/j1": outside / ".parts" / "j1"}[swapped]
    swap_for_link(tmp_path / swapped, target)

    with pytest.raises(PathNotAllowed, match=f"'{tmp_path / swapped}'.* a symbolic link") as refused:
        write_part(tmp_path / "out", 1, rows(CHUNKS[1]), job_id="j1", quarantined=[(5, "bad row")])

    assert "resume the job, or submit the job again into another output_dir" in refused.value.message
    assert tree(outside) == before


def test_a_merge_into_a_swapped_folder_publishes_nothing_there(tmp_path: Path, outside: Path) -> None:
    write_all(tmp_path / "out")
    before = tree(outside)
    swap_for_link(tmp_path / "out", outside)

    with pytest.raises(PathNotAllowed, match="is a symbolic link"):
        finalize_outputs(tmp_path / "out", CHUNKS, ["logits"], EXTRA, job_id="j1")

    assert tree(outside) == before


@pytest.mark.parametrize("linked", ["logits.npy", "quarantine.jsonl", "manifest.json"])
def test_a_merge_whose_output_file_is_a_link_publishes_nothing(tmp_path: Path, outside: Path, linked: str) -> None:
    """A rename over a link would replace the link only; the job fails all the same, before any rename, so
    the folder holds no output of a job that did not finish."""
    out = tmp_path / "out"
    write_all(out)
    (out / linked).symlink_to(outside / ("quarantine.jsonl" if linked == "quarantine.jsonl" else "logits.npy"))
    before, parts = tree(outside), tree(out / ".parts")

    with pytest.raises(PathNotAllowed, match=f"'{out / linked}' in output folder '{out}' is a symbolic link"):
        finalize_outputs(out, CHUNKS, ["logits"], EXTRA, job_id="j1")

    assert tree(outside) == before
    assert sorted(path.name for path in out.iterdir()) == [".parts", linked]  # no output, no manifest
    assert tree(out / ".parts") == parts  # the parts, and no temp file of the merge


def test_removing_parts_through_a_swapped_folder_removes_nothing_there(tmp_path: Path, outside: Path) -> None:
    write_all(tmp_path / "out")
    finalize_outputs(tmp_path / "out", CHUNKS, ["logits"], EXTRA, job_id="j1")
    before = tree(outside)
    swap_for_link(tmp_path / "out" / ".parts" / "j1", outside / ".parts" / "j1")

    remove_parts(tmp_path / "out", job_id="j1")
    shutil.rmtree(tmp_path / "out" / ".parts" / "j1.moved")
    swap_for_link(tmp_path / "out", outside)
    remove_parts(tmp_path / "out", job_id="j1")

    assert tree(outside) == before
