"""A whole number sent as 2.0 is an integer to JSON Schema, so the API takes it as 2 where the document
says `integer`; a fraction, a string or a boolean is still refused (the bodies are strict otherwise)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.api.api_helpers import Api, error_of


def test_a_job_s_whole_numbers_may_come_as_2_0(api: Api, mlp: dict[str, Any], mlp_input: Path,
                                               tmp_path: Path) -> None:
    response = api.post("/v1/jobs", json={"model": "mlp", "input_batch": str(mlp_input), "priority": 3.0,
                                          "chunk_size": 8.0, "output_dir": str(tmp_path / "out")})

    assert response.status_code == 201, error_of(response)
    job = response.get_json()
    assert job["priority"] == 3 and job["chunk_size"] == 8


@pytest.mark.parametrize("priority", [2.5, "2", True])
def test_a_fraction_a_string_or_a_boolean_is_still_no_priority(api: Api, mlp: dict[str, Any], mlp_input: Path,
                                                                tmp_path: Path, priority: Any) -> None:
    response = api.post("/v1/jobs", json={"model": "mlp", "input_batch": str(mlp_input), "priority": priority,
                                          "output_dir": str(tmp_path / "out")})

    assert response.status_code == 400 and "priority" in error_of(response)
