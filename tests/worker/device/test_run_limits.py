"""Runs past `scheduler.run_time_limit` are stopped inside ONNX Runtime and fail as `run_timeout`
(real Redis, a real `WorkerContext`, real ONNX Runtime runs of the zoo convnet)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest

from broker.config.settings import Settings
from broker.errors import InferenceTimeout
from broker.failures.retry_policy import classify
from broker.models import registry
from broker.state.store import Store
from sits_worker.device.pinning import Device
from sits_worker.device.run_limits import RunLimits, RunWatch
from sits_worker.device.runtime import SessionCache, build_session, run_session
from sits_worker.model.graph import static_profile
from sits_worker.serving.context import WorkerContext
from tests.onnx_models import fixed_batch_model


def _convnet_context(store: Store, zoo_dir: Path, limit: str) -> WorkerContext:
    path = zoo_dir / "convnet.onnx"
    profile = static_profile(onnx.load(str(path)))
    registry.save_model_version(store, {"name": "convnet", "version": "v1", "ref": "convnet@v1", "path": str(path),
                                        "signature": profile["signature"], "static_profile": profile})
    return WorkerContext(settings=Settings().with_overrides(scheduler={"run_time_limit": limit}), store=store,
                         device=Device("cpu"), streams=1, sessions=SessionCache(Device("cpu"), 1))


def test_a_run_past_its_limit_is_flagged_and_a_run_within_it_is_not() -> None:
    limits = RunLimits(2.0)
    with limits.watch() as slow, limits.watch() as fresh:
        assert slow is not None and fresh is not None
        fresh.started = slow.started + 1.5
        assert limits.stop_overdue(slow.started + 1.9) == 0
        assert limits.stop_overdue(slow.started + 2.1) == 1
        assert slow.timed_out and slow.options.terminate and not fresh.options.terminate
    with RunLimits(0).watch() as unlimited:
        assert unlimited is None  # (no limit: no options, no thread)


def test_a_long_run_is_stopped_mid_run_as_a_run_timeout_and_the_session_runs_on(store: Store, zoo_dir: Path) -> None:
    ctx = _convnet_context(store, zoo_dir, "0.2s")
    pixels = np.random.default_rng(0).standard_normal((2000, 3, 32, 32)).astype(np.float32)
    ctx.run("convnet@v1", {"pixels": pixels[:8]}, ["logits"])  # load and warm the session
    limited, ctx.run_limits = ctx.run_limits, RunLimits(0)
    started = time.monotonic()
    ctx.run("convnet@v1", {"pixels": pixels}, ["logits"])  # how long the whole batch takes here
    whole = time.monotonic() - started
    ctx.run_limits = limited

    started = time.monotonic()
    with pytest.raises(InferenceTimeout, match=r"a run of 2000 rows passed scheduler.run_time_limit \(0.2s\)") as err:
        ctx.run("convnet@v1", {"pixels": pixels}, ["logits"])
    stopped_after = time.monotonic() - started

    assert classify(err.value) == "run_timeout"
    assert whole > 0.6 and stopped_after < 0.75 * whole, (whole, stopped_after)  # stopped at a node, mid-run
    assert ctx.run("convnet@v1", {"pixels": pixels[:8]}, ["logits"])[0].shape == (8, 10)


class _CountedLimits(RunLimits):
    """Real run limits that count the runs they watch."""

    def __init__(self, limit_seconds: float) -> None:
        super().__init__(limit_seconds)
        self.watched = 0

    @contextlib.contextmanager
    def watch(self) -> Iterator[RunWatch | None]:
        self.watched += 1
        with super().watch() as run:
            yield run


def test_a_fixed_batch_model_s_pieces_are_each_a_run_under_the_limit(tmp_path: Path) -> None:
    """A batch of 10 rows on a model fixed at 4 rows a run is three `session.run`s: the limit is each one's,
    so a long batch of quick pieces is not stopped for their sum."""
    session = build_session(fixed_batch_model(tmp_path / "fixed.onnx", 4), Device("cpu"), 1)
    a = np.arange(30, dtype=np.float32).reshape(10, 3)
    limits = _CountedLimits(60.0)

    total, _ = run_session(session, {"a": a, "b": a}, ["total", "product"], limits=limits)

    assert limits.watched == 3
    np.testing.assert_array_equal(total, a + a)
