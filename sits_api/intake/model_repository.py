"""A Triton model repository, served as it is: scan, load, unload and index, as plain functions.

Each folder under a `repository.paths` root is a model of that name; its numbered subfolders are
versions, of which the config's `version_policy` selects some. A model loads whole or not at all: its
`config.pbtxt` is parsed with Triton's protobuf and checked as Triton checks it
(`sits_worker.model.triton_config`), completed from and checked against each selected version's
graph (`sits_worker.model.triton_autofill`), then each version is registered as `name@<number>`
with the config as loaded in its record (`services.register_repository_version`). A refusal leaves
that model UNAVAILABLE with the reason, which names the field, and the rest of the repository loads.

The HTTP routes (`sits_api.v2.repository`) and the CLI (`sitsctl repository`) call these; a gRPC
servicer calls them the same way: `repository_index(store, ready_only)`, `load_model(settings,
store, name, now=...)`, `unload_model(store, name, now=...)`.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import pydantic

from broker.config.settings import Settings
from broker.errors import BadInput, ModelNotFound, SitsError
from broker.models import registry
from broker.models.repository import (
    RepositoryModel,
    RepositoryServing,
    get_state,
    list_states,
    remove_versions,
    save_state,
)
from broker.online.settings import ModelBatching
from broker.state.store import Store, translate_redis_errors
from sits_api.intake import services
from sits_worker.model.graph import model_signature
from sits_worker.model.loading import load_model_checked
from sits_worker.model.triton_autofill import complete_config, online_settings, refuse_unhonoured, select_versions
from sits_worker.model.triton_config import check_config, config_json, parse_config

log = logging.getLogger(__name__)
CONFIG_FILE = "config.pbtxt"
LOAD_LOCK_SECONDS = 600
"""How long one API process holds the right to load the repository at start (the others skip it)."""


def model_folders(paths: tuple[Path, ...]) -> dict[str, list[Path]]:
    """Model name -> its folders under the repository roots `paths` (more than one: refused at load)."""
    folders: dict[str, list[Path]] = {}
    for root in paths:
        if not root.is_dir():
            continue
        for folder in sorted(root.iterdir()):
            if folder.is_dir() and not folder.name.startswith("."):
                folders.setdefault(folder.name, []).append(folder)
    return folders


def version_folders(folder: Path) -> dict[int, Path]:
    """Version number -> folder: the subfolders named by a number, as Triton reads them."""
    return {int(child.name): child for child in folder.iterdir() if child.is_dir() and child.name.isdigit()}


def load_repository(settings: Settings, store: Store, *, now: float) -> list[RepositoryModel]:
    """Load every model of `repository.paths`; each one's state as it ends."""
    return [_load_folders(settings, store, name, folders, now=now)
            for name, folders in model_folders(settings.repository.paths).items()]


def load_model(settings: Settings, store: Store, name: str, *, now: float) -> RepositoryModel:
    """Load (or load again) the repository model `name`: READY, or UNAVAILABLE with its reason, which
    BadInput also raises (Triton answers a failed load with an error). ModelNotFound when no root holds it."""
    folders = model_folders(settings.repository.paths).get(name)
    if not folders:
        roots = ", ".join(str(root) for root in settings.repository.paths) or "none (set repository.paths)"
        raise ModelNotFound(f"failed to load '{name}': no model folder '{name}' in the model repository ({roots})")
    serving = get_state(store, name)
    entry = _load_folders(settings, store, name, folders, now=now,
                          serving=serving if serving is not None and serving.state == "READY" else None)
    if entry.state != "READY" or entry.reason:
        raise BadInput(f"failed to load '{name}': {entry.reason}")
    return entry


def unload_model(store: Store, name: str, *, now: float) -> RepositoryModel:
    """Unload the repository model `name`: its versions leave the registry, and it is UNLOADED until
    loaded again. ModelNotFound for a name no repository load has seen."""
    entry = get_state(store, name)
    if entry is None:
        raise ModelNotFound(f"failed to unload '{name}': it is not a model of the model repository")
    remove_versions(store, name, keep=[])
    unloaded = RepositoryModel(name=name, state="UNLOADED", reason="unloaded", folder=entry.folder, updated_at=now)
    save_state(store, unloaded)
    return unloaded


def repository_index(store: Store, ready_only: bool = False) -> list[dict[str, Any]]:
    """The repository index as Triton answers it: one entry per loaded version ({name, version, state,
    reason}), and one per model without a loaded version ({name, state, reason})."""
    index: list[dict[str, Any]] = []
    for entry in list_states(store):
        if ready_only and entry.state != "READY":
            continue
        shown = "UNAVAILABLE" if entry.state == "UNLOADED" else entry.state  # (Triton's name for it)
        if entry.versions:
            index += [{"name": entry.name, "version": version, "state": shown, "reason": entry.reason}
                      for version in entry.versions]
        else:
            index.append({"name": entry.name, "state": shown, "reason": entry.reason})
    return index


def _load_folders(settings: Settings, store: Store, name: str, folders: list[Path], *, now: float,
                  serving: RepositoryModel | None = None) -> RepositoryModel:
    """Load one model; a refusal leaves it UNAVAILABLE with the reason (and none of its versions registered),
    unless it is a load again of a model `serving` now: then, as in Triton, the versions it serves stay
    READY, and the entry says why the new load failed."""
    try:
        if len(folders) > 1:
            raise BadInput(f"model '{name}' appears in multiple repositories: "
                           + ", ".join(str(folder.parent) for folder in folders))
        versions = _load(settings, store, name, folders[0], now=now)
    except SitsError as err:
        if serving is not None:
            log.warning("repository model %s was not loaded again, its versions stay: %s", name, err.message)
            kept = RepositoryModel(name=name, state="READY", versions=serving.versions, folder=serving.folder,
                                   updated_at=now, reason=f"a load again failed, its versions stay: {err.message}")
            save_state(store, kept)
            return kept
        log.warning("repository model %s is unavailable: %s", name, err.message)
        remove_versions(store, name, keep=[])
        entry = RepositoryModel(name=name, state="UNAVAILABLE", reason=err.message, folder=str(folders[0]),
                                updated_at=now)
    else:
        entry = RepositoryModel(name=name, state="READY", versions=versions, folder=str(folders[0]), updated_at=now)
    save_state(store, entry)
    return entry


def _load(settings: Settings, store: Store, name: str, folder: Path, *, now: float) -> list[str]:
    """Check the config, then every selected version against it, then register them all; the versions."""
    _refuse_a_registered_name(store, name)
    config_path = folder / CONFIG_FILE
    config = parse_config(config_path.read_text() if config_path.is_file() else None, name)
    check_config(config)
    available = version_folders(folder)
    filename = config.default_model_filename or "model.onnx"
    checked = []
    for version in select_versions(config, list(available)):
        source = available[version] / filename
        if not source.is_file():
            raise BadInput(f"version {version} of model '{name}' has no {filename} (default_model_filename)")
        model = load_model_checked(source, (folder,), max_bytes=settings.models.max_file_size)
        loaded = complete_config(config, model_signature(model))
        refuse_unhonoured(loaded)
        serving = _serving(settings, loaded)
        checked.append((str(version), source, model, loaded, serving))
    for version, source, model, loaded, serving in checked:
        services.register_repository_version(settings, store, model, name=name, version=version, source=source,
                                             fields={"repository": serving.to_json()}, now=now,
                                             batches=loaded.max_batch_size > 0)
    remove_versions(store, name, keep=[version for version, *_ in checked])
    return [version for version, *_ in checked]


def _serving(settings: Settings, loaded: Any) -> RepositoryServing:
    """What SITS takes from a loaded config; its batching keys checked as the `online` settings are."""
    online = online_settings(loaded)
    try:
        ModelBatching.model_validate({**settings.online.batching_for(loaded.name).model_dump(), **online})
    except pydantic.ValidationError as err:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors())
        raise BadInput(f"model '{loaded.name}': its dynamic_batching cannot be SITS's batching ({problems})") from None
    batching = loaded.dynamic_batching
    return RepositoryServing(config=config_json(loaded), max_batch_size=loaded.max_batch_size,
                             priority_levels=batching.priority_levels,
                             default_priority_level=batching.default_priority_level, online=online)


def _refuse_a_registered_name(store: Store, name: str) -> None:
    """A name registered through `POST /v1/models` stays that registration's: the repository does not take it."""
    versions = registry.list_model_versions(store, name)
    if any(RepositoryServing.of(record) is None for record in versions):
        raise BadInput(f"model name '{name}' is registered through POST /v1/models; rename the repository's folder "
                       "or delete that registration")


def load_at_start(settings: Settings, store: Store) -> threading.Thread | None:
    """Load `repository.paths` in a thread of this API process, unless another process of the API is
    loading it (the first to take the lock loads; it is let go when done). None without a repository."""
    if not settings.repository.paths:
        return None
    try:
        with translate_redis_errors():
            taken = store.client.set(store.keys.model_repository_lock, str(time.time()), nx=True,
                                     ex=LOAD_LOCK_SECONDS)
    except SitsError as err:
        log.warning("the model repository is not loaded: %s", err.message)
        return None
    if not taken:
        return None

    def load() -> None:
        try:
            for entry in load_repository(settings, store, now=time.time()):
                log.info("repository model %s: %s %s", entry.name, entry.state, entry.reason)
        except SitsError as err:
            log.warning("loading the model repository stopped: %s", err.message)
        finally:
            try:
                with translate_redis_errors():
                    store.client.delete(store.keys.model_repository_lock)
            except SitsError:
                pass  # (it expires)

    thread = threading.Thread(target=load, name="model-repository", daemon=True)
    thread.start()
    return thread
