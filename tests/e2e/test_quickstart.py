"""The quick-start main job (`sitsctl demo`) runs on a fresh SITS_HOME with nothing running."""

from __future__ import annotations

import os
import subprocess
import sys


def test_demo_runs_the_main_job_and_stops_everything(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SITS_")} | {"SITS_HOME": str(tmp_path / "home")}
    result = subprocess.run([sys.executable, "-m", "sits_api.cli", "demo", "--rows", "10000"], env=env,
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "succeeded" in output and "demo passed" in output and "logits.npy" in output, output
    assert "max |diff|" in output and "ok" in output
    # Everything the demo started is gone: the embedded Redis no longer answers on its port.
    redis_url = (tmp_path / "home" / "redis-url").read_text().strip()
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    import socket

    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0
