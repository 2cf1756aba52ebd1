"""What a version loaded from a Triton model repository carries: its priority levels as SITS levels, and
its batching and queue keys on top of the `online` settings, read from the record alone."""

from __future__ import annotations

import pytest

from broker.config.settings import Settings
from broker.models.model_record import ModelRecord
from broker.models.repository import RepositoryServing
from broker.online.batching import configured


def record(**serving: object) -> ModelRecord:
    fields = {"config": {}, "max_batch_size": 8, "priority_levels": 0, "default_priority_level": 0, "online": {}}
    return ModelRecord.of({"name": "m", "version": "1", "repository": fields | serving})


@pytest.mark.parametrize(("priority", "level"), [(1, 15), (3, 13), (0, 14), (4, 14), (2**64 - 1, 14)])
def test_a_triton_priority_is_sits_level_16_minus_p_and_out_of_range_is_the_default(priority: int,
                                                                                     level: int) -> None:
    serving = RepositoryServing.of(record(priority_levels=3, default_priority_level=2))
    assert serving is not None and serving.level_of(priority) == level


def test_without_priority_levels_every_request_is_alike() -> None:
    serving = RepositoryServing.of(record())
    assert serving is not None and {serving.level_of(p) for p in (0, 1, 7)} == {0}


def test_a_registered_version_has_no_repository_settings() -> None:
    assert RepositoryServing.of(ModelRecord.of({"name": "m", "version": "abc"})) is None


def test_the_config_s_keys_go_on_top_of_the_online_settings() -> None:
    settings = Settings().with_overrides(online={"batching": {"max_batch_tokens": 100}})
    keys = {"max_batch_size": 8, "max_queue_size": 3, "timeout_action": "delay",
            "priority_levels": {"15": {"max_queue_size": 2}}}

    batching = configured(settings.online, record(online=keys))

    assert (batching.max_batch_size, batching.max_queue_size, batching.timeout_action) == (8, 3, "delay")
    assert batching.priority_levels[15].max_queue_size == 2 and batching.max_batch_tokens == 100
    assert configured(settings.online, record(online=keys)) is batching  # (made once)
    assert configured(settings.online, ModelRecord.of({"name": "m", "version": "x"})) is settings.online.batching
