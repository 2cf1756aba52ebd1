"""SITS scheduling core: all state in Redis and the decisions over it.

This package never imports onnxruntime, Flask or Celery (docs/architecture.md,
"The house"), so it can be tested on its own.
"""
