"""The retry matrix's decisions: which class a failure falls in, and how long each retry waits.

Pure functions, the clock and the random draw passed in: the random draw is passed in, so
tests and the worker's seeded runs get the same waits. `broker/failures/retries.py` carries a decision out
in Redis; docs/failures.md describes the classes and their defaults.
"""

from __future__ import annotations

import errno
from collections.abc import Callable

from broker.errors import SitsError
from broker.failures.settings import FAILURE_CLASSES, RetryPolicy

TRANSIENT_ERRNOS = frozenset({errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR, errno.EIO, errno.EBUSY, errno.ENOSPC,
                              errno.EDQUOT, errno.ETIMEDOUT, errno.ESTALE})
"""File system errors that may pass: busy, interrupted, a disk error, the disk (or quota) full, a stale
network mount."""

PERMANENT_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM, errno.EROFS})
"""File system errors that trying again cannot mend: a file or folder missing, or not allowed."""


def classify(err: BaseException) -> str:
    """The failure class of `err` (one of `FAILURE_CLASSES`).

    A SITS error names its own (`SitsError.failure_class`). A file system error is bad input when
    trying again cannot mend it (`PERMANENT_ERRNOS`: a file missing, or not allowed), else transient
    (`TRANSIENT_ERRNOS` and the rest), as is any error of unknown kind: a crash of unknown cause was
    always retried, and its attempts still bound it. A Python `MemoryError` is out of memory on a
    CPU device, a `TimeoutError` a run past its time.
    """
    if isinstance(err, SitsError):
        return err.failure_class if err.failure_class in FAILURE_CLASSES else "transient"
    if isinstance(err, MemoryError):
        return "device_oom"
    if isinstance(err, TimeoutError):
        return "run_timeout"
    if isinstance(err, OSError) and err.errno in PERMANENT_ERRNOS:
        return "bad_input"
    return "transient"


def backoff_seconds(policy: RetryPolicy, retry: int, draw: Callable[[], float]) -> float:
    """How long the `retry`-th retry (1 for the first) waits: `backoff` x `backoff_factor`^(retry-1),
    plus `jitter` x `draw()` (a number in [0, 1))."""
    if retry < 1:
        raise ValueError(f"retry {retry} is not a retry number (1 is the first)")
    return policy.backoff * policy.backoff_factor ** (retry - 1) + policy.jitter * draw()


def retry_delays(policy: RetryPolicy, draw: Callable[[], float]) -> list[float]:
    """The wait before each retry the policy allows, in order (`attempts` - 1 of them; none when the
    class is never retried). `draw` is called once per retry."""
    attempts = policy.attempts or 1
    return [backoff_seconds(policy, retry, draw) for retry in range(1, attempts)]


def describe(err: BaseException) -> str:
    """What a failure record shows of `err`: its message, after its type for an error of unknown kind."""
    if isinstance(err, SitsError):
        return err.message
    return f"{type(err).__name__}: {err}"
