"""`sitsctl repository index|load|unload` against the real app served over HTTP, over the session's real
Redis, with Triton's `simple` example and a model whose config Triton refuses in its repository."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from broker.config.settings import Settings
from broker.state.embedded import EmbeddedRedis
from broker.state.store import Store
from sits_api.cli.main import cli
from tests.api.api_helpers import make_settings
from tests.waiting import eventually

SIMPLE = Path(__file__).parents[2] / "fixtures" / "triton" / "model_repository" / "simple"


@pytest.fixture
def settings(redis_server: EmbeddedRedis, store: Store, tmp_path: Path, zoo_dir: Path) -> Settings:
    """The API's settings with a repository of `simple` and `broken` (its max_batch_size negative)."""
    root = tmp_path / "model_repository"
    shutil.copytree(SIMPLE, root / "simple")
    shutil.copytree(SIMPLE, root / "broken")
    (root / "broken" / "config.pbtxt").write_text("max_batch_size: -3\n")
    return make_settings(redis_server, store, tmp_path, zoo_dir).with_overrides(repository={"paths": [root]})


def sitsctl(*args: str, api_url: str, api_key: str) -> Result:
    env = {"SITS_API_URL": api_url, "SITS_API_KEY": api_key, "SITS_HOME": None, "SITS_CONFIG": None,
           "SITS_REDIS_URL": None}
    return CliRunner().invoke(cli, list(args), env=env)


def test_index_unload_and_load_from_the_command_line(served_api: str, admin_key: str) -> None:
    def index() -> list[dict]:
        result = sitsctl("repository", "index", "--json", api_url=served_api, api_key=admin_key)
        assert result.exit_code == 0, result.output
        return list(json.loads(result.output))

    def both_loaded() -> list[dict] | None:
        entries = index()
        return entries if len(entries) == 2 else None

    loaded = eventually(both_loaded, timeout=30)
    assert loaded
    assert {"name": "simple", "version": "1", "state": "READY", "reason": ""} in loaded
    assert {"name": "broken", "state": "UNAVAILABLE",
            "reason": "'max_batch_size' must be non-negative value for broken"} in loaded

    unloaded = sitsctl("repository", "unload", "simple", api_url=served_api, api_key=admin_key)
    assert unloaded.exit_code == 0 and "unloaded simple" in unloaded.output
    assert {"name": "simple", "state": "UNAVAILABLE", "reason": "unloaded"} in index()
    assert sitsctl("repository", "load", "simple", api_url=served_api, api_key=admin_key).exit_code == 0
    table = sitsctl("repository", "index", api_url=served_api, api_key=admin_key).output
    assert "READY" in table and "max_batch_size" in table

    refused = sitsctl("repository", "load", "broken", api_url=served_api, api_key=admin_key)
    assert refused.exit_code != 0 and "'max_batch_size' must be non-negative value for broken" in refused.output


def test_up_takes_model_repositories() -> None:
    result = CliRunner().invoke(cli, ["up", "--help"])
    assert "--model-repository" in result.output
