"""Bad input to `sitsctl` prints one message saying what to fix and exits non-zero, never a traceback.

No stack runs here: commands that need the API or Redis get an invalid or unreachable URL.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from broker.state.embedded import free_port
from sits_api.cli.main import cli

SUBMIT = ["job", "submit", "--model", "mlp", "--input-batch", "in.bin", "--output-dir", "out"]


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Invokes sitsctl in an empty SITS_HOME with no SITS_* URLs, keys or config inherited."""
    monkeypatch.chdir(tmp_path)
    base_env = {"SITS_HOME": str(tmp_path / "home"), "SITS_API_URL": None, "SITS_API_KEY": None,
                "SITS_REDIS_URL": None, "SITS_CONFIG": None}

    def invoke(*args: str, **env: str) -> Result:
        return CliRunner().invoke(cli, list(args), env=base_env | env)

    return invoke


def assert_refused(result: Result, *phrases: str) -> None:
    output = " ".join(result.output.split())
    assert result.exit_code != 0, output
    # CliRunner keeps an uncaught exception in `result.exception`; a handled error is a plain exit
    assert "Traceback" not in output and isinstance(result.exception, SystemExit), repr(result.exception)
    for phrase in phrases:
        assert phrase in output, output


def sitsctl_process(tmp_path: Path, *args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    """sitsctl as its own process (`worker` replaces the process it runs in, `up` runs until stopped);
    one still running after `timeout` is stopped as Ctrl-C would (SIGTERM, then SIGKILL) and fails the test."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SITS_")} | {"SITS_HOME": str(tmp_path / "home")}
    process = subprocess.Popen([sys.executable, "-m", "sits_api.cli", *args], env=base | env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.terminate()
        try:
            stdout, stderr = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        raise AssertionError(f"sitsctl {' '.join(args)} was still running after {timeout}s: {stdout}{stderr}") from None
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.mark.parametrize("shape", ["abc", "64,,2", "3,0,3", ""])
def test_job_submit_refuses_a_shape_that_is_not_positive_integers(run, shape: str) -> None:
    assert_refused(run(*SUBMIT, "--shape", shape), "--shape", "positive integers separated by commas")


@pytest.mark.parametrize("option", ["--chunk-size", "--batch-size"])
@pytest.mark.parametrize("value", ["0", "-5"])
def test_job_submit_refuses_a_chunk_or_batch_size_below_one(run, option: str, value: str) -> None:
    assert_refused(run(*SUBMIT, option, value), option, "x>=1")


@pytest.mark.parametrize("name", ["", "   "])
def test_key_create_refuses_an_empty_name(run, name: str) -> None:
    assert_refused(run("key", "create", "--name", name), "--name", "must not be empty")


@pytest.mark.parametrize("url", ["notaurl", "redis://127.0.0.1:notaport"])
def test_key_create_names_a_malformed_redis_url(run, url: str) -> None:
    assert_refused(run("key", "create", "--name", "alice", SITS_REDIS_URL=url),
                   f"'{url}' is not a Redis URL", "redis://")


def test_key_create_says_when_redis_is_unreachable(run) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    assert_refused(run("key", "create", "--name", "alice", SITS_REDIS_URL=url), "Redis is unreachable")


@pytest.mark.parametrize("url", ["notaurl", "ftp://example.org", "http://127.0.0.1:notaport"])
def test_status_names_a_malformed_api_url(run, url: str) -> None:
    assert_refused(run("status", SITS_API_URL=url), f"SITS_API_URL '{url}' is not an API URL", "http://")


def test_commands_say_when_the_api_is_unreachable(run) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert_refused(run("job", "status", "j3fa9c01b2e7d", SITS_API_URL=url), "cannot reach the SITS API")
    assert_refused(run(*SUBMIT, "--shape", "3,32,32", SITS_API_URL=url), "cannot reach the SITS API")


def test_zoo_build_names_a_directory_it_cannot_create(run) -> None:
    assert_refused(run("zoo", "build", "/proc/nope"), "/proc/nope", "No such file or directory")


class _NotTheApi(BaseHTTPRequestHandler):
    """Answers /v1/status with HTML and everything else with a 400 whose message holds `[...]`."""

    def do_GET(self) -> None:
        if self.path == "/v1/status":
            self._answer(200, b"<html>a web page</html>")
        else:
            self._answer(400, json.dumps({"error": "expects float32 [N,64], see [/v1/models]"}).encode())

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def not_the_api() -> Iterator[str]:
    server = HTTPServer(("127.0.0.1", 0), _NotTheApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()
    thread.join()


def test_an_answer_that_is_not_json_is_reported_not_raised(run, not_the_api: str) -> None:
    assert_refused(run("status", SITS_API_URL=not_the_api), "not JSON", "is it the SITS API?")


def test_api_error_messages_with_brackets_print_as_text(run, not_the_api: str) -> None:
    assert_refused(run("job", "status", "j3fa9c01b2e7d", SITS_API_URL=not_the_api),
                   "400: expects float32 [N,64], see [/v1/models]")


def test_a_stack_whose_redis_has_a_user_key_of_its_admin_key_s_name_says_so(
        redis_server, tmp_path: Path) -> None:
    """`sitsctl up` makes an admin key named sitsctl-up; a user key of that name already in its Redis
    (names are tenants, one role each) stops it with a message, before anything is started."""
    import uuid

    from broker.config.settings import Settings
    from broker.errors import ConfigError
    from broker.state.store import Store
    from broker.tenants.apikeys import create_api_key
    from sits_api.cli.stack import Stack

    prefix = "t" + uuid.uuid4().hex[:10]
    create_api_key(Store.connect(redis_server.url, prefix), "sitsctl-up", "user")
    settings = Settings().with_overrides(redis={"url": redis_server.url, "key_prefix": prefix},
                                         paths={"home": tmp_path / "home"})
    stack = Stack(settings, worker_count=0, api_port=0)

    with pytest.raises(ConfigError, match="cannot make the stack's admin key: .*sitsctl-up"):
        stack.start()
    assert not stack.children


@pytest.mark.parametrize("args", [
    ("up", "--workers", "-1"),
    ("up", "--streams", "500"),
    ("up", "--streams", "0"),
    ("up", "--port", "70000"),
    ("worker", "--streams", "65"),
    ("worker", "--streams", "0"),
    ("worker", "--gpu", "-1"),
])
def test_up_and_worker_refuse_counts_out_of_range(tmp_path: Path, args: tuple[str, ...]) -> None:
    result = sitsctl_process(tmp_path, *args, timeout=20)

    assert result.returncode == 2 and f"Invalid value for '{args[1]}'" in result.stderr, result.stderr
    assert "is not in the range" in result.stderr


def _not_utf8(tmp_path: Path) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"\x00\xff\xfe")
    return path


def test_up_and_job_submit_name_a_config_file_that_is_not_utf8(run, tmp_path: Path) -> None:
    bad = str(_not_utf8(tmp_path))
    assert_refused(run("up", "--config", bad), f"config file {bad} is not UTF-8 text")
    assert_refused(run(*SUBMIT, "--config", bad), f"config file {bad} is not UTF-8 text")


def test_up_names_the_variable_that_is_not_valid_yaml(run) -> None:
    assert_refused(run("up", SITS_PATHS__INPUT_ROOTS="[/a"), "SITS_PATHS__INPUT_ROOTS='[/a' is not a valid YAML")


def test_up_refuses_a_port_another_server_listens_on_before_starting_anything(
        run, not_the_api: str, tmp_path: Path) -> None:
    port = not_the_api.rsplit(":", 1)[1]

    assert_refused(run("up", "--workers", "0", "--port", port),
                   f"port {port} on 127.0.0.1 is already in use by another program", "--port")
    home = tmp_path / "home"
    assert not (home / "api-url").exists() and not (home / "redis").exists()


def test_worker_without_a_redis_says_how_to_get_one(tmp_path: Path) -> None:
    result = sitsctl_process(tmp_path, "worker", "--cpu")

    assert result.returncode == 1, result.stdout + result.stderr
    assert "no Redis to use: start a stack with `sitsctl up`" in " ".join(result.stderr.split())
    assert "Traceback" not in result.stderr


def test_urls_left_by_a_killed_stack_are_not_followed(tmp_path: Path) -> None:
    """A stack killed by SIGKILL leaves its api-url and redis-url; whatever server takes those ports next
    must not get the commands (nor the admin key): they are used only while the stack's lock is held."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "redis-url").write_text(f"redis://127.0.0.1:{free_port()}/0\n")
    (home / "api-url").write_text(f"http://127.0.0.1:{free_port()}\n")

    worker = sitsctl_process(tmp_path, "worker", "--cpu")
    key = sitsctl_process(tmp_path, "key", "create", "--name", "x")
    status = sitsctl_process(tmp_path, "status")

    for result in (worker, key):
        assert result.returncode != 0 and "no Redis to use" in result.stderr, result.stdout + result.stderr
        assert "redis-url is left from a stack that no longer runs" in " ".join(result.stderr.split())
    assert status.returncode != 0, status.stdout + status.stderr
    assert "api-url is left from a stack that no longer runs" in " ".join(status.stderr.split())


def test_a_plain_celery_worker_without_a_redis_url_stops_instead_of_trying_amqp(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SITS_")} | {"SITS_HOME": str(tmp_path / "home")}
    result = subprocess.run([sys.executable, "-m", "celery", "-A", "sits_worker", "worker", "--pool", "threads"],
                            env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)

    assert result.returncode != 0
    assert "no Redis to use: set SITS_REDIS_URL" in result.stderr and "amqp" not in result.stderr + result.stdout


def test_worker_pinned_to_a_gpu_it_cannot_use_is_refused(tmp_path: Path, redis_server) -> None:
    from sits_worker.device.pinning import Device, gpu_problem

    if gpu_problem(Device("gpu", 0)) is None:
        pytest.skip("this machine can run a worker on gpu:0")
    result = sitsctl_process(tmp_path, "worker", "--gpu", "0", "--name", "gpu-refused@%h",
                             SITS_REDIS_URL=redis_server.url)

    assert result.returncode == 1
    assert "cannot pin this worker to gpu:0: " in result.stderr and "--cpu" in result.stderr, result.stderr
    # refused before Celery starts: nothing but the one error line (no banner, no warning)
    assert result.stdout == "" and len(result.stderr.strip().splitlines()) == 1, result.stdout + result.stderr


def test_client_commands_look_in_the_home_the_named_config_sets(run, tmp_path: Path) -> None:
    """`up --config` with a `paths.home` records its URLs there: `status` with that SITS_CONFIG (and no
    SITS_HOME) must look there, not in ~/.sits."""
    config = tmp_path / "sits-config.yaml"
    config.write_text(f"paths:\n  home: {tmp_path / 'elsewhere'}\n")

    result = run("status", SITS_HOME=None, SITS_CONFIG=str(config))

    assert_refused(result, "no API to talk to", f"looked in {tmp_path / 'elsewhere'}")
