"""The API fuzzed over its own OpenAPI document with schemathesis: whatever a client sends, no 5xx.

Every operation of `GET /openapi.json` gets cases hypothesis generates from its schema (and breaks:
wrong types, missing fields, odd strings in paths), sent with an admin key (so that no 401 or 403
ends a case before its body is read) to the app over a real Redis, with the zoo MLP registered and a
job and a request queued. Every check schemathesis has is run and its findings are reported; what
must hold is that none of the cases is answered with a server error. A soak: run with `-m slow`.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402

from tests.api.api_helpers import Api  # noqa: E402

pytestmark = pytest.mark.slow

CASES_PER_OPERATION = 40
FINDINGS: collections.Counter[str] = collections.Counter()
"""Failures of checks other than `not_a_server_error`, by check: reported, not asserted."""


def test_no_case_is_answered_with_a_server_error(app: Any, api: Api, admin_key: str, mlp: dict[str, Any],
                                                 mlp_input: Path, tmp_path: Path) -> None:
    api.post("/v1/jobs", json={"model": "mlp", "input_batch": str(mlp_input), "output_dir": str(tmp_path / "out")})
    api.post("/v1/requests", json={"model": "mlp", "inputs": {"features": [[0.5] * 64]}})
    schema = schemathesis.openapi.from_wsgi("/openapi.json", app)
    server_errors: list[str] = []
    cases: collections.Counter[str] = collections.Counter()

    for result in schema.get_all_operations():
        fuzz(result.ok(), {"Authorization": f"Bearer {admin_key}"}, cases, server_errors)

    print(f"\n{sum(cases.values())} cases over {len(cases)} operations, {len(server_errors)} server errors; "
          "findings of the other checks:")
    for finding, count in FINDINGS.most_common():
        print(f"  {count:4d}  {finding}")
    assert not server_errors, server_errors[:10]


def fuzz(operation: Any, headers: dict[str, str], cases: collections.Counter[str], server_errors: list[str]) -> None:
    """`CASES_PER_OPERATION` cases of one operation: each one's status, and every check's verdict."""
    label = operation.label

    @given(case=operation.as_strategy())
    @settings(max_examples=CASES_PER_OPERATION, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case: Any) -> None:
        response = case.call(headers=headers)
        cases[label] += 1
        if response.status_code >= 500:
            server_errors.append(f"{label}: {response.status_code} {response.text[:300]}")
        try:
            case.validate_response(response)  # every check schemathesis has: findings, reported
        except BaseExceptionGroup as found:  # schemathesis's failures of its checks
            for failure in found.exceptions:
                FINDINGS[f"{label}: {type(failure).__name__}"] += 1
        except AssertionError as failure:
            FINDINGS[f"{label}: {type(failure).__name__}"] += 1

    run()
