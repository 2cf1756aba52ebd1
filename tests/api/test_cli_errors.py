"""Bad input to `sitsctl` prints one message saying what to fix and exits non-zero, never a traceback.

No stack runs here: commands that need the API or Redis get an invalid or unreachable URL.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from broker.embedded import free_port
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
    assert_refused(run("job", "status", "a job id with spaces", SITS_API_URL=url), "cannot reach the SITS API")
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
    assert_refused(run("job", "status", "j1", SITS_API_URL=not_the_api),
                   "400: expects float32 [N,64], see [/v1/models]")


def test_a_stack_whose_redis_has_a_user_key_of_its_admin_key_s_name_says_so(
        redis_server, tmp_path: Path) -> None:
    """`sitsctl up` makes an admin key named sitsctl-up; a user key of that name already in its Redis
    (names are tenants, one role each) stops it with a message, before anything is started."""
    import uuid

    from broker.apikeys import create_api_key
    from broker.config import Settings
    from broker.errors import ConfigError
    from broker.store import Store
    from sits_api.cli.stack import Stack

    prefix = "t" + uuid.uuid4().hex[:10]
    create_api_key(Store.connect(redis_server.url, prefix), "sitsctl-up", "user")
    settings = Settings().with_overrides(redis={"url": redis_server.url, "key_prefix": prefix},
                                         paths={"home": tmp_path / "home"})
    stack = Stack(settings, worker_count=0, api_port=0)

    with pytest.raises(ConfigError, match="cannot make the stack's admin key: .*sitsctl-up"):
        stack.start()
    assert not stack.children
