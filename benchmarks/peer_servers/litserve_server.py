"""LitServe 0.2.19 serving the zoo models: one LitAPI (one inference worker process) per model, dynamic
batching 32 rows / 5 ms, LitServe's default API servers (uvicorn processes) in front.

    python litserve_server.py --port 8000 --models mlp=/m/mlp.onnx,convnet=/m/convnet.onnx

Routes `/<model>`, JSON only: `{"inputs": [[...]]}` answered by `{"outputs": [[...]]}`. LitServe 0.2.19
hands `decode_request` what `await request.json()` (or a form) gives (`BaseRequestHandler._prepare_request`),
and the request crosses to the worker process through a queue, so a raw binary body cannot reach it:
the binary format is not run here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import litserve as ls  # noqa: E402
import numpy as np  # noqa: E402
from _common import MAX_BATCH_SIZE, MAX_WAIT_SECONDS, Model, exit_on_sigterm, note, parse_models  # noqa: E402


class OnnxAPI(ls.LitAPI):
    """One model; `batch` keeps the requests' arrays apart, `predict` runs them as one session run."""

    def __init__(self, name: str, path: str) -> None:
        super().__init__(max_batch_size=MAX_BATCH_SIZE, batch_timeout=MAX_WAIT_SECONDS, api_path=f"/{name}")
        self.path = path

    def setup(self, device: Any) -> None:
        self.model = Model(self.path)

    def decode_request(self, request, **kwargs: Any) -> np.ndarray:  # unannotated: LitServe passes the JSON body
        return np.asarray(request["inputs"], dtype=np.float32).reshape(-1, *self.model.row_shape)

    def batch(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        return list(inputs)

    def predict(self, x: list[np.ndarray], **kwargs: Any) -> list[np.ndarray]:
        return self.model.run_many(x)

    def unbatch(self, output: list[np.ndarray]) -> list[np.ndarray]:
        return output

    def encode_response(self, output: np.ndarray, **kwargs: Any) -> dict[str, Any]:
        return {"outputs": output.tolist()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--models", required=True)
    args = parser.parse_args()
    exit_on_sigterm()
    apis = [OnnxAPI(name, path) for name, path in parse_models(args.models).items()]
    server = ls.LitServer(apis, accelerator="cpu", devices=1, workers_per_device=1, timeout=30)
    note(f"litserve on 127.0.0.1:{args.port}: {[api.api_path for api in apis]}")
    server.run(host="127.0.0.1", port=args.port, generate_client_file=False, log_level="warning")


if __name__ == "__main__":
    main()
