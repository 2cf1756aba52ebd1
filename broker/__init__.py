"""SITS scheduling core: all state in Redis and the decisions over it.

This package never imports onnxruntime, Flask or Celery (see DESIGN.md,
"The three packages and one rule"), so it can be tested on its own.
"""
