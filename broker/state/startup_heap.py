"""Keep the objects a process made while it started out of Python's full garbage collections.

A process of SITS holds tens of thousands of objects from its imports and set-up (an API process
about 90,000) that live as long as it does. Python's full (generation 2) collection walks every one
of them while every other thread of the process waits: 23-29 ms in an idle API process on the 2-core
reference machine (docs/benchmarks.md), longer under load. A request caught in one waits that long.
`gc.freeze` moves them to a permanent generation that collections skip; later objects are collected
as before. Called once a process has started (`sits_api/wsgi.py`, the worker's
`worker_ready`), after a collection, so that no garbage is frozen with them.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect, then freeze every object tracked now; returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
