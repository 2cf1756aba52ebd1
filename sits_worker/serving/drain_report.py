"""What one drain task ran, for its Celery result: Flower's task page then shows a worker's work.

A drain task runs on one pool thread from start to end, and every model run it makes (its batches, a
chunk's mini-batches, the requests riding in them, urgent batches run between them) is made on that
thread. So the task's report is the thread's while it drains (`collecting`), and the run paths note
into whatever report their thread holds (none outside a drain task: a profiling run notes nothing).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

MODELS_SHOWN = 20
"""Most model versions a report names (a result is a short text on Flower's page)."""


@dataclass
class DrainReport:
    """What a drain task ran under its ticket, and how its loop ended."""

    outcome: str = ""
    """How the drain ended: 'released', 'yield', 'stale' (`drain_loop.Outcome`), or 'error'."""
    batches: int = 0
    """Model runs: merged batches of requests, a chunk's mini-batches (with their riders), pieces of a batch
    split to find bad rows."""
    rows: int = 0
    """Rows of those runs."""
    requests: int = 0
    """Online requests that ran (alone, merged, or riding in a job's mini-batch)."""
    chunks: int = 0
    """Job chunks it took to run (a chunk's rows are in `rows` as its mini-batches run)."""
    models: set[str] = field(default_factory=set)
    """The model versions it ran ('name@version')."""

    def to_json(self) -> dict[str, Any]:
        """The report as the task's result: plain JSON types, model versions sorted."""
        return {"outcome": self.outcome, "batches": self.batches, "rows": self.rows, "requests": self.requests,
                "chunks": self.chunks, "models": sorted(self.models)[:MODELS_SHOWN]}


_local = threading.local()


@contextlib.contextmanager
def collecting(report: DrainReport) -> Iterator[DrainReport]:
    """Note this thread's runs into `report` while the block runs."""
    outer = getattr(_local, "report", None)
    _local.report = report
    try:
        yield report
    finally:
        _local.report = outer


def note_run(model_ref: str, rows: int) -> None:
    """One model run of `rows` rows on this thread."""
    report: DrainReport | None = getattr(_local, "report", None)
    if report is not None:
        report.batches += 1
        report.rows += rows
        report.models.add(model_ref)


def note_requests(count: int) -> None:
    """`count` online requests ran on this thread."""
    report: DrainReport | None = getattr(_local, "report", None)
    if report is not None:
        report.requests += count


def note_chunk() -> None:
    """A job chunk was taken to run on this thread."""
    report: DrainReport | None = getattr(_local, "report", None)
    if report is not None:
        report.chunks += 1
