"""A job's input rewritten while the job runs fails the job: its outputs never count as done under the
checksum of the file as submitted (real Redis, a real `WorkerContext`, a real ONNX model).

The change lands at a fixed point of the work (a mini-batch, a block of the merge), through the hooks
a running item calls as it goes, so nothing here depends on timing.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import pytest

from broker.config.settings import Settings
from broker.jobs import fills as job_fills
from broker.jobs import output_layout
from broker.jobs import records as jobs
from broker.models import registry
from broker.queueing.leases import LeasedItem
from broker.state.store import Store
from sits_worker.device.pinning import Device
from sits_worker.device.runtime import SessionCache
from sits_worker.model.graph import static_profile
from sits_worker.model.source import file_identity
from sits_worker.serving import execution, outputs
from sits_worker.serving.context import WorkerContext
from sits_worker.serving.execution import process_item
from tests.leasing import lease_items

ROWS = 64


class Hooks:
    """What a running item calls as it goes (`execution.MiniBatchHook`): runs `action` at the `at`-th
    mini-batch (or call of `keep_alive`, for a merge), and keeps no lease (the tests lease for 60 s)."""

    def __init__(self, action: Callable[[], None], *, at: int) -> None:
        self.action, self.at, self.calls = action, at, 0

    def _count(self) -> None:
        self.calls += 1
        if self.calls == self.at:
            self.action()

    def __call__(self, feed: Mapping[str, np.ndarray]) -> Sequence[LeasedItem]:
        self._count()
        return []

    def keep_alive(self) -> None:
        self._count()

    def running(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def run_early(self) -> None:
        pass


def rewrite_in_place(path: Path, first_row: int) -> None:
    """Overwrite rows `first_row`.. of a 2-D float32 .npy with zeros, the file opened r+b (same size, same
    inode), and move its modification time on by a second (as a later write would, whatever the
    file system's timestamp granularity)."""
    rows = np.load(path, mmap_mode="r")
    offset = rows.offset + first_row * rows.shape[1] * rows.itemsize
    zeros = np.zeros((rows.shape[0] - first_row, rows.shape[1]), rows.dtype).tobytes()
    del rows
    before = os.stat(path)
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(zeros)
        handle.flush()
        os.fsync(handle.fileno())
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
    assert os.stat(path).st_size == before.st_size and os.stat(path).st_ino == before.st_ino


@pytest.fixture
def ctx(store: Store, zoo_dir: Path) -> WorkerContext:
    """A worker context with the zoo MLP registered."""
    model = onnx.load(str(zoo_dir / "mlp.onnx"))
    profile = static_profile(model)
    registry.save_model_version(store, {"name": "mlp", "version": "v1", "ref": "mlp@v1",
                                        "path": str(zoo_dir / "mlp.onnx"), "signature": profile["signature"],
                                        "static_profile": profile})
    return WorkerContext(settings=Settings(), store=store, device=Device("cpu"), streams=1,
                         sessions=SessionCache(Device("cpu"), 1))


def submit(store: Store, tmp_path: Path, *, chunk_size: int) -> jobs.JobSpec:
    """A job of `ROWS` rows over the MLP, batches of 16, its input's identity recorded as the API does."""
    path = tmp_path / "in.npy"
    np.save(path, np.random.default_rng(0).standard_normal((ROWS, 64), dtype=np.float32))
    spec = jobs.JobSpec(job_id=jobs.new_job_id(), model_name="mlp", model_version="v1", input_batch=str(path),
                        input_format="npy", input_checksum="sha256:0", output_dir=str(tmp_path / "out"),
                        output_names=["logits"], rows_total=ROWS, chunk_size=chunk_size, batch_size=16,
                        input_stat=file_identity(path))
    job_fills.create_job(store, spec, now=time.time())
    return spec


def run_next(ctx: WorkerContext, spec: jobs.JobSpec, hooks: Hooks) -> str:
    """Lease the job's next item and run it with `hooks`; its commit (a chunk's) is waited for."""
    [item] = lease_items(ctx.store, spec.model_ref, now=time.time(), lease_seconds=60, max_items=1)
    outcome = process_item(ctx, item, hooks)
    assert ctx.commits.wait(timeout=10)
    return outcome


def assert_failed_for_its_input(ctx: WorkerContext, spec: jobs.JobSpec) -> None:
    job = jobs.get_job(ctx.store, spec.job_id, now=time.time())
    assert job.status == "failed", job
    assert f"input '{spec.input_batch}' changed after the job was submitted" in job.error, job
    assert ctx.store.client.zcard(ctx.store.keys.inflight(spec.model_ref)) == 0
    assert ctx.store.client.zcard(ctx.store.keys.ready(spec.model_ref)) == 0


def test_a_chunk_whose_input_is_rewritten_in_place_while_it_runs_fails_its_job_and_is_not_acked(
        ctx: WorkerContext, tmp_path: Path) -> None:
    """The check before the chunk passed; the file changed while the chunk ran (its later rows may be read from
    the new bytes, where a chunk reads in several pieces). Counted as done, the job could succeed with mixed
    outputs under the old checksum."""
    spec = submit(ctx.store, tmp_path, chunk_size=ROWS)  # one chunk of four mini-batches
    hooks = Hooks(lambda: rewrite_in_place(Path(spec.input_batch), 32), at=3)  # before the 3rd mini-batch

    assert run_next(ctx, spec, hooks) == "failed"

    assert hooks.calls == 4  # the chunk ran to its end: the change was seen after its reads
    assert_failed_for_its_input(ctx, spec)
    assert jobs.get_job(ctx.store, spec.job_id, now=time.time()).chunks_done == 0
    assert not output_layout.part_exists(Path(spec.output_dir), 0, ["logits"], job_id=spec.job_id)


def test_an_input_rewritten_while_the_job_merges_fails_it_before_its_manifest_is_published(
        ctx: WorkerContext, tmp_path: Path) -> None:
    spec = submit(ctx.store, tmp_path, chunk_size=ROWS // 2)
    assert run_next(ctx, spec, Hooks(lambda: None, at=0)) == "committing"
    assert run_next(ctx, spec, Hooks(lambda: None, at=0)) == "acked"  # the last chunk: its slot waits for it
    hooks = Hooks(lambda: rewrite_in_place(Path(spec.input_batch), 0), at=1)  # after the merge's first block

    assert run_next(ctx, spec, hooks) == "failed"

    assert_failed_for_its_input(ctx, spec)
    output_dir = Path(spec.output_dir)
    assert not (output_dir / outputs.MANIFEST_NAME).exists()
    assert not (output_dir / "logits.npy").exists()  # no merged output without its manifest either
    assert sorted(path.name for path in (output_dir / outputs.PARTS_DIR / spec.job_id).iterdir()) == [
        "logits.000000.npy", "logits.000001.npy"]  # only the parts: the merge's temp file is gone


# --- paths swapped for symbolic links ---------------------------------------------------------


def tree(folder: Path) -> dict[str, bytes | None]:
    """Every path under `folder` (relative) with its bytes; None for a folder."""
    return {str(path.relative_to(folder)): None if path.is_dir() else path.read_bytes()
            for path in sorted(folder.rglob("*"))}


def another_tenants_file(tmp_path: Path) -> Path:
    """A file of the same shape the job's tenant may not read."""
    path = tmp_path / "other-tenant" / "secret.npy"
    path.parent.mkdir()
    np.save(path, np.full((ROWS, 64), 7.0, np.float32))
    return path


def test_an_input_that_is_a_link_to_another_file_only_while_the_chunk_opens_it_is_not_read(
        ctx: WorkerContext, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The race around the checks: the path is the submitted file when it is checked before the chunk,
    a link to another tenant's file when the worker opens it, and the submitted file again when it is
    checked after the rows were read. Opened by path, the chunk would read the other file's rows and
    commit them under the job's checksum; the file opened must be the one submitted."""
    spec = submit(ctx.store, tmp_path, chunk_size=ROWS)
    path, aside, secret = Path(spec.input_batch), tmp_path / "in.aside.npy", another_tenants_file(tmp_path)
    check_unchanged, checks = execution.check_unchanged, []

    def check_then_swap(input_path: Path, identity: dict[str, int] | None) -> None:
        if checks:  # after the rows were read: the submitted file is back
            path.unlink()
            aside.rename(path)
        check_unchanged(input_path, identity)
        if not checks:
            path.rename(aside)
            path.symlink_to(secret)
        checks.append(input_path)

    monkeypatch.setattr(execution, "check_unchanged", check_then_swap)

    assert run_next(ctx, spec, Hooks(lambda: None, at=0)) == "failed"

    job = jobs.get_job(ctx.store, spec.job_id, now=time.time())
    assert job.status == "failed" and f"input '{path}' is a symbolic link" in job.error, job
    assert not output_layout.part_exists(Path(spec.output_dir), 0, ["logits"], job_id=spec.job_id)


def test_an_input_swapped_for_a_link_fails_its_job_at_the_next_chunk_naming_the_link(
        ctx: WorkerContext, tmp_path: Path) -> None:
    """Even a link to the submitted file itself, moved out of the roots: workers read nothing through a link."""
    spec = submit(ctx.store, tmp_path, chunk_size=ROWS // 2)
    assert run_next(ctx, spec, Hooks(lambda: None, at=0)) == "committing"
    path = Path(spec.input_batch)
    path.rename(tmp_path / "moved-out.npy")
    path.symlink_to(tmp_path / "moved-out.npy")

    assert run_next(ctx, spec, Hooks(lambda: None, at=0)) == "failed"

    job = jobs.get_job(ctx.store, spec.job_id, now=time.time())
    assert job.status == "failed" and f"input '{path}' is a symbolic link" in job.error, job
    assert "put the submitted file back at that path and resume the job" in job.error
    assert job.chunks_done == 1


def test_an_output_folder_swapped_for_a_link_fails_its_job_and_nothing_is_written_where_it_points(
        ctx: WorkerContext, tmp_path: Path) -> None:
    spec = submit(ctx.store, tmp_path, chunk_size=ROWS // 2)
    assert run_next(ctx, spec, Hooks(lambda: None, at=0)) == "committing"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "logits.npy").write_bytes(b"sentinel")
    before = tree(outside)
    out = Path(spec.output_dir)
    out.rename(tmp_path / "out.moved")
    out.symlink_to(outside)

    assert run_next(ctx, spec, Hooks(lambda: None, at=0)) == "failed"  # the last chunk: its commit is waited for

    job = jobs.get_job(ctx.store, spec.job_id, now=time.time())
    assert job.status == "failed" and f"output folder '{out}' is a symbolic link" in job.error, job
    assert job.retries["bad_input"]["attempts"] == 1  # permanent: not retried
    assert tree(outside) == before
