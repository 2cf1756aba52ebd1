"""`sitsctl job status|cancel|resume ID` refuse an id that cannot be a job's before any HTTP call.

An id holding '/' used to reach another route of the API (servers decode %2F before routing) and
came back as Werkzeug's "The requested URL was not found on the server", or a 405 for `x/resume`.
The API here is the real app served over HTTP on a free port, over the session's real Redis.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from broker.jobs import records as jobs
from broker.state.embedded import free_port
from sits_api.cli.main import cli
from sits_api.cli.params import JOB_ID
from tests.api.api_helpers import Api
from tests.leasing import lease_items

NOT_JOB_IDS = ["a/b", "x/resume", "../jobs", "", "j1", "J3FA9C01B2E7D", "j3fa9c01b2e7d0", "j3fa9c01b2e7g",
               " j3fa9c01b2e7d", "j3fa9c01b2e7d\n", "a job id with spaces"]
ID_COMMANDS = [("status",), ("status", "--json"), ("cancel",), ("resume",), ("resume", "--wait")]


def sitsctl(*args: str, api_url: str, api_key: str = "") -> Result:
    """sitsctl in-process with this API and key, and no home, config or URLs inherited."""
    env = {"SITS_API_URL": api_url, "SITS_API_KEY": api_key, "SITS_HOME": None, "SITS_CONFIG": None,
           "SITS_REDIS_URL": None}
    return CliRunner().invoke(cli, list(args), env=env)


def one_line(result: Result) -> str:
    return " ".join(result.output.split())


@pytest.mark.parametrize("command", ID_COMMANDS, ids=" ".join)
@pytest.mark.parametrize("job_id", NOT_JOB_IDS)
def test_an_id_that_cannot_be_a_job_s_is_refused_before_any_http_call(command: tuple[str, ...], job_id: str) -> None:
    # Nothing listens on this port: a call made anyway would answer "cannot reach the SITS API".
    result = sitsctl("job", command[0], job_id, *command[1:], api_url=f"http://127.0.0.1:{free_port()}")

    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), one_line(result)
    assert f"Invalid value for 'JOB_ID': {job_id!r} is not a job id: job ids are 'j' and 12 hex digits" \
        in one_line(result)
    assert "cannot reach" not in result.output and "Traceback" not in result.output


def test_every_id_the_broker_makes_is_a_job_id_to_the_cli() -> None:
    """The CLI's pattern is a copy of broker.jobs.records.new_job_id's format: they must not drift apart."""
    made = {jobs.new_job_id() for _ in range(500)}

    assert all(JOB_ID.fullmatch(job_id) for job_id in made), sorted(made)[:5]


def test_job_commands_against_the_api_name_the_job_not_a_missing_url(
        served_api: str, admin_key: str, api: Api, mlp: dict, mlp_input: Path, tmp_path: Path) -> None:
    submitted = api.post("/v1/jobs", json={"model": "mlp", "input_batch": str(mlp_input),
                                           "output_dir": str(tmp_path / "out")})
    assert submitted.status_code == 201, submitted.get_json()
    job_id = submitted.get_json()["id"]
    unknown = "j" + "0" * 12

    status = sitsctl("job", "status", job_id, api_url=served_api, api_key=admin_key)
    cancel = sitsctl("job", "cancel", job_id, api_url=served_api, api_key=admin_key)
    missing = sitsctl("job", "status", unknown, api_url=served_api, api_key=admin_key)
    slashed = [sitsctl("job", name, f"{job_id}/x", api_url=served_api, api_key=admin_key)
               for name in ("status", "cancel", "resume")]

    assert status.exit_code == 0 and f"{job_id} queued mlp@" in one_line(status), one_line(status)
    assert cancel.exit_code == 0 and f"job {job_id} cancelled" in one_line(cancel), one_line(cancel)
    assert missing.exit_code == 1, one_line(missing)
    assert f"404: no job with id '{unknown}'; list jobs with GET /v1/jobs or `sitsctl job list`" in one_line(missing)
    for result in slashed:
        assert result.exit_code == 2, one_line(result)
        assert f"'{job_id}/x' is not a job id" in one_line(result)
        assert "requested URL was not found" not in result.output


def test_status_shows_the_requests_served_to_an_admin_key_and_leaves_them_out_for_a_user_key(
        served_api: str, admin_key: str, store: Any) -> None:
    """They count every tenant's requests (GET /v2/models/stats: admin and metrics keys)."""
    from broker.tenants.apikeys import create_api_key

    as_admin = sitsctl("status", api_url=served_api, api_key=admin_key)
    as_user = sitsctl("status", api_url=served_api, api_key=create_api_key(store, "bob", "user"))

    assert as_admin.exit_code == 0 and "online requests: none served yet" in as_admin.output, as_admin.output
    assert as_user.exit_code == 0 and "jobs:" in as_user.output, as_user.output
    assert "online requests" not in as_user.output


def test_status_shows_each_version_s_request_figures(served_api: str, admin_key: str, store: Any,
                                                     mlp: dict[str, Any]) -> None:
    """Two requests of 3 and 1 rows run together (submitted 0.5 s and 0.25 s before the run began at t,
    answered at t + 0.125); one more failed without running, submitted 1 s before t + 0.125."""
    import time

    import numpy as np

    from broker.online import requests
    from broker.online.requests import RequestResult, RequestSpec

    ref, now = mlp["ref"], time.time()
    for request_id, rows, created in (("a", 3, now - 0.5), ("b", 1, now - 0.25), ("late", 1, now - 0.875)):
        spec = RequestSpec(request_id=request_id, model_name="mlp", model_version=mlp["version"],
                           inputs={"features": np.ones((rows, 64), dtype=np.float32)}, rows=rows, tokens=None,
                           bucket="", factors={"level": 0})
        requests.submit_request(store, spec, score=0.0, now=created, max_age_seconds=600)
    leased = {item.item_id: item for _ in range(3)
              for item in lease_items(store, ref, now=now, lease_seconds=30, max_items=1)}
    outputs = {"logits": np.zeros((1, 10), dtype=np.float32)}
    requests.complete_requests(store, [RequestResult(leased["a"], outputs=outputs),
                                       RequestResult(leased["b"], outputs=outputs),
                                       RequestResult(leased["late"], error="timed out", code="timeout", ran=False)],
                               now=now + 0.125, keep_seconds=60, batch_size=3, worker="w", run_started=now,
                               run_rows=4)

    result = sitsctl("status", api_url=served_api, api_key=admin_key)

    row = next(line for line in result.output.split("requests (model@version)")[1].splitlines()
               if line.strip(" │").startswith("mlp@"))
    cells = [cell.strip() for cell in row.strip(" │").split("│")]
    # succeeded, failed, mean ms (625 + 375 + 1000) / 3, queue ms (500 + 250) / 2, runs, rows per run
    assert cells == [ref, "2", "1", "666.7", "375.0", "1", "4.0"], result.output
