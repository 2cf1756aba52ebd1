"""`python -m sits_api serve`: the API in one process on werkzeug's server (`sitsctl up` runs gunicorn)."""

from __future__ import annotations

import logging
import sys

from werkzeug.serving import make_server

from broker.config.loading import load_settings
from sits_api.app import create_app


def serve() -> None:
    """Serve the API on `api.host:api.port` with one thread per request until SIGTERM/SIGINT."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no access-log line per request in api.log
    settings = load_settings()
    server = make_server(settings.api.host, settings.api.port, create_app(settings), threaded=True)
    print(f"SITS API listening on http://{settings.api.host}:{server.server_port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    if sys.argv[1:] != ["serve"]:
        sys.exit("usage: python -m sits_api serve")
    import signal

    def _stop(*_: object) -> None:
        raise KeyboardInterrupt  # SIGTERM from `sitsctl up`: leave serve_forever and close the socket

    signal.signal(signal.SIGTERM, _stop)
    serve()
