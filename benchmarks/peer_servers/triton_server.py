"""Triton Inference Server (through nvidia-pytriton 0.7.0) serving the zoo models, dynamic batching 32 rows / 5 ms.

    /work/pytriton-venv/bin/python triton_server.py --http-port 8000 --grpc-port 8001 \\
        --models mlp=/m/mlp.onnx,convnet=/m/convnet.onnx

pytriton needs numpy < 2, so it runs from an environment of its own (`benchmarks/peers.py`,
`--pytriton-python`). Its bundled `tritonserver` serves the KServe v2 protocol over HTTP and gRPC on
loopback; each model is one Python-backend instance whose stub hands every batch to this process, where
`@batch` concatenates the requests' rows for one `session.run`. The session has SITS's own options
(`sits_worker.device.runtime.session_options`, imported: it loads under numpy < 2), as every peer's.

The Python backend stub links against libpython, so `LD_LIBRARY_PATH` gets this interpreter's own
`lib` folder before Triton starts (pytriton passes this process's environment on to it).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import sysconfig
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402

from sits_worker.device.runtime import session_options  # noqa: E402

INTRA_OP_THREADS = 2
MAX_BATCH_SIZE = 32
MAX_QUEUE_DELAY_MICROSECONDS = 5000


def note(text: str) -> None:
    print(f"[peer {os.getpid()}] {text}", file=sys.stderr, flush=True)


def bind_model(triton: Any, name: str, path: str) -> None:
    """One ONNX model as a Triton model: one instance, `@batch` joining each dynamic batch's rows."""
    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor

    session = ort.InferenceSession(path, session_options(INTRA_OP_THREADS), providers=["CPUExecutionProvider"])
    node, output = session.get_inputs()[0], session.get_outputs()[0]

    @batch
    def infer(**inputs: np.ndarray) -> dict[str, np.ndarray]:
        return {output.name: session.run([output.name], {node.name: inputs[node.name]})[0]}

    triton.bind(model_name=name, infer_func=infer,
                inputs=[Tensor(name=node.name, dtype=np.float32, shape=tuple(int(d) for d in node.shape[1:]))],
                outputs=[Tensor(name=output.name, dtype=np.float32, shape=tuple(int(d) for d in output.shape[1:]))],
                config=ModelConfig(max_batch_size=MAX_BATCH_SIZE,
                                   batcher=DynamicBatcher(max_queue_delay_microseconds=MAX_QUEUE_DELAY_MICROSECONDS)),
                strict=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--models", required=True, help="name=path.onnx,...")
    parser.add_argument("--workspace", help="pytriton's workspace folder (default: a temporary one)")
    args = parser.parse_args()
    libdir = sysconfig.get_config_var("LIBDIR")
    os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [libdir, os.environ.get("LD_LIBRARY_PATH")]))

    from pytriton.triton import Triton, TritonConfig

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # Triton.serve stops the server and its stubs on it

    signal.signal(signal.SIGTERM, stop)
    config = TritonConfig(http_address="127.0.0.1", http_port=args.http_port, grpc_address="127.0.0.1",
                          grpc_port=args.grpc_port, allow_metrics=False, log_verbose=0)
    with Triton(config=config, workspace=args.workspace) as triton:
        for item in filter(None, args.models.split(",")):
            name, path = item.split("=", 1)
            bind_model(triton, name, path)
        note(f"triton (pytriton): HTTP 127.0.0.1:{args.http_port}, gRPC 127.0.0.1:{args.grpc_port}, one instance per"
             f" model, dynamic batching {MAX_BATCH_SIZE} rows / {MAX_QUEUE_DELAY_MICROSECONDS // 1000} ms,"
             f" onnxruntime {ort.__version__}, numpy {np.__version__}")
        triton.serve()


if __name__ == "__main__":
    main()
