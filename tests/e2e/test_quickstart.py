"""The quick-start main job (`sitsctl demo`) runs on a fresh SITS_HOME with nothing running."""

from __future__ import annotations

import os
import subprocess
import sys


def test_demo_runs_the_main_job_and_stops_everything(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SITS_")} | {"SITS_HOME": str(tmp_path / "home")}
    # What an earlier demo in this SITS_HOME left: the API refuses an output folder holding a finished
    # job's manifest, so a second run must clear its own results first.
    earlier = tmp_path / "home" / "demo" / "results" / "convnet"
    earlier.mkdir(parents=True)
    (earlier / "manifest.json").write_text('{"rows": 10000}')
    result = subprocess.run([sys.executable, "-m", "sits_api.cli", "demo", "--rows", "10000"], env=env,
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "succeeded" in output and "demo passed" in output and "logits.npy" in output, output
    assert "max |diff|" in output and "ok" in output
    # Everything the demo started is gone: the embedded Redis no longer answers on its port (as its
    # settings recorded it), and the URLs it wrote for other commands are removed.
    import socket
    import urllib.parse

    import yaml

    redis_url = yaml.safe_load((tmp_path / "home" / "run" / "sits-config.yaml").read_text())["redis"]["url"]
    port = urllib.parse.urlsplit(redis_url).port
    assert not (tmp_path / "home" / "redis-url").exists() and not (tmp_path / "home" / "api-url").exists()
    # it showed its Redis with the password masked
    password = urllib.parse.urlsplit(redis_url).password
    assert password and password not in output and "Redis redis://:***@127.0.0.1:" in " ".join(output.split())

    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0


def test_sitsctl_up_records_url_and_key_and_stops_its_children_on_sigterm(tmp_path):
    import json
    import signal
    import time
    import urllib.parse

    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SITS_")} | {"SITS_HOME": str(home)}
    up = subprocess.Popen([sys.executable, "-m", "sits_api.cli", "up", "--workers", "1", "--port", "0"], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 90
        status = None
        while time.monotonic() < deadline and up.poll() is None:
            result = subprocess.run([sys.executable, "-m", "sits_api.cli", "status", "--json"], env=env,
                                    capture_output=True, text=True)
            if result.returncode == 0:
                status = json.loads(result.stdout)
                if any(worker["alive"] for worker in status["workers"]):
                    break
            time.sleep(0.5)
        assert status and status["workers"], up.stdout.read() if up.poll() is not None else status
        assert (home / "api-key").stat().st_mode & 0o777 == 0o600
        for secret in ("redis-url", "run/sits-config.yaml", "redis/redis.conf"):  # each holds the Redis password
            assert (home / secret).stat().st_mode & 0o777 == 0o600, secret
        assert home.stat().st_mode & 0o777 == 0o700
        password = urllib.parse.urlsplit((home / "redis-url").read_text().strip()).password
        assert password and password not in json.dumps(status) and status["redis_url"].startswith("redis://:***@")
        assert (home / "api-url").read_text().startswith("http://127.0.0.1:")
        second = subprocess.run([sys.executable, "-m", "sits_api.cli", "up", "--port", "0"], env=env,
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 1 and "already runs" in second.stderr
        worker_pid = status["workers"][0]["pid"]
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    # the worker it started is gone (checked by its PID, nothing is killed by name)
    try:
        os.kill(worker_pid, 0)
        alive = True
    except ProcessLookupError:
        alive = False
    assert not alive


def test_a_demo_that_cannot_start_ends_with_its_failed_line(tmp_path):
    """Another stack holds this SITS_HOME (its lock): the demo says why, then `demo FAILED`, exit 1."""
    import fcntl

    home = tmp_path / "home"
    (home / "run").mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SITS_")} | {"SITS_HOME": str(home)}
    with open(home / "run" / "stack.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        result = subprocess.run([sys.executable, "-m", "sits_api.cli", "demo"], env=env, capture_output=True,
                                text=True, timeout=120, cwd=tmp_path)
    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 1, output
    assert "another SITS stack already runs" in output and "demo FAILED" in output, output
    assert "Traceback" not in output
