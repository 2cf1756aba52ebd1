"""SITS execution: the Celery app and its tasks, ONNX Runtime sessions, devices, the model zoo.

`celery -A sits_worker worker` finds the app here (`app`, built on first access). Importing this
package imports neither Celery nor ONNX Runtime, so `sits_worker.model` (static graph analysis,
input readers, the zoo) stays light enough for the API and the benchmarks to use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["app"]


def __getattr__(name: str) -> Any:
    """`sits_worker.app`: the Celery app, imported only when asked for (PEP 562)."""
    if name == "app":
        from sits_worker.celery_app import app

        return app
    raise AttributeError(f"module 'sits_worker' has no attribute {name!r}")
