"""Priority scores: the sort key of a ready queue (lower is served first).

Issue 2 needs FIFO within a priority level: the key is the priority level
(0-15, higher is more urgent) first, then the enqueue time in milliseconds.
Items with equal scores are ordered by member (Redis compares them as
bytes), and chunk item ids are zero-padded, so a job's chunks wait in row
order. The key is static: nothing is re-scored because time passes
(DESIGN.md, "Order").
"""

from __future__ import annotations

MAX_PRIORITY = 15
_EPOCH = 1_704_067_200.0  # 2024-01-01T00:00:00Z; keeps scores small and exact in a double
_LEVEL_SPAN_MS = 1e14  # about 3,000 years of milliseconds per priority level


def fifo_score(priority: int, enqueued_at: float) -> float:
    """Sort key: more urgent levels first, then earlier enqueue (exact integers below 2**53)."""
    if not 0 <= priority <= MAX_PRIORITY:
        raise ValueError(f"priority must be between 0 and {MAX_PRIORITY}, got {priority}")
    return (MAX_PRIORITY - priority) * _LEVEL_SPAN_MS + float(int((enqueued_at - _EPOCH) * 1000))
