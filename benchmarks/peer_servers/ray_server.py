"""Ray Serve 2.60 serving the zoo models: one application per model, one replica each, `@serve.batch`
(32 rows / 5 ms), on a local Ray started here (2 CPUs, no dashboard) with its own temp folder.

    python ray_server.py --port 8000 --temp-dir /tmp/rayXYZ --models mlp=/m/mlp.onnx,convnet=/m/convnet.onnx

Routes `/<model>`: JSON `{"inputs": [[...]]}`, or raw float32 rows with `Content-Type:
application/octet-stream`, answered in kind. Each replica takes up to 256 requests at once
(`max_ongoing_requests`; Ray's default of 5 would cap every batch at 5 rows). Serve logs at WARNING
without access logs, as quiet as the other servers. Everything else is Serve's default: its HTTP proxy
actor in front, calling the replica as an actor (`RAY_SERVE_PROXY_USE_GRPC=1`, not used, served about
a third more MLP requests in one short trial on 2 cores). SIGTERM or SIGINT shuts
Serve and Ray down (`serve.shutdown`, `ray.shutdown`), which stops every Ray process this script started.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import ray  # noqa: E402
from _common import (  # noqa: E402
    BINARY,
    MAX_BATCH_SIZE,
    MAX_WAIT_SECONDS,
    ROOT,
    encode,
    exit_on_sigterm,
    note,
    parse_models,
)
from ray import serve  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import Response  # noqa: E402

MAX_ONGOING_REQUESTS = 256
LOGGING = {"log_level": "WARNING", "enable_access_log": False}
"""As quiet as the other servers (log level warning, no line per request): Serve's default writes an
access log line per request from both the proxy and the replica."""


@serve.deployment(num_replicas=1, max_ongoing_requests=MAX_ONGOING_REQUESTS, ray_actor_options={"num_cpus": 1},
                  logging_config=LOGGING)
class OnnxDeployment:
    def __init__(self, path: str) -> None:
        from _common import Model  # in the replica's process

        self.model = Model(path)

    @serve.batch(max_batch_size=MAX_BATCH_SIZE, batch_wait_timeout_s=MAX_WAIT_SECONDS)
    async def run(self, arrays: list) -> list:
        return self.model.run_many(arrays)

    async def __call__(self, request: Request) -> Response:
        binary = request.headers.get("content-type", "") == BINARY
        array = self.model.decode(await request.body(), binary)
        output = await self.run(array)
        return Response(encode(output, binary), media_type=BINARY if binary else "application/json")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--temp-dir", required=True)
    parser.add_argument("--models", required=True)
    args = parser.parse_args()
    path = os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=args.temp_dir, log_to_driver=False,
             object_store_memory=512 * 1024 * 1024, runtime_env={"env_vars": {"PYTHONPATH": path}})
    exit_on_sigterm()  # after ray.init, which installs its own SIGTERM handler (it exits without a shutdown)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port}, logging_config=LOGGING)
        for name, model_path in parse_models(args.models).items():
            serve.run(OnnxDeployment.bind(model_path), name=name,  # type: ignore[attr-defined]
                      route_prefix=f"/{name}")
        note(f"ray serve on 127.0.0.1:{args.port}: {list(parse_models(args.models))}")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


if __name__ == "__main__":
    main()
