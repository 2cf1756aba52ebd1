"""A tenant racing the API with a folder it swaps for a link to another tenant's folder (each tenant's
keys read and write only its own folder under each root, the default)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flask.testing import FlaskClient

from broker.state.store import Store
from broker.tenants.apikeys import create_api_key
from tests.api.api_helpers import Api


def test_a_folder_swapped_for_another_tenant_s_during_a_submit_never_lets_its_file_be_read(
        client: FlaskClient, store: Store, api: Api, mlp: dict[str, Any], tmp_path: Path) -> None:
    """The race a tenant can run in its own folder: a real folder and a link to another tenant's folder
    swapped over and over (renameat2 RENAME_EXCHANGE) while it submits jobs naming a file in the real
    one. The path checks out resolved; what is then read must be that folder's file, never the other
    tenant's (its rows would make the job, its checksum show in the answer)."""
    import ctypes
    import threading

    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "renameat2"):
        pytest.skip("no renameat2 in this C library")
    secret = tmp_path / "bob" / "private"
    secret.mkdir(parents=True)
    np.save(secret / "data.npy", np.full((777, 64), 42.0, np.float32))
    mine, link = tmp_path / "alice" / "d", tmp_path / "alice" / "dl"
    mine.mkdir(parents=True)
    np.save(mine / "data.npy", np.zeros((5, 64), np.float32))
    link.symlink_to(secret)
    alice = Api(client, create_api_key(store, "alice-racer", "user", tenant="alice"))
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            libc.renameat2(-100, str(mine).encode(), -100, str(link).encode(), 2)  # AT_FDCWD, RENAME_EXCHANGE

    swapper = threading.Thread(target=swap, daemon=True)
    swapper.start()
    rows = []
    try:
        for n in range(150):
            answer = alice.post("/v1/jobs", json={"model": "mlp", "input_batch": str(mine / "data.npy"),
                                                  "output_dir": str(tmp_path / "alice" / f"out{n}")})
            assert answer.status_code != 500, answer.get_json()  # (a 503 "changed while read" is fair)
            if answer.status_code == 201:
                rows.append(answer.get_json()["rows_total"])
                alice.delete(f"/v1/jobs/{answer.get_json()['id']}")
    finally:
        stop.set()
        swapper.join(timeout=5)

    assert 777 not in rows, "a job was made from the other tenant's file"
