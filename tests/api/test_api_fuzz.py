"""The API fuzzed over its own OpenAPI document with schemathesis: whatever a client sends, no 5xx.

Every operation of `GET /openapi.json` gets cases hypothesis generates from its schema (and breaks:
wrong types, missing fields, odd strings in paths), sent with an admin key (so that no 401 or 403
ends a case before its body is read) to the app over a real Redis, with the zoo MLP registered and a
job and a request queued. Every check schemathesis has is run and its findings are reported; what
must hold is that none of the cases is answered with a server error, and that no check finds the
answers or the statuses at odds with the document: every check passes, but that a 400 may answer a
case valid by the document where the API checks what no schema can (`BEYOND_THE_SCHEMA`). A soak: run
with `-m slow`.
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
"""Failures of checks other than `not_a_server_error`, by operation and check."""
EXAMPLES: dict[str, str] = {}
"""The first failure of each, with the answer and the case."""
BEYOND_THE_SCHEMA = {
    "POST /v1/jobs": "the model's inputs and the files named (their formats, their columns)",
    "POST /v1/requests": "the model's input names, shapes and datatypes",
    "POST /v2/models/{name}/infer": "the model's inputs; a binary body's JSON header length",
    "POST /v2/models/{name}/versions/{version}/infer": "the model's inputs; a binary body's JSON header length",
    "POST /v1/sla/analysis": "a task's name and its cost: wcet_ms, or model and rows",
    "POST /v1/schedules": "cron or every, one of the two, and the job it would submit",
    "PATCH /v1/schedules/{name}": "the schedule as changed, checked as a new one",
    "GET /v1/schedules/plan": "a live worker, or slots, to plan for",
    "POST /v1/schedules/plan": "a live worker, or slots, to plan for",
    "PUT /v1/routes": "a split, groups or paths, of versions registered",
    "PUT /v1/tenants/{name}": "the shares of every tenant together, and the roots",
    "POST /v1/keys": "a key name is one tenant's (or the admin keys')",
}
"""Operations whose bodies the API checks beyond what their schema says, and what: a 400 for a case
valid by the document is their answer, not a mismatch. (A whole number sent as 2.0, an integer to JSON
Schema, is taken as 2: `sits_api.schemas.WholeNumber`.)"""
ALLOWED: collections.Counter[str] = collections.Counter()


def test_no_case_is_a_server_error_or_at_odds_with_the_document(app: Any, api: Api, admin_key: str, mlp: dict[str, Any],
                                                 mlp_input: Path, tmp_path: Path) -> None:
    api.post("/v1/jobs", json={"model": "mlp", "input_batch": str(mlp_input), "output_dir": str(tmp_path / "out")})
    api.post("/v1/requests", json={"model": "mlp", "inputs": {"features": [[0.5] * 64]}})
    schema = schemathesis.openapi.from_wsgi("/openapi.json", app)
    server_errors: list[str] = []
    cases: collections.Counter[str] = collections.Counter()

    for result in schema.get_all_operations():
        fuzz(result.ok(), {"Authorization": f"Bearer {admin_key}"}, cases, server_errors)

    print(f"\n{sum(cases.values())} cases over {len(cases)} operations, {len(server_errors)} server errors, "
          f"{sum(ALLOWED.values())} 400s beyond the schema; findings of the other checks:")
    for finding, count in FINDINGS.most_common():
        print(f"  {count:4d}  {finding}\n        {EXAMPLES.get(finding, '')}")
    assert not server_errors, server_errors[:10]
    assert not FINDINGS, [EXAMPLES[finding] for finding in FINDINGS][:10]


def fuzz(operation: Any, headers: dict[str, str], cases: collections.Counter[str], server_errors: list[str]) -> None:
    """`CASES_PER_OPERATION` cases of one operation: each one's status, and every check's verdict."""
    label = operation.label

    @given(case=operation.as_strategy())
    @settings(max_examples=CASES_PER_OPERATION, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case: Any) -> None:
        case.headers = {**(case.headers or {}), **headers}  # (on the case: ignored_auth then probes without it)
        response = case.call()
        cases[label] += 1
        if response.status_code >= 500:
            server_errors.append(f"{label}: {response.status_code} {response.text[:300]}")
        try:
            case.validate_response(response)  # every check schemathesis has
        except BaseExceptionGroup as found:  # schemathesis's failures of its checks
            for failure in found.exceptions:
                note(failure, response, case)
        except AssertionError as failure:
            note(failure, response, case)

    def note(failure: BaseException, response: Any, case: Any) -> None:
        kind = type(failure).__name__
        if kind == "RejectedPositiveData" and label in BEYOND_THE_SCHEMA and response.status_code == 400:
            ALLOWED[label] += 1
            return
        FINDINGS[f"{label}: {kind}"] += 1
        EXAMPLES.setdefault(f"{label}: {kind}", f"{response.status_code} {response.text[:300]} (body "
                                                f"{case.body!r:.200}, query {case.query})")

    run()
