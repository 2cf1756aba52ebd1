"""`sitsctl up` keeps its stack running and leaves nothing behind: a child that dies is started again,
the embedded Redis dying stops everything, and SIGHUP or a SIGKILL of `up` itself stops every child.

Each test runs a real `sitsctl up` in a SITS_HOME of its own; children are found by their parent PID
and checked by PID, nothing is looked up or killed by name.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

from sits_api.cli.processes import RestartBudget
from tests.waiting import eventually


class Up:
    """A `sitsctl up` subprocess; its output goes to a file, read as it grows."""

    def __init__(self, home: Path, *, workers: int, ignore_sighup: bool = False) -> None:
        self.home = home
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SITS_")} | {"SITS_HOME": str(home)}
        home.mkdir(parents=True)
        self.out_path = home.parent / "up.out"
        with open(self.out_path, "wb") as out:
            self.process = subprocess.Popen([sys.executable, "-m", "sits_api.cli", "up", "--workers", str(workers),
                                             "--port", "0"], env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                            cwd=home.parent, preexec_fn=_ignore_sighup if ignore_sighup else None)
        self.wait_for("Ctrl-C stops everything", timeout=120)

    def output(self) -> str:
        return " ".join(self.out_path.read_text(errors="replace").split())  # rich wraps at 80 columns

    def wait_for(self, text: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output():
            assert self.process.poll() is None or text in self.output(), f"up exited: {self.output()}"
            assert time.monotonic() < deadline, f"{text!r} not printed in {timeout}s: {self.output()}"
            time.sleep(0.2)

    def children(self) -> dict[int, str]:
        """PID -> command line of every process whose parent is this `up`."""
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid == self.process.pid:
                    found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except (OSError, IndexError, ValueError):
                continue  # exited meanwhile
        return found

    def status(self) -> dict:
        result = subprocess.run([sys.executable, "-m", "sits_api.cli", "status", "--json"], env=self.env,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
        return json.loads(result.stdout)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _ignore_sighup() -> None:
    """As `nohup` starts a command: SIGHUP ignored, which exec keeps."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


@pytest.fixture
def start_up(tmp_path: Path) -> Iterator:
    started: list[Up] = []

    def start(workers: int = 0, ignore_sighup: bool = False) -> Up:
        started.append(Up(tmp_path / f"up{len(started)}" / "home", workers=workers, ignore_sighup=ignore_sighup))
        return started[-1]

    yield start
    for up in started:
        up.stop()


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, exited but not yet reaped by its new parent, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def assert_all_exit(pids: list[int], timeout: float = 30) -> None:
    """Every process in `pids` exits within `timeout`; those that do not are stopped (by PID) and fail the test."""
    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in pids if alive(pid)]
    for pid in left:  # orphans of this test: leave nothing running
        os.kill(pid, signal.SIGTERM)
    time.sleep(5 if left else 0)
    for pid in [pid for pid in left if alive(pid)]:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running {timeout}s after `up` stopped: {left}"


def test_a_killed_worker_is_started_again_and_the_stack_stops_when_its_redis_dies(start_up) -> None:
    up = start_up(workers=1)
    [worker] = up.status()["workers"]

    os.kill(worker["pid"], signal.SIGKILL)

    up.wait_for("worker0 exited with code -9 (SIGKILL); started it again as PID")
    assert eventually(lambda: [w for w in up.status()["workers"] if w["alive"] and w["pid"] != worker["pid"]],
                      timeout=60, interval=0.5), up.status()
    assert up.process.poll() is None

    # Redis is the one child whose death stops everything: the stack's state is in it.
    children = up.children()
    redis_pid = next(pid for pid, argv in children.items() if "redis-server" in argv)
    os.kill(redis_pid, signal.SIGKILL)

    code = up.process.wait(60)
    assert_all_exit(list(children))
    assert code == 1 and "the embedded Redis exited with code -9 (SIGKILL)" in up.output(), (code, up.output())


def test_sighup_stops_every_child(start_up) -> None:
    up = start_up()
    children = up.children()
    assert len(children) >= 2, children  # the embedded Redis and the API
    # (the Redis password is in no child's command line, which `ps` shows every user, nor in what `up` prints)
    password = urllib.parse.urlsplit((up.home / "redis-url").read_text().strip()).password
    assert password and not [argv for argv in children.values() if password in argv]
    assert "Redis redis://:***@127.0.0.1:" in up.output() and password not in up.output(), up.output()

    up.process.send_signal(signal.SIGHUP)  # the terminal `up` ran in was closed

    code = up.process.wait(60)
    assert_all_exit(list(children))
    assert code == 0 and "stopping" in up.output(), (code, up.output())
    assert not (up.home / "api-url").exists() and not (up.home / "redis-url").exists()  # nothing runs there now
    assert (up.home / "api-key").exists()
    later = subprocess.run([sys.executable, "-m", "sits_api.cli", "key", "create", "--name", "late"], env=up.env,
                           capture_output=True, text=True, timeout=60)  # not led to whatever takes its ports
    assert later.returncode != 0 and "no Redis to use" in later.stdout + later.stderr, later.stdout + later.stderr


def test_under_nohup_sighup_leaves_the_stack_running(start_up) -> None:
    up = start_up(ignore_sighup=True)

    up.process.send_signal(signal.SIGHUP)  # the terminal closed: nohup meant the stack to outlive it
    time.sleep(2)

    assert up.process.poll() is None and "stopping" not in up.output(), up.output()
    up.status()  # the API still answers (`status` exits 0)


def test_a_sigkilled_up_leaves_no_child_running(start_up) -> None:
    up = start_up()
    children = up.children()
    assert len(children) >= 2, children

    up.process.kill()  # no chance to stop anything itself
    up.process.wait()

    assert_all_exit(list(children))


def test_the_restart_budget_allows_five_restarts_a_minute_per_child() -> None:
    budget = RestartBudget(max_restarts=5, window_seconds=60)

    assert all(budget.allow("worker0", now) for now in (0, 1, 2, 3, 4))
    assert not budget.allow("worker0", 30)
    assert budget.allow("worker1", 30)  # each child has its own
    assert budget.allow("worker0", 60)  # the first restart left the window
    assert not budget.allow("worker0", 60.5)  # the others are still in it


def test_a_child_that_keeps_dying_stops_the_stack_once_its_budget_is_spent(tmp_path: Path) -> None:
    from broker.config.settings import Settings
    from broker.errors import SitsError
    from sits_api.cli.stack import Stack

    home = tmp_path / "home"
    (home / "logs").mkdir(parents=True)
    stack = Stack(Settings().with_overrides(paths={"home": home}), worker_count=0,
                  restart_budget=RestartBudget(max_restarts=2, window_seconds=60))
    stack._spawn("crasher", [sys.executable, "-c", "print('bad config'); raise SystemExit(3)"])
    try:
        notes = []
        for now in (0.0, 1.0):
            stack.children[0].process.wait(30)
            notes += stack.supervise(now)
        stack.children[0].process.wait(30)
        with pytest.raises(SitsError) as spent:
            stack.supervise(2.0)
    finally:
        stack.stop()

    assert notes[0].startswith("crasher exited with code 3; started it again as PID "), notes
    assert "(restart 2 of at most 2 in 60s" in notes[1], notes
    assert spent.value.message.startswith("crasher exited with code 3, after 2 restarts in 60s")
    assert "bad config" in spent.value.message  # the end of its log says why
