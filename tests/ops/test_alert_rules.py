"""ops/prometheus/alerts.yml: rules promtool accepts, unit tests (alerts_test.yml) that pass, a config that
loads them, and a fired and a quiet case tested for every alert.

promtool comes from Debian's `prometheus` package, which `.ci/run` installs where it can. Where it is
missing, the promtool tests skip and say how to install it; the checks of the files' shape still run.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

PROMETHEUS = Path(__file__).resolve().parents[2] / "ops" / "prometheus"
ALERTS = PROMETHEUS / "alerts.yml"
ALERT_TESTS = PROMETHEUS / "alerts_test.yml"


def promtool(*args: str, cwd: Path = PROMETHEUS) -> subprocess.CompletedProcess[str]:
    """Run promtool (skipping the test, with how to install it, where there is none)."""
    binary = shutil.which("promtool")
    if binary is None:
        pytest.skip("promtool is not installed, so ops/prometheus/alerts.yml was not checked: install Debian's "
                    "prometheus package (apt-get install prometheus; .ci/run does it when run as root)")
    return subprocess.run([binary, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


def rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def test_promtool_accepts_the_alert_rules() -> None:
    result = promtool("check", "rules", str(ALERTS))

    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules())} rules found" in result.stdout


def test_the_alert_rules_unit_tests_pass() -> None:
    result = promtool("test", "rules", str(ALERT_TESTS))

    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_the_prometheus_config_loads_the_alert_rules(tmp_path: Path) -> None:
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    assert config["rule_files"] == [ALERTS.name]  # beside prometheus.yml, in the folder compose mounts
    # promtool checks that the scrape key exists: point a copy at one in tmp_path
    (tmp_path / "sits-api-key").write_text("sits_test-key\n")
    for job in config["scrape_configs"]:
        if "authorization" in job:
            job["authorization"]["credentials_file"] = str(tmp_path / "sits-api-key")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    shutil.copy(ALERTS, tmp_path / ALERTS.name)

    result = promtool("check", "config", "prometheus.yml", cwd=tmp_path)

    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules())} rules found" in result.stdout


def test_every_alert_says_how_severe_and_what_it_means_and_waits_before_firing() -> None:
    found = rules()

    assert {rule["alert"] for rule in found} == {"SitsDeadlineMissed", "SitsSlaViolationPredicted",
                                                 "SitsQueueNearLimit", "SitsNoWorkerForWaitingWork",
                                                 "SitsCircuitBreakerOpen", "SitsQueueLevelNearLimit",
                                                 "SitsWorkerDegraded", "SitsRequestDeadlinesMissed",
                                                 "SitsQueueWaitHigh", "SitsSaturated", "SitsMetricsUnavailable",
                                                 "SitsWorkerHeartbeatLost", "SitsStoreUnavailableAnswers",
                                                 "SitsScheduleReleaseRefused", "SitsScheduleReleaseLate",
                                                 "SitsBeatDown"}
    for rule in found:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["for"].endswith("m") and rule["annotations"].keys() == {"summary", "description"}, rule["alert"]


def test_every_alert_is_tested_firing_and_staying_quiet() -> None:
    cases = [case for test in yaml.safe_load(ALERT_TESTS.read_text())["tests"] for case in test["alert_rule_test"]]

    for rule in rules():
        own = [case for case in cases if case["alertname"] == rule["alert"]]
        assert any(case["exp_alerts"] for case in own), f"{rule['alert']} is never tested firing"
        assert any(not case["exp_alerts"] for case in own), f"{rule['alert']} is never tested quiet"
