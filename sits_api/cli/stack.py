"""The embedded stack `sitsctl up` and `sitsctl demo` run: Redis, the API and workers as child processes.

Every child is started by this module, its PID kept, and stopped by that
PID (never by name); logs go to `$SITS_HOME/logs/`. Workers are started as
`celery -A sits_worker worker` subprocesses, so this process runs no model and
imports no ONNX Runtime: which GPUs a worker can use is asked in a subprocess
(`sits_api/cli/devices.py`). `supervise` restarts a child that exits
on its own, within a restart budget; the embedded Redis exiting stops all.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import importlib.util
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import yaml

from broker.config.settings import Settings
from broker.errors import ConfigError, SitsError
from broker.queueing import workers
from broker.state.embedded import EmbeddedRedis, free_port, make_private_folder, masked_url, write_private_file
from broker.state.store import Store
from broker.tenants.apikeys import create_api_key
from sits_api.cli.client import ApiClient, ApiError, stack_lock
from sits_api.cli.processes import Child, RestartBudget, describe_exit, stop_process, wait_for_exit


def worker_command(device: str, streams: int, name: str, queue: str, loglevel: str = "INFO"
                   ) -> tuple[list[str], dict[str, str]]:
    """argv and extra environment of a Celery worker pinned to `device` with `streams` threads, taking
    the tasks of Celery queue `queue` (`redis.task_queue`)."""
    argv = [sys.executable, "-m", "celery", "-A", "sits_worker", "worker", "--pool", "threads",
            "--concurrency", str(streams), "--hostname", name, "--queues", queue, "--loglevel", loglevel,
            "--without-mingle", "--without-gossip"]
    return argv, {"SITS_WORKER_DEVICE": device, "SITS_WORKER_STREAMS": str(streams)}


BEAT_SCHEDULER = "sits_worker.beat.scheduler:SlotScheduler"
"""SITS's beat scheduler (`celery -A sits_worker beat -S ...`): the schedules live in Redis."""


def beat_command(loglevel: str = "INFO") -> list[str]:
    """argv of the beat, as users run it: `celery -A sits_worker beat -S <SITS's scheduler>`."""
    return [sys.executable, "-m", "celery", "-A", "sits_worker", "beat", "-S", BEAT_SCHEDULER, "--loglevel", loglevel]


def releaser_command(settings: Settings, name: str, loglevel: str = "INFO") -> list[str]:
    """argv of a releaser: a Celery worker of the API package's app taking the beat's release tasks
    (`sits_api/schedules/runner.py`) from their own queue, `beat.release_threads` at once."""
    return [sys.executable, "-m", "celery", "-A", "sits_api.schedules.runner", "worker", "--pool", "threads",
            "--concurrency", str(settings.beat.release_threads), "--hostname", name, "--queues",
            settings.beat.queue(settings.redis.key_prefix), "--loglevel", loglevel, "--without-mingle",
            "--without-gossip"]


API_WORKER_CLASS = "sits_api.http.gunicorn_worker.JsonErrorThreadWorker"
"""gunicorn's gthread worker, answering the requests gunicorn itself refuses in the API's JSON error body."""


def api_command(settings: Settings, app: str = "sits_api.wsgi:app") -> list[str]:
    """argv of the API server (`api.server`): `api.workers` processes of `api.threads` request threads each.

    Several processes use every core (one Python process is held to one by the GIL); both servers
    keep connections alive between requests. `app` is another WSGI app to serve the same way
    (benchmarks/rest_floor.py).
    """
    api = settings.api
    if api.server == "granian":
        if importlib.util.find_spec("granian") is None:
            raise ConfigError("api.server is granian, which is not installed: pip install 'sits[granian]', "
                              "or set api.server to gunicorn")
        return [sys.executable, "-m", "granian", "--interface", "wsgi", app, "--host", api.host,
                "--port", str(api.port), "--workers", str(api.workers), "--blocking-threads", str(api.threads),
                "--runtime-mode", "st", "--no-ws", "--log-level", "warning", "--workers-kill-timeout", "5"]
    return [sys.executable, "-m", "gunicorn", app, "--bind", f"{api.host}:{api.port}", "--workers",
            str(api.workers), "--worker-class", API_WORKER_CLASS, "--threads", str(api.threads),
            "--graceful-timeout", "5", "--keep-alive", "30", "--log-level", "warning"]


def grpc_command() -> list[str]:
    """argv of the KServe v2 gRPC server (`sits_api.grpc`) on `api.grpc_port`, one asyncio process."""
    return [sys.executable, "-m", "sits_api.grpc"]


def gpu_devices() -> list[str]:
    """'gpu:N' for every GPU a worker can run on: CUDA sees it (NVML's GPUs, after CUDA_VISIBLE_DEVICES,
    numbered as CUDA numbers them) and ONNX Runtime has the CUDA provider.

    [] on a CPU-only machine, and with a CPU-only ONNX Runtime (a worker pinned to a GPU there is
    refused). Asked of the worker package in a subprocess (`sits_api/cli/devices.py`).
    """
    from sits_api.cli.devices import usable_gpus

    return usable_gpus()


@dataclass
class Stack:
    """Redis (embedded unless `settings.redis.url` is set), the API and `worker_count` workers; with `beat`,
    the beat and a releaser, which release the schedules (`sitsctl up` starts them).

    Nothing else in SITS needs a clock of its own: aging lives in the static sort key, PSA jumps run
    before every batch choice, `PUT /v1/policy` re-scores in its own request, and each worker runs the
    reaper pass on a thread (`sits_worker/upkeep/reaper.py`).
    """

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
    restart_budget: RestartBudget = field(default_factory=RestartBudget)
    beat: bool = False
    """Start the beat and a releaser (`start_beat`)."""
    _lock_file: IO[str] | None = None
    _gpus: list[str] = field(default_factory=list)

    @property
    def home(self) -> Path:
        """`paths.home` (`$SITS_HOME`)."""
        return self.settings.paths.home

    def start(self, *, wait_workers: float = 90.0) -> Stack:
        """Start everything and wait until the API answers and every worker sends heartbeats.

        Children are started from the calling thread, which must be the main thread for them to be
        stopped when this process dies (`processes.py`). `$SITS_HOME` is made (or tightened to) 0700:
        it holds the admin key and the Redis password.
        """
        make_private_folder(self.home)
        (self.home / "logs").mkdir(exist_ok=True)
        self._lock_home()
        try:
            port = self.api_port if self.api_port is not None else self.settings.api.port
            grpc_port = self.settings.api.grpc_port
            if port:  # a busy port is refused before anything starts
                _check_port_free(self.settings.api.host, port)
                if grpc_port:
                    _check_port_free(self.settings.api.host, grpc_port, "api.grpc_port (0 runs no gRPC server), "
                                     "or --port 0, which picks free ports for both servers")
            redis_url = self.settings.redis.url
            if not redis_url:
                self.redis = EmbeddedRedis(self.home / "redis", appendonly=self.settings.redis.appendonly,
                                           maxmemory=self.settings.redis.maxmemory,
                                           bind=self.settings.redis.bind, port=self.settings.redis.port or None).start()
                redis_url = self.redis.url
            if grpc_port and not port:  # --port 0: free ports for both servers (stacks side by side, as in tests)
                grpc_port = free_port(self.settings.api.host)
            port = port or free_port(self.settings.api.host)  # (after Redis took its own free port)
            self.settings = self.settings.with_overrides(redis={"url": redis_url},
                                                         api={"port": port, "grpc_port": grpc_port})
            self.store = Store.of(self.settings.redis)
            try:
                self.api_key = create_api_key(self.store, "sitsctl-up", role="admin")
            except ValueError as err:  # a user key already has the admin key's name
                raise ConfigError(f"cannot make the stack's admin key: {err}; remove that user key from the "
                                  f"Redis at {masked_url(redis_url)} or use another Redis") from err
            self.api_url = self.settings.api.public_url()
            self.config_path = self._write_effective_config()
            self._spawn("api", api_command(self.settings))
            if grpc_port:
                self._spawn("grpc", grpc_command())
            self._gpus = gpu_devices()
            for index in range(self.worker_count):  # (they need only Redis: they boot while the API does,
                self.start_worker(index)  # which halves a stack's start; any failure below stops them too)
            if self.beat:
                self.start_beat()
            self._wait_api()
            self._wait_grpc()
            self._write_client_files()  # only once the API answering is this stack's
            self.wait_for_workers(self.worker_count, timeout=wait_workers)
        except BaseException:
            self.stop()
            raise
        return self

    def _lock_home(self) -> None:
        """One stack per SITS_HOME: two embedded Redis servers on one AOF folder would corrupt it."""
        (self.home / "run").mkdir(exist_ok=True)
        self._lock_file = open(stack_lock(self.home), "a+")  # noqa: SIM115 - held until stop()
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            self._lock_file = None
            raise SitsError(f"another SITS stack already runs with SITS_HOME={self.home}; stop it first, "
                            "or set SITS_HOME to another folder") from None

    def _write_effective_config(self) -> Path:
        """Write the settings this stack runs with, so every child loads exactly the same ones (0600: its
        Redis URL carries the password)."""
        path = self.home / "run" / "sits-config.yaml"
        path.parent.mkdir(exist_ok=True)
        write_private_file(path, yaml.safe_dump(self.settings.model_dump(mode="json"), sort_keys=False))
        return path

    def _child_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            "SITS_REDIS_URL": self.settings.redis.url,
            "SITS_HOME": str(self.home),
            "SITS_API__PORT": str(self.settings.api.port),
            "SITS_API__HOST": self.settings.api.host,
            "SITS_API__GRPC_PORT": str(self.settings.api.grpc_port),
            "PYTHONUNBUFFERED": "1",
        })
        if self.config_path:
            env["SITS_CONFIG"] = str(self.config_path)
        env.update(extra or {})
        return env

    def _spawn(self, name: str, argv: list[str], extra_env: dict[str, str] | None = None) -> Child:
        child = Child.start(name, argv, self._child_env(extra_env), self.home / "logs" / f"{name}.log")
        self.children.append(child)
        return child

    def start_worker(self, index: int, *, launcher: Sequence[str] = ()) -> Child:
        """Start worker number `index`: GPUs round-robin, else the CPU (`supervise` restarts it after a crash).

        `launcher` is a command the worker runs under, such as `ip netns exec NAME` (it must exec the
        worker in its own process, so that the PID kept is the worker's).
        """
        device = self._gpus[index % len(self._gpus)] if self._gpus else "cpu"
        streams = self.streams or self.settings.resources.max_concurrent_streams
        argv, extra = worker_command(device, streams, f"sits{index}-{os.getpid()}@%h", self.settings.redis.task_queue)
        return self._spawn(f"worker{index}", [*launcher, *argv], extra)

    def start_beat(self, name: str = "beat") -> Child:
        """Start the beat as child `name`, and a releaser with it unless one runs (`supervise` restarts
        both); a second beat started so waits for the first's turn (docs/schedules.md)."""
        if not any(child.name == "releaser" for child in self.children):
            self._spawn("releaser", releaser_command(self.settings, f"releaser-{os.getpid()}@%h"))
        return self._spawn(name, beat_command())

    def _write_client_files(self) -> None:
        (self.home / "api-url").write_text(self.api_url + "\n")
        write_private_file(self.home / "api-key", self.api_key + "\n")
        write_private_file(self.home / "redis-url", self.settings.redis.url + "\n")  # it carries the password

    def _remove_client_files(self) -> None:
        """Forget the URLs this stack wrote: once it stops, a later command must say that no stack runs
        rather than reach whatever server takes those ports next."""
        for name, ours in (("api-url", self.api_url), ("redis-url", self.settings.redis.url)):
            path = self.home / name
            with contextlib.suppress(OSError):
                if ours and path.read_text().strip() == ours:
                    path.unlink()

    def client(self) -> ApiClient:
        """A client for this stack's API with its admin key."""
        return ApiClient(self.api_url, self.api_key)

    def _wait_api(self, timeout: float = 30.0) -> None:
        """Wait until this stack's API answers: with the stack's own key and Redis, not just any server
        that took the port meanwhile. The API shows the Redis URL with its password masked, and so it is
        compared (the port still tells one Redis from another)."""
        deadline = time.monotonic() + timeout
        while True:
            self.check_children()
            try:
                self.client().get("/readyz")
                break
            except ApiError:
                if time.monotonic() > deadline:
                    log = self.home / "logs" / "api.log"
                    raise SitsError(f"the API did not start in {timeout}s; see {log}") from None
                time.sleep(0.1)
        try:
            answered = self.client().get("/v1/status").get("redis_url")
        except ApiError as err:
            answered = f"an error ({err.message})"
        if answered != masked_url(self.settings.redis.url):
            shown = masked_url(answered) if isinstance(answered, str) else answered  # (whoever's it is)
            raise SitsError(f"another server answers on {self.api_url} (it answered {shown!r} where this "
                            f"stack's API names its Redis): choose a free port with --port (0 picks one)")

    def _wait_grpc(self, timeout: float = 30.0) -> None:
        """Wait until the gRPC server (if one runs) accepts connections on `api.grpc_port` (checked free
        before it started, so what listens there is this stack's)."""
        address = self.settings.api.grpc_address()
        if not address:
            return
        deadline = time.monotonic() + timeout
        while True:
            self.check_children()
            try:
                socket.create_connection((self.settings.api.host, self.settings.api.grpc_port), timeout=1.0).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise SitsError(f"the gRPC server did not listen on {address} in {timeout}s; see "
                                    f"{self.home / 'logs' / 'grpc.log'}") from None
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
        """Raise if a child (or the embedded Redis) exited on its own, as while starting (its log tail says why)."""
        self._check_redis()
        for child in self.children:
            code = child.process.poll()
            if code is not None:
                raise SitsError(f"{child.name} exited with {describe_exit(code)}; last log lines:\n{child.log_tail()}")

    def supervise(self, now: float) -> list[str]:
        """Start again every child that exited on its own; one line per restart, saying why.

        A worker killed mid-job (SIGKILL, a SIGBUS from a truncated input) loses nothing: its leases
        expire and the chunks run again. Raises SitsError when the embedded Redis exited (the stack's
        state is gone; starting it again is a decision for the user) or when a child used up its
        `restart_budget` (it would only die again).
        """
        self._check_redis()
        notes = []
        for child in self.children:
            code = child.process.poll()
            if code is None:
                continue
            budget = self.restart_budget
            if not budget.allow(child.name, now):
                raise SitsError(f"{child.name} exited with {describe_exit(code)}, after {budget.max_restarts} "
                                f"restarts in {budget.window_seconds:g}s; see {child.log_path}. Last log lines:\n"
                                f"{child.log_tail()}")
            reason = f"exited with {describe_exit(code)}"
            child.restart(reason)
            notes.append(f"{child.name} {reason}; started it again as PID {child.process.pid} "
                         f"(restart {budget.used(child.name)} of at most {budget.max_restarts} "
                         f"in {budget.window_seconds:g}s; log {child.log_path})")
        return notes

    def _check_redis(self) -> None:
        code = self.redis.exit_code() if self.redis is not None else None
        if code is not None:
            log = self.home / "redis" / "redis.log"
            raise SitsError(f"the embedded Redis exited with {describe_exit(code)}; its data are in "
                            f"{self.home / 'redis'} (see {log}), and `sitsctl up` starts it again from them")

    def stop_child(self, name: str, *, kill: bool = False, timeout: float = 15.0) -> None:
        """Stop one child by its PID: SIGTERM (warm shutdown) or SIGKILL (a crash)."""
        for child in list(self.children):
            if child.name == name:
                stop_process(child.process, kill=kill, timeout=timeout)
                self.children.remove(child)

    def stop(self) -> None:
        """Stop every child this stack started (workers first, Redis last), by PID."""
        for child in reversed(self.children):
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        wait_for_exit([child.process for child in reversed(self.children)], timeout=15.0)
        self.children.clear()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        self._remove_client_files()
        if self._lock_file is not None:
            self._lock_file.close()  # releases the flock
            self._lock_file = None

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _check_port_free(host: str, port: int, advice: str = "--port (or api.port; 0 picks a free one)") -> None:
    """Raise SitsError when another program already listens on `host:port` (the API could not bind it,
    and `/readyz` there would be that program's answer); `advice` says where the port is chosen."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gunicorn binds: TIME_WAIT is no obstacle
        try:
            probe.bind((host, port))
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                raise
            raise SitsError(f"port {port} on {host} is already in use by another program: choose another with "
                            f"{advice}") from None
