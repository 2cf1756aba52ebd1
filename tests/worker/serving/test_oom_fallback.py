"""Device OOM through a real `WorkerContext` (real Redis, the zoo MLP on ONNX Runtime, injected
OOMs on the real error path): a batch is halved until it fits and its outputs are one run's, the
model's ceiling and the ledger learn from it, what never fits offloads to a CPU session (without the
device's faults) or, with `fail`, fails naming the OOM."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from broker.config.settings import Settings
from broker.errors import DeviceOutOfMemory
from broker.failures import breaker
from broker.state.store import Store
from sits_worker.serving.context import WorkerContext
from sits_worker.serving.leasing import batch_cost
from tests.worker.worker_helpers import mlp_worker_context

FEATURES = 64
MODEL = "mlp@v1"


def _ctx(store: Store, zoo_dir: Path, fallback_strategy: str = "cpu-offload-on-oom", **faults: Any) -> WorkerContext:
    return mlp_worker_context(store, zoo_dir, Settings().with_overrides(
        faults={"enabled": True, **faults}, scheduler={"fallback_strategy": fallback_strategy}))


def _feed(rows: int) -> dict[str, np.ndarray]:
    return {"features": np.random.default_rng(rows).standard_normal((rows, FEATURES)).astype(np.float32)}


def _direct(ctx: WorkerContext, feed: dict[str, np.ndarray]) -> np.ndarray:
    return ctx.session(MODEL).run(["logits"], feed)[0]


def test_an_oom_above_a_size_halves_the_batch_until_it_fits_and_the_outputs_are_one_run_s(
        store: Store, zoo_dir: Path) -> None:
    ctx = _ctx(store, zoo_dir, oom_above_rows=4)
    feed = _feed(9)

    [logits] = ctx.run(MODEL, feed, ["logits"])

    np.testing.assert_allclose(logits, _direct(ctx, feed), rtol=1e-6, atol=1e-6)
    assert ctx.ceilings.rows(MODEL, now=time.time()) == 2  # 9 failed (4), then 5 failed (2)
    assert ctx.sessions.loaded() == [MODEL] and (MODEL, "cpu-offload") not in ctx.sessions._sessions


def test_after_an_oom_the_model_s_runs_are_cut_to_its_ceiling_first(store: Store, zoo_dir: Path) -> None:
    ctx = _ctx(store, zoo_dir, oom_above_rows=4)
    ctx.run(MODEL, _feed(9), ["logits"])
    feed = _feed(7)

    with _no_oom_allowed(ctx):  # in pieces of 2 rows: no run above 4 rows, so none raises
        [logits] = ctx.run(MODEL, feed, ["logits"])

    np.testing.assert_allclose(logits, _direct(ctx, feed), rtol=1e-6, atol=1e-6)


@contextlib.contextmanager
def _no_oom_allowed(ctx: WorkerContext) -> Iterator[None]:
    """Fail the test when a run of the block runs out of memory (it lowers the ceiling)."""
    lower = ctx.ceilings.lower

    def refuse(model_ref: str, failed_rows: int, *, now: float, tokens_per_row: int | None = None) -> int:
        raise AssertionError(f"a run of {failed_rows} rows ran out of memory")

    ctx.ceilings.lower = refuse  # type: ignore[method-assign]
    try:
        yield
    finally:
        ctx.ceilings.lower = lower  # type: ignore[method-assign]


def test_the_ledger_counts_more_memory_for_the_model_after_an_oom(store: Store, zoo_dir: Path) -> None:
    ctx = _ctx(store, zoo_dir, oom_above_rows=4)
    before = batch_cost(ctx, MODEL).bytes_per_row

    ctx.run(MODEL, _feed(9), ["logits"])

    assert batch_cost(ctx, MODEL).bytes_per_row > before


def test_an_oom_at_every_size_offloads_to_a_cpu_session_without_the_fault(store: Store, zoo_dir: Path) -> None:
    ctx = _ctx(store, zoo_dir, fail_models={"mlp": "device_oom"})
    feed = _feed(8)

    [logits] = ctx.run(MODEL, feed, ["logits"])

    np.testing.assert_allclose(logits, _direct(ctx, feed), rtol=1e-6, atol=1e-6)
    assert (MODEL, "cpu-offload") in ctx.sessions._sessions
    assert ctx.sessions.offload(MODEL, zoo_dir / "mlp.onnx") is not ctx.session(MODEL)


def test_an_offloaded_batch_counts_as_a_run_that_worked(store: Store, zoo_dir: Path) -> None:
    ctx = _ctx(store, zoo_dir, fail_models={"mlp": "device_oom"})
    for _ in range(3):
        ctx.run(MODEL, _feed(4), ["logits"])

    later = time.time() + breaker.FLUSH_SECONDS
    ctx.breakers.note_run(MODEL, failed=False, now=later)  # writes the runs counted in memory
    assert breaker.window_counts(ctx.breakers.breaker(MODEL), ctx.settings.breaker, now=later) == (4, 0)
    assert ctx.breakers.may_lease(MODEL, now=time.time())


def test_with_fail_an_oom_at_one_row_fails_naming_the_oom(store: Store, zoo_dir: Path) -> None:
    ctx = _ctx(store, zoo_dir, "fail", fail_models={"mlp": "device_oom"})

    with pytest.raises(DeviceOutOfMemory, match="injected fault: every run of mlp@v1 fails"):
        ctx.run(MODEL, _feed(8), ["logits"])

    assert ctx.oom_steps == {"halve": 3, "fail": 1}  # halved 8 -> 4 -> 2 -> 1, then failed
    assert ctx.ceilings.rows(MODEL, now=time.time()) is None  # (not even one row fits: a ceiling would not help)
    assert (MODEL, "cpu-offload") not in ctx.sessions._sessions
