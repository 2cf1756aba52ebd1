"""The embedded stack `sitsctl up` and `sitsctl demo` run: Redis, API, beat and workers as child processes.

Every child is started by this module, its PID kept, and stopped by that
PID (never by name); logs go to `$SITS_HOME/logs/`. Workers are started as
`celery -A sits_worker worker` subprocesses, so this process never imports
the worker package or ONNX Runtime.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import yaml

from broker import workers
from broker.apikeys import create_api_key
from broker.config import Settings
from broker.embedded import EmbeddedRedis, free_port
from broker.errors import ConfigError, SitsError
from broker.store import Store
from sits_api.cli.client import ApiClient, ApiError


def worker_command(device: str, streams: int, name: str, loglevel: str = "INFO") -> tuple[list[str], dict[str, str]]:
    """argv and extra environment of a Celery worker pinned to `device` with `streams` threads."""
    argv = [sys.executable, "-m", "celery", "-A", "sits_worker", "worker", "--pool", "threads",
            "--concurrency", str(streams), "--hostname", name, "--queues", "sits", "--loglevel", loglevel,
            "--without-mingle", "--without-gossip"]
    return argv, {"SITS_WORKER_DEVICE": device, "SITS_WORKER_STREAMS": str(streams)}


API_WORKER_CLASS = "sits_api.gunicorn_worker.JsonErrorThreadWorker"
"""gunicorn's gthread worker, answering the requests gunicorn itself refuses in the API's JSON error body."""


def api_command(settings: Settings, app: str = "sits_api.wsgi:app") -> list[str]:
    """argv of the API server: gunicorn with `api.workers` processes of `api.threads` threads each.

    Several processes use every core (one Python process is held to one by the GIL), and
    gthread workers keep connections alive between requests. `app` is another WSGI app to serve
    the same way (benchmarks/rest_floor.py).
    """
    return [sys.executable, "-m", "gunicorn", app, "--bind",
            f"{settings.api.host}:{settings.api.port}", "--workers", str(settings.api.workers),
            "--worker-class", API_WORKER_CLASS, "--threads", str(settings.api.threads), "--graceful-timeout", "5",
            "--keep-alive", "30", "--log-level", "warning"]


def gpu_devices() -> list[str]:
    """'gpu:N' for every GPU NVML sees; [] without NVML or GPUs."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return [f"gpu:{i}" for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:  # no NVML library or driver: a CPU-only machine
        return []


@dataclass
class Child:
    """A process this stack started."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path


@dataclass
class Stack:
    """Redis (embedded unless `settings.redis.url` is set), the API, beat and `worker_count` workers."""

    settings: Settings
    worker_count: int = 2
    streams: int | None = None
    config_path: Path | None = None
    """Set by `start`: the effective settings written for the children."""
    api_port: int | None = None
    children: list[Child] = field(default_factory=list)
    redis: EmbeddedRedis | None = None
    api_url: str = ""
    api_key: str = ""
    _lock_file: IO[str] | None = None
    _gpus: list[str] = field(default_factory=list)

    @property
    def home(self) -> Path:
        """`paths.home` (`$SITS_HOME`)."""
        return self.settings.paths.home

    def start(self, *, wait_workers: float = 90.0) -> Stack:
        """Start everything and wait until the API answers and every worker sends heartbeats."""
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "logs").mkdir(exist_ok=True)
        self._lock_home()
        try:
            redis_url = self.settings.redis.url
            if not redis_url:
                self.redis = EmbeddedRedis(self.home / "redis", appendonly=self.settings.redis.appendonly).start()
                redis_url = self.redis.url
            port = self.api_port if self.api_port is not None else self.settings.api.port
            port = port or free_port()
            self.settings = self.settings.with_overrides(redis={"url": redis_url}, api={"port": port})
            self.store = Store.connect(redis_url, self.settings.redis.key_prefix)
            try:
                self.api_key = create_api_key(self.store, "sitsctl-up", role="admin")
            except ValueError as err:  # a user key already has the admin key's name
                raise ConfigError(f"cannot make the stack's admin key: {err}; remove that user key from the "
                                  f"Redis at {redis_url} or use another Redis") from err
            self.api_url = self.settings.api.public_url()
            self._write_client_files()
            self.config_path = self._write_effective_config()
            self._spawn("api", api_command(self.settings))
            self._wait_api()
            self._spawn("beat", [sys.executable, "-m", "celery", "-A", "sits_worker", "beat", "--loglevel", "INFO"])
            self._gpus = gpu_devices()
            for index in range(self.worker_count):
                self.start_worker(index)
            self.wait_for_workers(self.worker_count, timeout=wait_workers)
        except BaseException:
            self.stop()
            raise
        return self

    def _lock_home(self) -> None:
        """One stack per SITS_HOME: two embedded Redis servers on one AOF folder would corrupt it."""
        (self.home / "run").mkdir(exist_ok=True)
        self._lock_file = open(self.home / "run" / "stack.lock", "a+")  # noqa: SIM115 - held until stop()
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            self._lock_file = None
            raise SitsError(f"another SITS stack already runs with SITS_HOME={self.home}; stop it first, "
                            "or set SITS_HOME to another folder") from None

    def _write_effective_config(self) -> Path:
        """Write the settings this stack runs with, so every child loads exactly the same ones."""
        path = self.home / "run" / "sits-config.yaml"
        path.parent.mkdir(exist_ok=True)
        path.write_text(yaml.safe_dump(self.settings.model_dump(mode="json"), sort_keys=False))
        return path

    def _child_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            "SITS_REDIS_URL": self.settings.redis.url,
            "SITS_HOME": str(self.home),
            "SITS_API__PORT": str(self.settings.api.port),
            "SITS_API__HOST": self.settings.api.host,
            "PYTHONUNBUFFERED": "1",
        })
        if self.config_path:
            env["SITS_CONFIG"] = str(self.config_path)
        env.update(extra or {})
        return env

    def _spawn(self, name: str, argv: list[str], extra_env: dict[str, str] | None = None) -> Child:
        log_path = self.home / "logs" / f"{name}.log"
        with open(log_path, "ab") as log:
            process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                       env=self._child_env(extra_env), start_new_session=True)
        child = Child(name, process, log_path)
        self.children.append(child)
        return child

    def start_worker(self, index: int) -> Child:
        """Start worker number `index` (again, after a crash): GPUs round-robin, else the CPU."""
        device = self._gpus[index % len(self._gpus)] if self._gpus else "cpu"
        streams = self.streams or self.settings.resources.max_concurrent_streams
        argv, extra = worker_command(device, streams, f"sits{index}-{os.getpid()}@%h")
        return self._spawn(f"worker{index}", argv, extra)

    def _write_client_files(self) -> None:
        (self.home / "api-url").write_text(self.api_url + "\n")
        key_file = self.home / "api-key"
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(self.api_key + "\n")
        os.chmod(key_file, 0o600)
        (self.home / "redis-url").write_text(self.settings.redis.url + "\n")

    def client(self) -> ApiClient:
        """A client for this stack's API with its admin key."""
        return ApiClient(self.api_url, self.api_key)

    def _wait_api(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.check_children()
            try:
                self.client().get("/readyz")
                return
            except ApiError:
                if time.monotonic() > deadline:
                    log = self.home / "logs" / "api.log"
                    raise SitsError(f"the API did not start in {timeout}s; see {log}") from None
                time.sleep(0.1)

    def wait_for_workers(self, count: int, timeout: float = 90.0) -> None:
        """Wait until `count` workers are alive (heartbeats in Redis)."""
        deadline = time.monotonic() + timeout
        timeout_s = self.settings.scheduler.worker_heartbeat_timeout
        while True:
            self.check_children()
            alive = [w for w in workers.list_workers(self.store, now=time.time(), timeout=timeout_s) if w["alive"]]
            if len(alive) >= count:
                return
            if time.monotonic() > deadline:
                raise SitsError(f"only {len(alive)} of {count} workers started in {timeout}s; "
                                f"see the logs in {self.home / 'logs'}")
            time.sleep(0.2)

    def check_children(self) -> None:
        """Raise if a child exited on its own (its log tail says why)."""
        for child in self.children:
            code = child.process.poll()
            if code is not None:
                tail = child.log_path.read_text(errors="replace")[-1500:]
                raise SitsError(f"{child.name} exited with code {code}; last log lines:\n{tail}")

    def stop_child(self, name: str, *, kill: bool = False, timeout: float = 15.0) -> None:
        """Stop one child by its PID: SIGTERM (warm shutdown) or SIGKILL (a crash)."""
        for child in list(self.children):
            if child.name == name:
                _stop_process(child.process, kill=kill, timeout=timeout)
                self.children.remove(child)

    def stop(self) -> None:
        """Stop every child this stack started (workers first, Redis last), by PID."""
        for child in reversed(self.children):
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        for child in reversed(self.children):
            _stop_process(child.process, kill=False, timeout=15.0)
        self.children.clear()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        if self._lock_file is not None:
            self._lock_file.close()  # releases the flock
            self._lock_file = None

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _stop_process(process: subprocess.Popen[bytes], *, kill: bool, timeout: float) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
