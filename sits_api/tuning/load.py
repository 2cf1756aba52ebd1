"""Closed-loop load for a tuning sweep: C clients, each sending its next request when its last is answered.

Each client is a thread that sends a request, waits for its answer and sends the next (`clients.HttpSender`).
A window first lets the queue settle at the new setting and load, then counts what the clients saw;
bounded in time, and a request refused (a full queue's 429) or failed counts as refused (the point is then
no candidate).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

Send = Callable[[int], bool]
"""Sends one request for client `i` and waits for its answer: True when it was answered with outputs,
False when it failed or was refused. Raises nothing (the sweep's own faults are its to report)."""


@dataclass(frozen=True)
class Measured:
    """What the clients saw in one window."""

    concurrency: int
    answered: int
    refused: int
    seconds: float
    latencies: tuple[float, ...]
    """Seconds from submit to answer of each request answered in the window."""

    @property
    def throughput(self) -> float:
        """Requests answered a second."""
        return self.answered / self.seconds if self.seconds > 0 else 0.0

    def percentile_ms(self, q: float) -> float:
        """The `q`th percentile of the latencies, in ms (inf without any)."""
        return float(np.percentile(self.latencies, q)) * 1000 if self.latencies else float("inf")


def closed_loop(send: Send, *, concurrency: int, settle: float, seconds: float) -> Measured:
    """Run `concurrency` clients for `settle` + `seconds` and count what was answered in the last `seconds`.

    A request in flight when the window ends is not waited for beyond the window's end plus the
    longest a send may take (the intake's own wait bound): the threads are joined before returning."""
    lock = threading.Lock()
    latencies: list[float] = []
    counts = {"answered": 0, "refused": 0}
    start = time.monotonic()
    opens, closes = start + settle, start + settle + seconds

    def client(index: int) -> None:
        while (began := time.monotonic()) < closes:
            ok = send(index)
            ended = time.monotonic()
            if began >= opens and ended <= closes:
                with lock:
                    if ok:
                        counts["answered"] += 1
                        latencies.append(ended - began)
                    else:
                        counts["refused"] += 1
            if not ok:
                time.sleep(0.01)  # (a refused client backs off a moment, as a client honouring 429 would)

    threads = [threading.Thread(target=client, args=(i,), name=f"sits-tune-client-{i}", daemon=True)
               for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return Measured(concurrency, counts["answered"], counts["refused"], seconds, tuple(latencies))
