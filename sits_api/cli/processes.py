"""The child processes of the embedded stack: started, restarted and stopped by PID, never by name.

Each child runs in a session of its own (Ctrl-C reaches only `sitsctl`, which stops the children in
order) and, on Linux, gets SIGTERM when the process that started it dies, even by SIGKILL
(`broker.state.embedded.die_with_parent`), so a killed `sitsctl up` leaves nothing running.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from broker.state.embedded import die_with_parent


@dataclass
class Child:
    """A process the stack started, and what it takes to start it again."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen[bytes]

    @classmethod
    def start(cls, name: str, argv: list[str], env: dict[str, str], log_path: Path) -> Child:
        """Start `argv` with stdout and stderr appended to `log_path`."""
        return cls(name, argv, env, log_path, _popen(argv, env, log_path))

    def restart(self, reason: str) -> None:
        """Start the same command again, after a line in its log that says why."""
        with open(self.log_path, "a") as log:
            log.write(f"\n--- sitsctl: {reason}; starting {self.name} again ---\n")
        self.process = _popen(self.argv, self.env, self.log_path)

    def log_tail(self, chars: int = 1500) -> str:
        """The end of its log, to say why it exited."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError as err:
            return f"(its log {self.log_path} cannot be read: {err.strerror})"


def _popen(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as log:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, preexec_fn=die_with_parent())


def describe_exit(code: int) -> str:
    """`code -9 (SIGKILL)` for a child killed by a signal, `code 1` otherwise."""
    if code < 0:
        try:
            return f"code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"code {code}"


@dataclass
class RestartBudget:
    """At most `max_restarts` restarts of one child within any `window_seconds`: a child that keeps dying
    (a bad config, a port taken) stops the stack instead of being restarted forever.

    A pure decision: the caller passes the clock.
    """

    max_restarts: int = 5
    window_seconds: float = 60.0
    _restarts: dict[str, deque[float]] = field(default_factory=dict)

    def allow(self, name: str, now: float) -> bool:
        """True, and counted, when `name` may be restarted at `now`."""
        recent = self._restarts.setdefault(name, deque())
        while recent and now - recent[0] >= self.window_seconds:
            recent.popleft()
        if len(recent) >= self.max_restarts:
            return False
        recent.append(now)
        return True

    def used(self, name: str) -> int:
        """Restarts of `name` counted in the current window."""
        return len(self._restarts.get(name, ()))


def stop_process(process: subprocess.Popen[bytes], *, kill: bool = False, timeout: float = 15.0) -> None:
    """SIGTERM (or SIGKILL) one process by its PID and wait; SIGKILL after `timeout`."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def wait_for_exit(processes: list[subprocess.Popen[bytes]], timeout: float) -> None:
    """Wait until every process exited, SIGKILL those still running after `timeout` seconds in all."""
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
