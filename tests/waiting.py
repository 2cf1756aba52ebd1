"""Waiting for a state instead of sleeping a fixed time.

A test that waits for something another thread or process does (a lease returned, a bill written,
a slot blocked on the doorbell) asks `eventually(condition, timeout)`: it returns as soon as the
state holds, so the test is as fast as the system, and it gives up at `timeout` on a slow machine
rather than failing early.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

Value = TypeVar("Value")


def eventually(condition: Callable[[], Value], timeout: float = 3.0, interval: float = 0.005) -> Value:
    """The first truthy value `condition()` returns within `timeout` seconds, polled every `interval`;
    its last (falsy) value when the time is up. Callers assert on it: `assert eventually(...)`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)
