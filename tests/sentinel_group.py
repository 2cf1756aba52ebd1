"""A real Redis group on loopback for failover tests: a primary, a replica and three Sentinels.

Each is a `redis-server` subprocess (the Redis servers through the project's own launcher, the Sentinels
as `redis-server sentinel.conf --sentinel` from the same binary); their PIDs are kept and exactly those
are stopped. One password locks everything, as the embedded Redis is locked: the servers' `requirepass`
and `masterauth`, the Sentinels' `requirepass`, and what the Sentinels use to reach the servers and
each other. Sentinels take a primary for down after `DOWN_AFTER_MS`, so a failover takes a few seconds.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
import urllib.parse
from pathlib import Path

import redis

from broker.state.embedded import (
    EmbeddedRedis,
    die_with_parent,
    find_redis_server,
    free_port,
    make_private_folder,
    write_private_file,
)

MASTER_NAME = "sits"
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 3000


class SentinelGroup:
    """A primary, `replicas` replicas and three Sentinels in folders under `base`. `min_replicas_to_write`
    is set on every server (Redis's `min-replicas-to-write`, with `min-replicas-max-lag` seconds)."""

    def __init__(self, base: Path, *, replicas: int = 1, min_replicas_to_write: int = 0,
                 min_replicas_max_lag: int = 10) -> None:
        self.base = Path(base)
        self.password = secrets.token_urlsafe(24)
        self.servers = [EmbeddedRedis(self.base / f"redis{index}", password=self.password)
                        for index in range(1 + replicas)]
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.sentinels: list[subprocess.Popen[bytes]] = []
        self.min_replicas = (min_replicas_to_write, min_replicas_max_lag)

    @property
    def url(self) -> str:
        """The group's `sentinel://` URL (`redis.url`, with `redis.sentinel_master` = `MASTER_NAME`)."""
        secret = urllib.parse.quote(self.password, safe="")
        return ";".join(f"sentinel://:{secret}@127.0.0.1:{port}" for port in self.sentinel_ports) + "/0"

    def start(self, timeout: float = 20.0) -> SentinelGroup:
        """Start the servers (the first is the primary, the others replicate it), then the Sentinels, and
        wait until every Sentinel sees the primary, its replicas and the two other Sentinels."""
        try:
            for server in self.servers:
                self._start_server(server)
            for replica in self.servers[1:]:
                self.client(replica).replicaof("127.0.0.1", self.servers[0].port)
            for replica in self.servers[1:]:
                self.wait_replicating(replica, timeout=timeout)
            for index, port in enumerate(self.sentinel_ports):
                self.sentinels.append(self._start_sentinel(index, port))
            self._wait_sentinels(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_server(self, server: EmbeddedRedis) -> None:
        server.start()
        client = self.client(server)
        client.config_set("masterauth", self.password)  # (in its config file, rewritten by the Sentinels)
        client.config_set("min-replicas-to-write", self.min_replicas[0])
        client.config_set("min-replicas-max-lag", self.min_replicas[1])
        client.close()

    def _start_sentinel(self, index: int, port: int) -> subprocess.Popen[bytes]:
        folder = self.base / f"sentinel{index}"
        make_private_folder(folder)
        quoted = "".join(f"\\x{byte:02x}" for byte in self.password.encode())  # (as EmbeddedRedis writes it)
        primary = self.servers[0].port
        write_private_file(folder / "sentinel.conf", "\n".join([
            f"port {port}", "bind 127.0.0.1", f'dir "{folder}"', "daemonize no",
            f'logfile "{folder / "sentinel.log"}"',
            f'requirepass "{quoted}"', f'sentinel sentinel-pass "{quoted}"',
            f"sentinel monitor {MASTER_NAME} 127.0.0.1 {primary} 2",
            f'sentinel auth-pass {MASTER_NAME} "{quoted}"',
            f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}",
            f"sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}",
            f"sentinel parallel-syncs {MASTER_NAME} 1", ""]))
        return subprocess.Popen([find_redis_server(), str(folder / "sentinel.conf"), "--sentinel"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=die_with_parent())

    def sentinel_client(self, index: int) -> redis.Redis:
        return redis.Redis(port=self.sentinel_ports[index], password=self.password, decode_responses=True,
                           socket_timeout=2.0)

    def client(self, server: EmbeddedRedis) -> redis.Redis:
        """A plain client of one server (not through the Sentinels)."""
        return redis.Redis(port=server.port, password=self.password, decode_responses=True, socket_timeout=5.0)

    def _wait_sentinels(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        want_replicas = sum(1 for server in self.servers[1:] if server.process is not None)
        while True:
            try:
                views = [self.sentinel_client(index).sentinel_master(MASTER_NAME) for index in range(3)]
                if all(int(view["num-other-sentinels"]) == 2 and int(view["num-slaves"]) >= want_replicas
                       for view in views):
                    return
            except redis.RedisError:
                pass
            for sentinel in self.sentinels:
                if sentinel.poll() is not None:
                    raise RuntimeError(f"a Sentinel exited ({sentinel.returncode}); see {self.base}/sentinel*/")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Sentinels did not see the group in {timeout}s; see {self.base}/sentinel*/")
            time.sleep(0.1)

    def primary_port(self) -> int:
        """The port of the primary, as the first Sentinel that answers sees it."""
        for index in range(3):
            try:
                return int(self.sentinel_client(index).sentinel_get_master_addr_by_name(MASTER_NAME)[1])
            except (redis.RedisError, TypeError):
                continue
        raise RuntimeError("no Sentinel answers")

    def primary(self) -> EmbeddedRedis:
        """The server the Sentinels take for the primary now."""
        port = self.primary_port()
        return next(server for server in self.servers if server.port == port)

    def kill_primary(self) -> EmbeddedRedis:
        """SIGKILL the primary, as a crash: nothing it has not sent to its replica yet survives."""
        primary = self.primary()
        primary.stop(kill=True)
        return primary

    def wait_failover(self, old_port: int, timeout: float = 30.0) -> EmbeddedRedis:
        """Wait until every Sentinel names another primary than the one on `old_port`, and it takes
        writes; the new primary."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                ports = {int(self.sentinel_client(index).sentinel_get_master_addr_by_name(MASTER_NAME)[1])
                         for index in range(3)}
                if len(ports) == 1 and old_port not in ports:
                    primary = next(server for server in self.servers if server.port in ports)
                    if self.client(primary).info("replication")["role"] == "master":
                        return primary
            except (redis.RedisError, TypeError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"no failover within {timeout}s; see {self.base}/sentinel*/sentinel.log")
            time.sleep(0.05)

    def restart(self, server: EmbeddedRedis, timeout: float = 20.0) -> None:
        """Start a stopped server again on its port and folder, as a replica of the primary: what the
        Sentinels make of a former primary that comes back (they wait some 8 s before they do; this does it
        at once). Waits until it replicates."""
        self._start_server(server)
        self.client(server).replicaof("127.0.0.1", self.primary_port())
        self.wait_replicating(server, timeout=timeout)

    def wait_replicating(self, server: EmbeddedRedis, timeout: float = 20.0) -> None:
        """Wait until `server` is a replica in step with its primary (link up, initial sync done)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                info = self.client(server).info("replication")
                if info["role"] == "slave" and info.get("master_link_status") == "up" \
                        and not int(info.get("master_sync_in_progress", 0)):
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{server.port} does not replicate within {timeout}s; see {server.data_dir}")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop the Sentinels and the servers this group started, by PID."""
        for sentinel in self.sentinels:
            if sentinel.poll() is None:
                os.kill(sentinel.pid, signal.SIGTERM)
        for sentinel in self.sentinels:
            try:
                sentinel.wait(10)
            except subprocess.TimeoutExpired:
                sentinel.kill()
                sentinel.wait()
        self.sentinels.clear()
        for server in self.servers:
            server.stop()

    def __enter__(self) -> SentinelGroup:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
