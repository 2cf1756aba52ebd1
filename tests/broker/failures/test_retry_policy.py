"""The retry matrix's pure decisions (classes, waits) and fault injection's, and their settings."""

from __future__ import annotations

import errno
import random

import numpy as np
import pytest

from broker.config.settings import Settings
from broker.errors import (
    BadInput,
    Cancelled,
    ConfigError,
    ConnectionLost,
    DeviceOutOfMemory,
    FileMissing,
    InferenceTimeout,
    InvalidModel,
    StorageUnavailable,
    StoreFull,
    WorkerLost,
)
from broker.failures import faults
from broker.failures.retry_policy import backoff_seconds, classify, describe, retry_delays
from broker.failures.settings import FAILURE_CLASSES, FaultSettings, RetryPolicy


@pytest.mark.parametrize(("error", "failure_class"), [
    (WorkerLost("lease expired"), "worker_lost"),
    (ConnectionLost("Redis is unreachable"), "transient"),
    (StoreFull("Redis is full"), "transient"),
    (StorageUnavailable("EIO"), "transient"),
    (OSError(errno.EAGAIN, "Resource temporarily unavailable"), "transient"),
    (OSError(errno.EIO, "Input/output error"), "transient"),
    (OSError(errno.ENOSPC, "No space left on device"), "transient"),
    (DeviceOutOfMemory("device out of memory"), "device_oom"),
    (MemoryError(), "device_oom"),
    (InferenceTimeout("ran past its time"), "run_timeout"),
    (TimeoutError(), "run_timeout"),
    (BadInput("row 3 is bad"), "bad_input"),
    (FileMissing("no such file"), "bad_input"),
    (OSError(errno.ENOENT, "No such file or directory"), "bad_input"),
    (OSError(errno.EACCES, "Permission denied"), "bad_input"),
    (InvalidModel("cannot load"), "invalid_model"),
    (Cancelled("job stopped"), "cancelled"),
    (ZeroDivisionError("a bug"), "transient"),
])
def test_every_failure_falls_in_one_class(error: BaseException, failure_class: str) -> None:
    assert classify(error) == failure_class and failure_class in FAILURE_CLASSES


def test_the_default_matrix_is_the_specification_s() -> None:
    settings = Settings()
    no_jitter = lambda: 0.0  # noqa: E731

    assert retry_delays(settings.retry_policy("device_oom"), no_jitter) == [1.0, 4.0, 16.0]
    assert retry_delays(settings.retry_policy("run_timeout"), no_jitter) == [1.0, 4.0, 16.0]
    assert retry_delays(settings.retry_policy("worker_lost"), no_jitter) == [0.0, 0.0]  # jobs.max_attempts 3
    assert retry_delays(settings.retry_policy("transient"), lambda: 0.5) == [2.5, 2.5, 2.5]
    for never in ("bad_input", "invalid_model", "cancelled"):
        assert retry_delays(settings.retry_policy(never), no_jitter) == []


def test_jitter_is_a_drawn_share_on_top_of_the_backoff_and_seeded_draws_repeat() -> None:
    policy = RetryPolicy(attempts=5, backoff=2.0, backoff_factor=1.0, jitter=1.0)
    first = retry_delays(policy, random.Random(7).random)

    assert first == retry_delays(policy, random.Random(7).random)
    assert all(2.0 <= delay < 3.0 for delay in first) and len(set(first)) == 4
    assert backoff_seconds(RetryPolicy(backoff=0.5, backoff_factor=3.0), 3, lambda: 0.9) == 4.5
    with pytest.raises(ValueError):
        backoff_seconds(policy, 0, lambda: 0.0)


def test_worker_lost_attempts_follow_jobs_max_attempts_unless_set() -> None:
    assert Settings().with_overrides(jobs={"max_attempts": 5}).retry_policy("worker_lost").attempts == 5
    both = Settings().with_overrides(jobs={"max_attempts": 5}, retry={"worker_lost": {"attempts": 2}})
    assert both.retry_policy("worker_lost").attempts == 2


def test_a_retry_class_other_than_worker_lost_needs_its_attempts() -> None:
    with pytest.raises(ConfigError, match="retry.device_oom.attempts"):
        Settings().with_overrides(retry={"device_oom": {"attempts": None}})


def test_describe_keeps_a_sits_error_s_message_and_names_any_other_error_s_type() -> None:
    assert describe(BadInput("row 3 is bad")) == "row 3 is bad"
    assert describe(OSError(errno.EIO, "Input/output error")) == "OSError: [Errno 5] Input/output error"


def test_faults_are_refused_unless_enabled() -> None:
    with pytest.raises(ConfigError, match="faults.enabled"):
        Settings().with_overrides(faults={"oom_share": 0.1})
    with pytest.raises(ConfigError, match="fail_models"):
        Settings().with_overrides(faults={"fail_models": {"mlp": "device_oom"}})
    assert not Settings().faults.active and not Settings().with_overrides(faults={"enabled": True}).faults.active
    assert Settings().with_overrides(faults={"enabled": True, "run_latency": "5ms"}).faults.run_latency == 0.005


def test_a_fault_of_an_unknown_class_is_refused() -> None:
    with pytest.raises(ConfigError, match="fail_models"):
        Settings().with_overrides(faults={"enabled": True, "fail_models": {"mlp": "worker_lost"}})


def _faults(**values: object) -> FaultSettings:
    return FaultSettings.model_validate({"enabled": True, **values})


def test_an_oom_is_injected_above_a_batch_size_or_on_a_share_of_runs() -> None:
    above = _faults(oom_above_rows=8)
    assert faults.oom_fault(above, 8, lambda: 0.0) is None
    assert "above faults.oom_above_rows" in (faults.oom_fault(above, 9, lambda: 0.0) or "")

    share = _faults(oom_share=0.25)
    assert faults.oom_fault(share, 1, lambda: 0.2) is not None and faults.oom_fault(share, 1, lambda: 0.3) is None
    draws = random.Random(1)
    hits = sum(faults.oom_fault(share, 1, draws.random) is not None for _ in range(4000))
    assert 900 < hits < 1100


def test_failing_rows_values_and_models_are_found() -> None:
    settings = _faults(fail_rows=[3, 40], fail_values=[7.5, -1], fail_models={"mlp": "run_timeout"})

    assert faults.failing_rows(settings, np.arange(0, 32)) == [3]
    assert faults.failing_rows(settings, range(4, 32)) == []
    assert faults.failing_value(settings, {"x": np.array([[0.0, 7.5]], np.float32)}) == 7.5
    assert faults.failing_value(settings, {"ids": np.array([[-1, 2]], np.int64)}) == -1
    assert faults.failing_value(settings, {"x": np.array([[0.5]], np.float32)}) is None
    assert faults.model_fault(settings, "mlp@v3") == "run_timeout" and faults.model_fault(settings, "cnn@v1") is None
    flaky = _faults(fail_models={"mlp": "transient"}, fail_models_share=0.01)
    assert faults.model_fault(flaky, "mlp@v1", draw=lambda: 0.005) == "transient"
    assert faults.model_fault(flaky, "mlp@v1", draw=lambda: 0.5) is None
    assert faults.model_fault(flaky, "cnn@v1", draw=lambda: 0.0) is None  # (a model not named never fails)
    draws = random.Random(2)
    assert 20 < sum(faults.model_fault(flaky, "mlp@v1", draw=draws.random) is not None for _ in range(4000)) < 60
    assert faults.redis_drop_due(_faults(redis_drop_share=0.5), lambda: 0.4)
    assert not faults.redis_drop_due(settings, lambda: 0.0)
