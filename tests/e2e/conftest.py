"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sits_api.cli.stack import Stack
from tests.e2e.stack_helpers import register, start_stack


@pytest.fixture(scope="module")
def mlp_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A stack of one CPU worker (two stream slots) with the zoo's mlp registered, for the module's tests."""
    from sits_worker.model.zoo import build_zoo

    home = tmp_path_factory.mktemp("mlp-stack") / "home"
    running = start_stack(home, workers=1, streams=2)
    register(running.client(), "mlp", build_zoo(home / "models")["mlp"])
    yield running
    running.stop()
