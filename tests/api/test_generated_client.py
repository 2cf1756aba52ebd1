"""A Python client generated from `GET /openapi.json` (openapi-python-client) submits a job and reads it back
over HTTP: the document names the calls, the bodies and the answers well enough for a generator."""

from __future__ import annotations

import importlib
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openapi_python_client")

PACKAGE = "sits_generated_client"


@pytest.fixture
def generated_client(served_api: str, tmp_path: Path) -> Iterator[Any]:
    """The client package generated from the served document into tmp_path, imported (about 2 s)."""
    document = tmp_path / "openapi.json"
    with urllib.request.urlopen(f"{served_api}/openapi.json", timeout=10) as answer:
        document.write_bytes(answer.read())
    config = tmp_path / "generator.yaml"
    config.write_text(f"package_name_override: {PACKAGE}\npost_hooks: []\n")
    subprocess.run([sys.executable, "-m", "openapi_python_client", "generate", "--path", str(document),
                    "--meta", "none", "--output-path", str(tmp_path / PACKAGE), "--config", str(config)],
                   check=True, capture_output=True, timeout=120)
    sys.path.insert(0, str(tmp_path))
    try:
        yield importlib.import_module(PACKAGE)
    finally:
        sys.path.remove(str(tmp_path))
        for name in [name for name in sys.modules if name == PACKAGE or name.startswith(f"{PACKAGE}.")]:
            del sys.modules[name]


def test_a_generated_client_submits_a_job_and_reads_it_back(generated_client: Any, served_api: str, admin_key: str,
                                                            mlp: dict[str, Any], mlp_input: Path,
                                                            tmp_path: Path) -> None:
    api = importlib.import_module(f"{PACKAGE}.api.default")
    types = importlib.import_module(f"{PACKAGE}.models")
    client = generated_client.AuthenticatedClient(base_url=served_api, token=admin_key)
    submission = types.JobSubmission(model="mlp", input_batch=str(mlp_input), output_dir=str(tmp_path / "out"))

    submit = importlib.import_module(f"{api.__name__}.post_v1_jobs")
    get_job = importlib.import_module(f"{api.__name__}.get_v1_jobs_job_id")

    answer = submit.sync_detailed(client=client, body=submission)
    assert answer.status_code == 201, answer.content
    submitted = answer.parsed
    read = get_job.sync(submitted.id, client=client)
    unknown = get_job.sync("j000000000000", client=client)

    assert isinstance(submitted, types.Job) and isinstance(read, types.Job)
    assert (read.id, read.model, read.model_version, read.status) == (submitted.id, "mlp", mlp["version"], "queued")
    assert read.rows_total == 10 and read.output_dir == str(tmp_path / "out")
    assert isinstance(unknown, types.Error) and unknown.code == "job_not_found"
