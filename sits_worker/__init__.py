"""SITS execution: the Celery app and its tasks, ONNX Runtime sessions, devices, the model zoo.

`celery -A sits_worker worker` finds the app here. Importing this package
does not import onnxruntime; `sits_worker.model` (static graph analysis and
the zoo) is light enough for the API to use.
"""

from sits_worker.celery_app import app

__all__ = ["app"]
