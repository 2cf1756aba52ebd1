"""What every peer server shares: the ONNX Runtime session SITS would build, and the wire formats.

The session options are SITS's own (`sits_worker.device.runtime.session_options`): full graph optimisation,
2 intra-op threads, a 100 us intra-op spin. Importing them (rather than copying them) keeps every peer
on exactly the worker's settings. Bodies: JSON `{"inputs": [[...]]}` answered by `{"outputs": [[...]]}`,
or raw little-endian float32 rows (`application/octet-stream`) answered by the raw float32 outputs.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import orjson

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sits_worker.device.runtime import session_options  # noqa: E402

dumps, loads = orjson.dumps, orjson.loads  # SITS's own JSON library (sits_api/http/jsonio.py), a SITS dependency

INTRA_OP_THREADS = 2
MAX_BATCH_SIZE = 32
MAX_WAIT_SECONDS = 0.005
BINARY = "application/octet-stream"
JSON_PREFIX = b'{"inputs":'
"""How every JSON body the benchmark sends starts (mosec's worker sees the body only, not its headers)."""


class Model:
    """One ONNX model on one CPU session with SITS's options; `run` takes a batch of rows."""

    def __init__(self, path: str | Path) -> None:
        self.session = ort.InferenceSession(str(path), session_options(INTRA_OP_THREADS),
                                            providers=["CPUExecutionProvider"])
        node = self.session.get_inputs()[0]
        self.input_name = node.name
        self.row_shape = tuple(int(dim) for dim in node.shape[1:])
        self.output_name = self.session.get_outputs()[0].name

    def run(self, batch: np.ndarray) -> np.ndarray:
        return self.session.run([self.output_name], {self.input_name: batch})[0]

    def run_many(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """One session run over every request's rows, cut back per request."""
        if len(arrays) == 1:
            return [self.run(arrays[0])]
        outputs = self.run(np.concatenate(arrays))
        bounds = np.cumsum([len(array) for array in arrays])[:-1]
        return list(np.split(outputs, bounds))

    def decode(self, body: bytes, binary: bool) -> np.ndarray:
        if binary:
            return np.frombuffer(body, dtype="<f4").reshape(-1, *self.row_shape)
        return np.asarray(loads(body)["inputs"], dtype=np.float32).reshape(-1, *self.row_shape)


def encode(outputs: np.ndarray, binary: bool) -> bytes:
    if binary:
        return np.ascontiguousarray(outputs, dtype="<f4").tobytes()
    return dumps({"outputs": outputs.tolist()})


def parse_models(text: str) -> dict[str, str]:
    """`mlp=/path/mlp.onnx,convnet=/path/convnet.onnx` -> {name: path}."""
    return dict(item.split("=", 1) for item in text.split(",") if item)


def exit_on_sigterm() -> None:
    """SIGTERM raises KeyboardInterrupt in the main thread, so each server's own Ctrl-C shutdown runs."""
    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def note(text: str) -> None:
    print(f"[peer {os.getpid()}] {text}", file=sys.stderr, flush=True)
