"""`sitsctl schedule ...` against the real app served over HTTP on a free port, over the session's real Redis."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from click.testing import CliRunner, Result

from sits_api.cli.main import cli


def sitsctl(*args: str, api_url: str, api_key: str) -> Result:
    env = {"SITS_API_URL": api_url, "SITS_API_KEY": api_key, "SITS_HOME": None, "SITS_CONFIG": None,
           "SITS_REDIS_URL": None}
    return CliRunner().invoke(cli, list(args), env=env)


def test_a_schedule_made_listed_shown_run_paused_resumed_and_deleted_from_the_command_line(
        served_api: str, admin_key: str, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    def run(*args: str) -> Result:
        result = sitsctl("schedule", *args, api_url=served_api, api_key=admin_key)
        assert result.exit_code == 0, result.output
        return result

    made = run("create", "--name", "nightly", "--cron", "30 17 * * 1-5", "--timezone", "Europe/Paris",
               "--model", "mlp", "--input-batch", str(mlp_input), "--output-dir", str(tmp_path / "out" / "{slot}"),
               "--window", "17:30-19:30", "--catch-up", "skip")
    listed = run("list")
    released = run("run-now", "nightly")
    shown = run("show", "nightly")
    run("pause", "nightly")
    resumed = run("resume", "nightly")
    run("delete", "nightly")
    gone = sitsctl("schedule", "show", "nightly", api_url=served_api, api_key=admin_key)

    assert "schedule nightly made; next slot" in made.output and "nightly" in listed.output
    assert "released" in released.output and "released (queued)" in " ".join(shown.output.split())
    assert "next slot" in resumed.output
    assert gone.exit_code == 1 and "404: no schedule 'nightly'" in gone.output


def test_create_refuses_both_or_neither_cadence_before_any_call(served_api: str, admin_key: str) -> None:
    result = sitsctl("schedule", "create", "--name", "x", "--model", "mlp", "--input-batch", "in.npy",
                     "--output-dir", "out", api_url=served_api, api_key=admin_key)

    assert result.exit_code == 2 and "give either --cron or --every" in result.output
