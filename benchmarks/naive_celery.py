"""The naive baseline of benchmarks/online_serving.py: one Celery task per request, no batching, no scheduler.

What a first version of an inference service usually is: the client calls
`infer.delay(model_path, inputs).get()`, the task runs ONE request (batch 1)
on an ONNX Runtime session cached per process and returns the outputs as
lists through the Celery result backend. Broker and result backend are the
same Redis, named by `NAIVE_REDIS_URL`; `NAIVE_ORT_THREADS` sets the
session's intra-op threads (default 1, as the SITS worker in the benchmark).

    NAIVE_REDIS_URL=redis://127.0.0.1:6379/0 \
        python -m celery -A benchmarks.naive_celery worker --pool threads -c 4 --loglevel WARNING
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
from celery import Celery

REDIS_URL = os.environ.get("NAIVE_REDIS_URL", "redis://127.0.0.1:6379/0")
QUEUE = "naive"

app = Celery("naive", broker=REDIS_URL, backend=REDIS_URL)
app.conf.update(
    task_default_queue=QUEUE,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    result_expires=600,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)

_sessions: dict[str, Any] = {}
_sessions_lock = threading.Lock()


def _session(model_path: str) -> Any:
    """One ONNX Runtime session per model file per process, shared by the pool's threads."""
    session = _sessions.get(model_path)
    if session is None:
        with _sessions_lock:
            session = _sessions.get(model_path)
            if session is None:
                import onnxruntime as ort

                options = ort.SessionOptions()
                options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
                options.intra_op_num_threads = int(os.environ.get("NAIVE_ORT_THREADS", "1"))
                session = ort.InferenceSession(model_path, options, providers=["CPUExecutionProvider"])
                _sessions[model_path] = session
    return session


@app.task(name="naive.infer")
def infer(model_path: str, inputs: dict[str, list]) -> dict[str, list]:
    """Run one request (the rows it carries, usually one) and return every output as nested lists."""
    session = _session(model_path)
    feed = {name: np.asarray(value, dtype=np.float32) for name, value in inputs.items()}
    names = [output.name for output in session.get_outputs()]
    return {name: array.tolist() for name, array in zip(names, session.run(names, feed), strict=True)}
