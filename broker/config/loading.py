"""Loading the settings: `sits-config.yaml`, then `SITS_*` variables, each problem blamed on its source.

Environment overrides: `SITS_CONFIG` (the file), `SITS_REDIS_URL`,
`SITS_HOME`, `SITS_API_URL`, and `SITS_<SECTION>__<KEY>` for any key
(e.g. `SITS_SCHEDULER__POLICY=fifo`). Only a process's edge calls
`load_settings`; everything else is passed the `Settings` it returns.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from broker.config.settings import Settings, validate_settings
from broker.errors import ConfigError

_ENV_SHORTCUTS = {
    "SITS_REDIS_URL": ("redis", "url"),
    "SITS_HOME": ("paths", "home"),
    "SITS_API_URL": ("api", "url"),
}


def load_settings(path: Path | str | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Settings from `path` (or `$SITS_CONFIG`), then `SITS_*` overrides from `environ`.

    A missing explicit file is an error; with no file at all the defaults apply. An invalid value is
    blamed on where it came from: the file, or the `SITS_*` variable that set it.
    """
    env = os.environ if environ is None else environ
    path = path or env.get("SITS_CONFIG") or None
    data: dict[str, Any] = {}
    source = "defaults"
    if path:
        source = str(path)
        data = _read_config_file(Path(path))
    variables: dict[tuple[str, str], str] = {}  # (section, key) -> the SITS_* variable that set it
    for name, value in env.items():
        if name in _ENV_SHORTCUTS:
            section, key = _ENV_SHORTCUTS[name]
        elif name.startswith("SITS_") and "__" in name:
            section, _, key = name[len("SITS_") :].lower().partition("__")
        else:
            continue
        section_data = data.setdefault(section, {})
        if not isinstance(section_data, dict):
            raise ConfigError(f"{source}: section '{section}' must be a mapping (so {name} cannot set a key in it)")
        section_data[key] = _variable_value(name, value)
        variables[(section, key)] = name
    return validate_settings(data, source=source, variables=variables)


def _read_config_file(path: Path) -> dict[str, Any]:
    """The mapping of sections in a YAML file; ConfigError for one that cannot be read or is not one."""
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror}") from err
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset "
                          f"{err.start}): give a YAML file saved as UTF-8") from err
    try:
        loaded = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"config file {path} is not valid YAML{where}: {problem}") from err
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(loaded).__name__}")
    return loaded


def _variable_value(name: str, value: str) -> Any:
    """A SITS_* variable's value: lists and mappings are YAML ("[/data, /models]"); scalars stay strings
    and pydantic converts them, so a key prefix "2024" or "on" is not turned into a number or a bool."""
    if not value.lstrip().startswith(("[", "{")):
        return value
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{name}={value!r} is not a valid YAML list or mapping ({problem}): write one like "
                          "'[/data, /models]' or '{key: value}'") from err

