"""Settings load from defaults, a YAML file and SITS_* variables; anything invalid is a ConfigError."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import pytest
from pydantic import BaseModel

from broker.config.loading import load_settings
from broker.config.settings import Settings
from broker.errors import ConfigError
from broker.setting_types import parse_duration, parse_size


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sits-config.yaml"
    path.write_text(text)
    return path


# --- defaults -------------------------------------------------------------------------


def test_defaults_apply_without_file_or_environment() -> None:
    settings = load_settings(environ={})

    assert settings.scheduler.policy == "graph-aware-backfill"
    assert settings.scheduler.fallback_strategy == "cpu-offload-on-oom"
    assert settings.scheduler.lease_timeout == 60.0
    assert settings.scheduler.model_profile_cache_ttl == 3600.0
    assert settings.resources.gpu_memory_granularity == 128 * 1024 * 1024
    assert settings.resources.max_concurrent_streams == 4
    assert settings.redis.url == ""
    assert settings.redis.key_prefix == "sits"
    assert settings.redis.appendonly is True
    assert settings.jobs.max_attempts == 3
    assert settings.api.public_url() == "http://127.0.0.1:8470"


def test_loading_with_no_file_ignores_unrelated_environment_variables() -> None:
    settings = load_settings(environ={"HOME": "/root", "SITS_API_KEY": "sits_secret", "PATH": "/bin"})

    assert settings == load_settings(environ={})


def test_default_home_is_expanded_to_an_absolute_path() -> None:
    settings = load_settings(environ={})

    assert settings.paths.home.is_absolute()
    assert "~" not in str(settings.paths.home)


# --- the YAML file ------------------------------------------------------------------------


def test_yaml_file_values_override_defaults(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        "scheduler:\n"
        "  policy: graph-aware-backfill\n"
        "  lease_timeout: 90s\n"
        "resources:\n"
        "  gpu_memory_granularity: 256MiB\n"
        "  max_concurrent_streams: 8\n"
        "jobs:\n"
        "  chunk_size: 100\n",
    )

    settings = load_settings(path, environ={})

    assert settings.scheduler.policy == "graph-aware-backfill"
    assert settings.scheduler.lease_timeout == 90.0
    assert settings.resources.gpu_memory_granularity == 256 * 1024 * 1024
    assert settings.resources.max_concurrent_streams == 8
    assert settings.jobs.chunk_size == 100
    assert settings.jobs.batch_size == "auto"  # untouched keys keep their defaults


def test_sits_config_variable_names_the_file(tmp_path: Path) -> None:
    path = write_config(tmp_path, "scheduler:\n  policy: round-robin\n")

    settings = load_settings(environ={"SITS_CONFIG": str(path)})

    assert settings.scheduler.policy == "round-robin"


def test_empty_yaml_file_gives_defaults(tmp_path: Path) -> None:
    path = write_config(tmp_path, "")

    assert load_settings(path, environ={}) == load_settings(environ={})


def test_missing_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings(tmp_path / "nope.yaml", environ={})


def test_config_file_that_is_not_a_mapping_is_rejected(tmp_path: Path) -> None:
    path = write_config(tmp_path, "- scheduler\n- redis\n")

    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_settings(path, environ={})


def test_malformed_yaml_is_rejected(tmp_path: Path) -> None:
    path = write_config(tmp_path, "scheduler: [unclosed\n")

    with pytest.raises(ConfigError, match="not valid YAML") as refused:
        load_settings(path, environ={})

    assert refused.value.message.startswith(f"config file {path} is not valid YAML at line 2, column 1: ")
    assert "\n" not in refused.value.message  # one line, naming the file (not "<unicode string>")


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"\x00\xff\xfe")

    with pytest.raises(ConfigError, match=rf"config file {path} is not UTF-8 text \(byte 0xff at offset 1\)"):
        load_settings(path, environ={})


# --- unknown keys and bad values ------------------------------------------------------


def test_misspelt_key_is_rejected_with_its_dotted_name(tmp_path: Path) -> None:
    path = write_config(tmp_path, "scheduler:\n  polcy: fifo\n")

    with pytest.raises(ConfigError) as caught:
        load_settings(path, environ={})

    assert "scheduler.polcy" in caught.value.message
    assert "unknown key" in caught.value.message
    assert str(path) in caught.value.message


def test_unknown_section_is_rejected(tmp_path: Path) -> None:
    path = write_config(tmp_path, "schedular:\n  policy: fifo\n")

    with pytest.raises(ConfigError, match=r"schedular: unknown key"):
        load_settings(path, environ={})


def test_invalid_policy_name_is_rejected(tmp_path: Path) -> None:
    path = write_config(tmp_path, "scheduler:\n  policy: shortest-job-first\n")

    with pytest.raises(ConfigError, match=r"scheduler\.policy"):
        load_settings(path, environ={})


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("resources", "gpu_memory_granularity", "12XB"),
        ("resources", "device_memory", "-1GiB"),
        ("scheduler", "lease_timeout", "-3s"),
        ("scheduler", "lease_timeout", "3 fortnights"),
        ("api", "max_body_bytes", "lots"),
    ],
)
def test_bad_units_are_rejected_naming_the_key(tmp_path: Path, section: str, key: str, value: str) -> None:
    path = write_config(tmp_path, f"{section}:\n  {key}: '{value}'\n")

    with pytest.raises(ConfigError) as caught:
        load_settings(path, environ={})

    assert f"{section}.{key}" in caught.value.message
    assert value in caught.value.message


def test_out_of_range_integer_is_rejected(tmp_path: Path) -> None:
    path = write_config(tmp_path, "resources:\n  max_concurrent_streams: 0\n")

    with pytest.raises(ConfigError, match=r"resources\.max_concurrent_streams"):
        load_settings(path, environ={})


@pytest.mark.parametrize(
    "text",
    ["scheduler:\n  lease_timeout:\n", "resources:\n  device_memory: 1.5\n"],
    ids=["empty-duration", "float-size"],
)
def test_non_string_unit_values_are_config_errors(tmp_path: Path, text: str) -> None:
    path = write_config(tmp_path, text)

    with pytest.raises(ConfigError):
        load_settings(path, environ={})


def _number_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted names of every int or float setting of `model` (sizes, durations, counts or 'auto' included)."""
    keys = []
    for name, field in model.model_fields.items():
        types = get_args(field.annotation) or (field.annotation,)
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            keys += _number_keys(field.annotation, f"{prefix}{name}.")
        elif int in types or float in types:
            keys.append(f"{prefix}{name}")
    return keys


@pytest.mark.parametrize("key", _number_keys(Settings))
@pytest.mark.parametrize("boolean", ["true", "false"])
def test_a_boolean_for_a_number_setting_is_a_config_error_naming_the_key(tmp_path: Path, key: str,
                                                                         boolean: str) -> None:
    *sections, name = key.split(".")
    path = write_config(tmp_path, "".join(f"{'  ' * depth}{section}:\n" for depth, section in enumerate(sections))
                        + f"{'  ' * len(sections)}{name}: {boolean}\n")

    with pytest.raises(ConfigError) as caught:
        load_settings(path, environ={})

    assert f"{key}: " in caught.value.message
    assert boolean.title() in caught.value.message  # the value refused, as the message quotes it


@pytest.mark.parametrize("key", ["max_batch_tokens", "queue_capacity"])
def test_a_boolean_for_a_model_batching_count_says_it_is_a_boolean(tmp_path: Path, key: str) -> None:
    path = write_config(tmp_path, f"online:\n  models:\n    mlp: {{{key}: yes}}\n")

    with pytest.raises(ConfigError, match=rf"online\.models\.mlp\.{key}: .*True is a boolean, not a number"):
        load_settings(path, environ={})


def test_numbers_from_the_environment_are_still_read_from_strings() -> None:
    settings = load_settings(environ={"SITS_API__PORT": "9000", "SITS_ONLINE__BATCHING": "{queue_capacity: 64}",
                                      "SITS_SCHEDULER__MERGE_LATENCY_FACTOR": "2.5"})

    assert settings.api.port == 9000
    assert settings.online.batching.queue_capacity == 64
    assert settings.scheduler.merge_latency_factor == 2.5


def test_with_overrides_validates_like_a_file() -> None:
    settings = Settings().with_overrides(scheduler={"policy": "round-robin", "lease_timeout": "2m"})

    assert settings.scheduler.policy == "round-robin"
    assert settings.scheduler.lease_timeout == 120.0
    with pytest.raises(ConfigError, match=r"scheduler\.polcy"):
        Settings().with_overrides(scheduler={"polcy": "fifo"})


def test_settings_are_frozen() -> None:
    settings = load_settings(environ={})

    with pytest.raises(Exception, match="frozen"):
        settings.scheduler.policy = "round-robin"  # type: ignore[misc]


# --- environment overrides ---------------------------------------------------------------


def test_section_key_variable_overrides_the_file(tmp_path: Path) -> None:
    path = write_config(tmp_path, "scheduler:\n  policy: fifo\n  lease_timeout: 30s\n")

    settings = load_settings(path, environ={"SITS_SCHEDULER__POLICY": "round-robin"})

    assert settings.scheduler.policy == "round-robin"
    assert settings.scheduler.lease_timeout == 30.0  # the file's other keys stay


def test_redis_url_variable_sets_the_redis_url() -> None:
    settings = load_settings(environ={"SITS_REDIS_URL": "redis://redis.internal:6380/2"})

    assert settings.redis.url == "redis://redis.internal:6380/2"


def test_environment_values_are_parsed_with_units() -> None:
    settings = load_settings(
        environ={
            "SITS_SCHEDULER__LEASE_TIMEOUT": "250ms",
            "SITS_RESOURCES__DEVICE_MEMORY": "2GB",
            "SITS_JOBS__MAX_ATTEMPTS": "5",
            "SITS_REDIS__APPENDONLY": "false",
        }
    )

    assert settings.scheduler.lease_timeout == 0.25
    assert settings.resources.device_memory == 2_000_000_000
    assert settings.jobs.max_attempts == 5
    assert settings.redis.appendonly is False


def test_invalid_policy_from_environment_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"scheduler\.policy"):
        load_settings(environ={"SITS_SCHEDULER__POLICY": "lifo"})


def test_misspelt_environment_key_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"scheduler\.polcy: unknown key"):
        load_settings(environ={"SITS_SCHEDULER__POLCY": "fifo"})


def test_a_list_variable_that_is_not_yaml_is_a_config_error_naming_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"SITS_PATHS__INPUT_ROOTS='\[/a' is not a valid YAML list or mapping"):
        load_settings(environ={"SITS_PATHS__INPUT_ROOTS": "[/a"})


def test_errors_from_variables_name_the_variable_not_the_file(tmp_path: Path) -> None:
    path = write_config(tmp_path, "scheduler:\n  policy: fifo\n")

    with pytest.raises(ConfigError) as unknown_section:
        load_settings(path, environ={"SITS_FOO__BAR": "1"})
    with pytest.raises(ConfigError) as bad_value:
        load_settings(path, environ={"SITS_SCHEDULER__LEASE_TIMEOUT": "soon"})
    with pytest.raises(ConfigError) as both:
        load_settings(write_config(tmp_path, "scheduler:\n  polcy: fifo\n"), environ={"SITS_API__PORT": "-1"})

    assert unknown_section.value.message == "invalid configuration in SITS_FOO__BAR: foo: unknown key"
    assert bad_value.value.message.startswith("invalid configuration in SITS_SCHEDULER__LEASE_TIMEOUT: "
                                              "scheduler.lease_timeout: ")
    assert str(path) not in unknown_section.value.message + bad_value.value.message
    assert "scheduler.polcy: unknown key (in " + str(path) + ")" in both.value.message
    assert "api.port: Input should be greater than or equal to 0 (in SITS_API__PORT)" in both.value.message


def test_a_check_across_a_section_s_keys_names_both_the_variables_and_the_file(tmp_path: Path) -> None:
    """The file's ticket_linger breaks the check against ticket_timeout; the variable only set another key."""
    path = write_config(tmp_path, "scheduler:\n  ticket_linger: 40s\n  ticket_timeout: 30s\n")

    with pytest.raises(ConfigError) as across:
        load_settings(path, environ={"SITS_SCHEDULER__POLICY": "fifo"})

    assert across.value.message.startswith(f"invalid configuration in SITS_SCHEDULER__POLICY, {path}: scheduler")


def test_numeric_looking_string_setting_from_environment_stays_a_string() -> None:
    settings = load_settings(environ={"SITS_REDIS__KEY_PREFIX": "2024"})

    assert settings.redis.key_prefix == "2024"


# --- unit parsing -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("3600s", 3600.0),
        ("250ms", 0.25),
        ("5m", 300.0),
        ("2h", 7200.0),
        ("1d", 86400.0),
        ("1.5s", 1.5),
        ("42", 42.0),
        (30, 30.0),
        (" 10 S ", 10.0),
    ],
)
def test_durations_are_parsed_to_seconds(text: str | int, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("128MiB", 134_217_728),
        ("2GB", 2_000_000_000),
        ("1KiB", 1024),
        ("16GiB", 16 * 1024**3),
        ("1.5KiB", 1536),
        ("4096", 4096),
        (4096, 4096),
        ("3b", 3),
    ],
)
def test_sizes_are_parsed_to_bytes(text: str | int, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["12XB", "-3", "MiB", "", "1e3B"])
def test_bad_sizes_are_rejected_naming_the_units(text: str) -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


@pytest.mark.parametrize("text", ["-3s", "3 weeks", "s", "1,5s"])
def test_bad_durations_are_rejected_naming_the_units(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


def test_negative_numbers_are_rejected() -> None:
    with pytest.raises(ValueError, match="negative"):
        parse_duration(-1)
    with pytest.raises(ValueError, match="negative"):
        parse_size(-1)


# --- the shipped file and per-model batching ----------------------------------------------


def _keys(value: object, prefix: str = "") -> set[str]:
    if isinstance(value, dict):
        return {key for name, item in value.items() for key in _keys(item, f"{prefix}{name}.")} or {prefix}
    return {prefix.rstrip(".")}


def test_shipped_config_file_documents_every_key_at_its_default() -> None:
    import yaml

    shipped = Path(__file__).resolve().parents[3] / "sits-config.yaml"
    loaded = load_settings(path=shipped, environ={})
    defaults = Settings().model_dump(mode="json")
    documented = _keys(yaml.safe_load(shipped.read_text()))

    assert loaded.model_dump(mode="json", exclude={"paths"}) == Settings().model_dump(mode="json", exclude={"paths"})
    assert documented >= _keys(defaults) - {"online.models", "paths.model_store"}


def test_a_model_batching_override_keeps_the_other_keys_of_online_batching(tmp_path: Path) -> None:
    path = write_config(tmp_path, "online:\n  batching: {max_batch_size: 8, max_queue_delay: 5ms}\n"
                                  "  models: {transformer: {max_batch_tokens: 64}}\n")
    online = load_settings(path=path, environ={}).online

    assert online.batching_for("transformer").model_dump() == {
        "max_batch_size": 8, "max_queue_delay": 0.005, "preferred_batch_sizes": (), "max_batch_latency": 0.05,
        "max_batch_tokens": 64, "queue_capacity": 1024, "streams": None, "closed_loop": False, "target_p99": 0.12,
        "max_queue_size": 4096, "default_timeout": 0.0,
        "timeout_action": "reject", "allow_timeout_override": True, "priority_levels": {}}
    assert online.batching_for("mlp") == online.batching


def test_the_celery_queue_is_the_key_prefix_so_two_deployments_on_one_redis_keep_their_tasks_apart() -> None:
    from sits_worker.celery_app import celery_config

    ours = load_settings(environ={"SITS_REDIS__KEY_PREFIX": "teamb", "SITS_REDIS_URL": "redis://127.0.0.1:1/0"})

    assert ours.redis.task_queue == "teamb" and Settings().redis.task_queue == "sits"
    assert celery_config(ours)["task_default_queue"] == "teamb"
