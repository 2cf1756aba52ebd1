"""A tenant swaps its job's output folder or input file for a symbolic link while the job runs, through a
real stack (API process, Redis, one worker): the job fails naming the link, and the worker writes,
renames, removes and reads nothing where the link points.

Paths are resolved and checked against the roots once, at submit; the swap comes after. The worker's
runs are slowed (`faults.run_latency`) so that the job is surely still running when the swap lands.
Each test fails on the code before workers opened folders and files without following links.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sits_api.cli.stack import Stack
from sits_worker.model.zoo import build_zoo
from tests.e2e.stack_helpers import direct_run, register, stack_settings, wait_job
from tests.file_trees import tree

ROWS, CHUNK_SIZE, BATCH_SIZE = 128, 16, 4
"""8 chunks of 4 runs, each run 50 ms longer: the job runs for 2 s or so, a swap after its first chunk
lands long before its end."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("symlinks") / "home"
    settings = stack_settings(home, streams=1).with_overrides(faults={"enabled": True, "run_latency": "50ms"})
    running = Stack(settings, worker_count=1, api_port=0).start()
    register(running.client(), "mlp", build_zoo(home / "models")["mlp"])
    yield running
    running.stop()


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder outside the stack's roots, holding another tenant's results and input."""
    folder = tmp_path / "outside"
    folder.mkdir()
    np.save(folder / "logits.npy", np.full((ROWS, 10), -1.0, np.float32))
    (folder / "quarantine.jsonl").write_text('{"row": 0, "error": "sentinel"}\n')
    np.save(folder / "secret.npy", np.full((ROWS, 64), 7.0, np.float32))
    return folder


def submit_running(stack: Stack, name: str) -> dict[str, Any]:
    """Submit a job over `ROWS` rows of its own input into `<home>/<name>-out`; return it once its first
    chunk is done (its output folder and parts exist, the worker has opened its input)."""
    path = stack.home / f"{name}-in.npy"
    np.save(path, np.random.default_rng(3).standard_normal((ROWS, 64), dtype=np.float32))
    job = stack.client().post("/v1/jobs", {"model": "mlp", "input_batch": str(path), "output_dir":
                                           str(stack.home / f"{name}-out"), "chunk_size": CHUNK_SIZE,
                                           "batch_size": BATCH_SIZE})
    return wait_job(stack.client(), job["id"], until=lambda seen: seen["chunks_done"] >= 1, timeout=60)


def swap_for_link(path: Path, target: Path) -> None:
    """Move `path` aside and put a link to `target` in its place, as the tenant that owns it can."""
    path.rename(path.with_name(path.name + ".moved"))
    path.symlink_to(target)


def still_running(stack: Stack, job_id: str) -> None:
    job = stack.client().get(f"/v1/jobs/{job_id}")
    assert job["status"] == "running" and job["chunks_done"] < ROWS // CHUNK_SIZE, (
        f"the job ended before the swap, which tests nothing (slow the runs more): {job}")


def test_an_output_folder_swapped_for_a_link_fails_the_job_and_nothing_outside_changes(
        stack: Stack, outside: Path) -> None:
    """Followed, the link made the worker write `.parts/`, `logits.npy` and `manifest.json` into the other
    folder, over its `logits.npy`, and remove its `quarantine.jsonl`."""
    before = tree(outside)
    job = submit_running(stack, "swapped-out")
    out = Path(job["output_dir"])

    swap_for_link(out, outside)
    still_running(stack, job["id"])
    final = wait_job(stack.client(), job["id"])

    assert final["status"] == "failed", final
    assert tree(outside) == before
    assert f"output folder '{out}' is a symbolic link" in final["error"], final["error"]
    assert "resume the job, or submit the job again into another output_dir" in final["error"]


def test_an_input_swapped_for_a_link_to_another_tenant_s_file_fails_the_job_unread(
        stack: Stack, outside: Path) -> None:
    job = submit_running(stack, "swapped-in")
    path, out = Path(job["input_batch"]), Path(job["output_dir"])

    swap_for_link(path, outside / "secret.npy")
    still_running(stack, job["id"])
    final = wait_job(stack.client(), job["id"])

    assert final["status"] == "failed", final
    assert f"input '{path}' is a symbolic link" in final["error"], final["error"]
    assert not (out / "logits.npy").exists() and not (out / "manifest.json").exists()
    secret_row = direct_run(Path(stack.client().get("/v1/models/mlp")["path"]),
                            np.full((1, 64), 7.0, np.float32), 1)[0]
    parts = sorted((out / ".parts" / job["id"]).glob("logits.*.npy"))
    assert parts  # the chunks done before the swap
    for part in parts:
        assert not np.isclose(np.load(part), secret_row, rtol=1e-4, atol=1e-5).all(axis=1).any(), part
