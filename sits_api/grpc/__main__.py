"""`python -m sits_api.grpc`: the KServe v2 gRPC server on `api.grpc_port` (`sitsctl up` starts it)."""

from __future__ import annotations

import asyncio
import logging
import sys

from broker.config.loading import load_settings
from broker.errors import SitsError
from sits_api.grpc.server import serve

if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        asyncio.run(serve(load_settings()))
    except SitsError as err:
        sys.exit(f"sits gRPC: {err.message}")
