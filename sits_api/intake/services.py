"""What the API's views do, as plain functions: register models, submit and steer jobs.

No Flask here: views parse the body,
call one of these and map the result. Every path a request names is
checked against the configured roots before anything reads or writes it.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from broker.config.settings import Settings
from broker.errors import (
    BadInput,
    Conflict,
    DeadlineInfeasible,
    Forbidden,
    PathNotAllowed,
    QueueFull,
    RetryableError,
    SitsError,
)
from broker.jobs import chunking, output_dirs, tenant_quotas
from broker.jobs import fills as job_fills
from broker.jobs import progress as job_progress
from broker.jobs import records as jobs
from broker.jobs import stops as job_stops
from broker.jobs.job_record import JobRecord
from broker.jobs.output_layout import (
    MANIFEST_NAME,
    TABLE_OUTPUT_NAME,
    TABLE_ROW_COLUMN,
    chunks_with_parts,
    output_path,
    read_manifest,
)
from broker.models import registry
from broker.models.model_record import ModelRecord
from broker.models.repository import get_state
from broker.monitoring import sla_metrics
from broker.online.batching import Batching, configured, resolve
from broker.queueing import policy
from broker.sla import figures
from broker.state.store import Store
from broker.tenants import usage as tenant_usage
from broker.tenants.apikeys import owns
from broker.tenants.records import TenantTable
from broker.tenants.roots import FileKind, Roots, roots_for
from broker.tenants.settings import Tenant
from broker.tuning import live
from sits_api.intake import job_deadlines, model_checks
from sits_api.intake.task_sender import Dispatcher
from sits_api.schemas import JobSubmission, ModelRegistration
from sits_api.tenancy import ab_routes, tenant_gate
from sits_worker.model.batch_probe import check_rows_independent
from sits_worker.model.graph import model_signature, static_profile
from sits_worker.model.inputs import file_checksum, open_input
from sits_worker.model.padding import mask_spec, token_limits
from sits_worker.model.safe_files import open_folder
from sits_worker.model.servable import check_runtime_loads, check_servable
from sits_worker.model.source import file_identity


def resolve_inside(path_text: str, roots: Roots, what: str) -> Path:
    """The resolved `path_text`; PathNotAllowed unless it lies inside one of `roots` (the caller's:
    `caller_roots`).

    The path as written is checked first, by its text alone (`..` folded, no `~` expanded): one outside
    the roots is refused before anything on disk is looked at, so the answer tells nothing of another
    tenant's folders, of the host's users, or of whether a file exists. Only then is it resolved
    (symbolic links followed) and checked again; one that leads outside is refused without saying where
    it leads, and so is one that cannot be resolved (a loop)."""
    if "\x00" in path_text:
        raise BadInput(f"{what} path {path_text!r} holds a NUL byte; give the path of a file")
    written = Path(os.path.normpath(os.path.join(os.getcwd(), path_text)))
    allowed = ", ".join(str(root) for root in roots.folders) or "none"
    outside = PathNotAllowed(f"{what} {written} is outside this key's {what} roots ({allowed}); "
                             f"move it there, or have an admin set {roots.setting}")
    if not roots.holds(written):
        raise outside
    through_link = PathNotAllowed(f"{what} {written} leads outside this key's {what} roots ({allowed}) through a "
                                  f"symbolic link, or cannot be followed; give the path of the file itself")
    try:
        path = written.resolve()
    except (ValueError, RuntimeError, OSError):  # a loop of links, or one too long to follow
        raise through_link from None
    if not roots.holds(path):
        raise through_link
    return path


def caller_roots(settings: Settings, tenants: TenantTable, store: Store, caller: dict[str, Any],
                 kind: FileKind) -> Roots:
    """The roots of `kind` the `caller` key's paths must lie in (`broker/tenants/roots.py`)."""
    name = tenant_gate.tenant_of(caller)
    return roots_for(kind, global_roots=getattr(settings.paths, f"{kind}_roots"), tenant_name=name,
                     tenant=tenants.tenant(store, name), admin=caller.get("role") == "admin")


# --- models -------------------------------------------------------------------------


def model_batching(settings: Settings, record: ModelRecord, override: live.LiveBatching | None = None, *,
                   now: float = 0.0) -> Batching:
    """The batching settings workers apply to the model version of registry `record`: its
    configured ones (`online.models`, else `online.batching`, a repository config's keys on top: `configured`),
    `auto` values resolved from its profile, a tuned pick on top, and a live `override` in force at `now`
    (the batching controller's, a sweep's trial) for the kind of device its profile was measured on, else the
    first kind the override names."""
    batching = resolve(configured(settings.online, record), record)
    if override is None:
        return batching
    profiled = str((record.profile or {}).get("device", "")).partition(":")[0]
    kind = profiled if profiled in override.by_kind else next(iter(sorted(override.by_kind)), profiled)
    return live.apply(batching, override, kind, now=now)


def register_model(settings: Settings, store: Store, dispatcher: Dispatcher, body: ModelRegistration,
                   *, registrant: dict[str, Any], now: float, tenants: TenantTable | None = None) -> ModelRecord:
    """Validate an ONNX file, store a copy as a new version (content hash), profile it statically.

    The name must be new or the `registrant` key's own (`registry.save_model_version`): another
    tenant's name is Forbidden (403), before the file is read, even for a file identical to a
    version it has, since registering rewrites that version's record (source path, profiling).
    A new name becomes the key's tenant's, or for an admin key no tenant's (admin keys alone
    add versions to it: `registry.name_claimant`).

    A model that could never serve a request is refused (InvalidModel, 422) before anything is
    stored: one the ONNX checker's strict type inference rejects, one SITS cannot feed or carry
    (`check_servable`), or one ONNX Runtime cannot load (`check_runtime_loads`). A token model
    that declares an attention mask is run on two tiny feeds to see which outputs carry the
    sequence (`sequence_probe`), so a worker cuts exactly those back after padding, and on the
    shorter one padded, to see that padding keeps its outputs (else it is never padded); any model is
    run on two rows alone and together, and refused if its rows see each other (`batch_probe`). All of that
    runs in a child process under a memory and time limit (`model_checks`): it runs what a tenant sent.
    `profile_mode=full` and `enable_fusion` are sent to a worker as a Celery
    task, since only a worker has ONNX Runtime and the device to measure on;
    the record's `profile_status` says `pending` until the task is done.
    """
    registry.check_may_register(store, body.name, registrant)
    _refuse_a_repository_name(settings, store, body.name, registrant)
    table = tenants or TenantTable(settings.tenants)
    roots = caller_roots(settings, table, store, registrant, "model")
    source = resolve_inside(body.path, roots, "model")
    room = tenant_gate.model_room(table, store, registrant)
    if room is not None:  # (a tenant at its cap costs no load: its file's size stands for its copy's here)
        registry.check_model_room(store, room, name=body.name, adding=_size_on_disk(source))
    checked = model_checks.check_and_store(source, roots.folders, name=body.name,
                                           max_bytes=settings.models.max_file_size, store=settings.paths.store())
    profile, version, stored, copied = checked.profile, checked.version, checked.stored, checked.copied
    ref = f"{body.name}@{version}"
    asks_worker = body.profile_mode == "full" or body.enable_fusion
    sends: list[bool] = []  # (decided in the transaction that writes: its last try's verdict counts)
    fields = {
        "name": body.name,
        "version": version,
        "ref": ref,
        "path": str(stored),
        "source_path": str(source),
        "signature": profile["signature"],
        "static_profile": profile,
        "profile_mode": body.profile_mode,
        "enable_fusion": body.enable_fusion,
        "stored_bytes": _stored_bytes(stored),
    }

    def registered(existing: dict[str, Any] | None) -> dict[str, Any]:
        """The version's record: what is stored (a measured profile stays), with this registration's fields.
        A worker is asked to profile or fuse it once per version and mode (`_worker_asked`)."""
        kept = existing or {}
        send = asks_worker and not _worker_asked(kept, body, now=now)
        sends.append(send)
        return kept | fields | {
            "registered_at": kept.get("registered_at", now),
            "profile_status": "pending" if send else kept.get("profile_status", "static"),
            **({"profile_requested_at": now} if send else {}),
        }

    try:
        record = registry.save_model_version(store, fields, registrant=registrant, based_on=registered, room=room)
    except Forbidden:  # another tenant claimed the name after `check_may_register`, or others took its room
        if copied and not registry.version_exists(store, ref):
            shutil.rmtree(stored.parent, ignore_errors=True)  # no record points at the copy we made
            with contextlib.suppress(OSError):
                stored.parent.parent.rmdir()  # the name's folder, if nothing else is in it
        raise
    if sends and sends[-1]:  # billed to the registrant's tenant
        dispatcher.send("sits.profile_model", ref, body.profile_mode, body.enable_fusion,
                        tenant_gate.tenant_of(registrant), registrant.get("name", ""))
    return record


def _size_on_disk(path: Path) -> int:
    """The bytes of a model file (its external data is counted once it is stored: `_stored_bytes`)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _stored_bytes(stored: Path) -> int:
    """The bytes of a stored copy: its model file and the external data beside it in its version's folder."""
    return sum(entry.stat().st_size for entry in stored.parent.iterdir() if entry.is_file())


def _refuse_a_repository_name(settings: Settings, store: Store, name: str, registrant: dict[str, Any]) -> None:
    """A model name of the Triton model repository is no tenant's, even while it is unloaded, unavailable or
    not loaded yet: a tenant's registration would claim it and keep the repository's model out for good."""
    if registrant.get("role") == "admin":
        return
    if get_state(store, name) is not None or any((root / name).is_dir() for root in settings.repository.paths):
        raise Forbidden(f"model name '{name}' belongs to the model repository, so only an admin key may register "
                        "it; choose another name")


def register_repository_version(settings: Settings, store: Store, model: onnx.ModelProto, *, name: str,
                                version: str, source: Path, fields: dict[str, Any], now: float,
                                batches: bool = True) -> ModelRecord:
    """Register `model` (read from `source` with `load_model_checked`) as `name@version` of a Triton model
    repository (`sits_api.intake.model_repository`): refused as `register_model` refuses a model that
    could never serve, copied into the store beside its content hash (a version folder whose file
    changed is a new copy), with `fields` (its repository config) in its record. The newest version
    number is its name's latest. `batches`: its config has a batch axis, so its rows must not see each
    other (`check_rows_independent`)."""
    check_servable(model)
    serialized = model.SerializeToString(deterministic=True)
    session = check_runtime_loads(serialized, source.name)
    if batches:
        check_rows_independent(serialized, model_signature(model), name, session)
    profile = static_profile(model)
    del session
    stored, _ = model_checks.store_copy(model, settings.paths.store() / name /
                                        f"{version}-{model_checks.content_hash(serialized)}")
    newest = max([int(v.version) for v in registry.list_model_versions(store, name) if v.version.isdigit()],
                 default=0)
    record = {"name": name, "version": version, "ref": f"{name}@{version}", "path": str(stored),
              "source_path": str(source), "signature": profile["signature"], "static_profile": profile,
              "profile_mode": "static", "profile_status": "static", "registered_at": now,
              "stored_bytes": _stored_bytes(stored), **fields}
    return registry.save_model_version(store, record, make_latest=int(version) >= newest)


PROFILE_PENDING_SECONDS = 600.0
"""How long a version's profile may stay pending before registering it again asks a worker again (one
whose worker died with the task, or whose task was lost, is not pending for ever)."""


def _worker_asked(stored: dict[str, Any], body: ModelRegistration, *, now: float) -> bool:
    """Whether a worker already did, or is doing, what `body` asks of the version `stored`: a profile of
    the same mode, ready or pending for less than `PROFILE_PENDING_SECONDS`, and a fused graph if
    fusion is asked. Registering a version again then asks nothing: its profile is measured (and paid
    for) once per version and mode, not per registration."""
    status, mode = stored.get("profile_status"), stored.get("profile_mode")
    if mode != body.profile_mode or (body.enable_fusion and not stored.get("enable_fusion")):
        return False
    if status == "pending":
        return now - float(stored.get("profile_requested_at") or 0) < PROFILE_PENDING_SECONDS
    return status == "ready" and (not body.enable_fusion or bool(stored.get("fusion")))


# --- jobs ---------------------------------------------------------------------------


def submit_job(settings: Settings, store: Store, dispatcher: Dispatcher, body: JobSubmission, *,
               caller: dict[str, Any], now: float, headers: Any = None,
               tenants: TenantTable | None = None, job_id: str | None = None) -> JobRecord:
    """Validate a job against its model's signature, queue its chunks and wake the workers; the job
    belongs to the `caller` key's name, and is billed to its tenant, within the tenant's record in
    `tenants` (its models, `max_inflight`, `default_priority`; the file's tenants when not given). A bare
    model name goes where its A/B route sends the caller's jobs (`sits_api.tenancy.ab_routes`, by the request's
    `headers`, a mapping of its HTTP headers). `job_id` is the id to create it under (a schedule's release
    makes each slot's job under one id, so a second try meets the first: Conflict); a new one by default."""
    model = registry.get_model(store, ab_routes.routed(store, body.model, caller, headers or {}, "jobs"))
    table = tenants or TenantTable(settings.tenants)
    tenant = tenant_gate.check_model(table, store, caller, model.name)
    input_path = resolve_inside(body.input_batch, caller_roots(settings, table, store, caller, "input"), "input")
    output_dir = resolve_inside(body.output_dir, caller_roots(settings, table, store, caller, "output"), "output")
    if output_dir.exists() and not output_dir.is_dir():
        raise BadInput(f"output_dir {output_dir} is a file; name a folder (it is created if missing)")
    input_options = {"shape": body.input_shape, "dtype": body.input_dtype, "format": body.input_format,
                     "columns": body.columns, "id_column": body.id_column}
    caps = tenant_gate.caps_of(caller, tenant)
    try:  # (a tenant at its cap is refused before its file is read: a CSV is parsed whole to count its rows)
        tenant_quotas.check_job_place(store, tenant_gate.tenant_of(caller), most=caps.max_inflight, now=now)
    except tenant_quotas.TenantAtLimit as full:
        raise _at_job_limit(settings, tenant_gate.tenant_of(caller), full) from None
    identity = file_identity(input_path)  # before anything is read: rows, checksum and identity of one file
    with open_input(input_path, model.signature, shape=body.input_shape, dtype=body.input_dtype,
                    mask=mask_spec(model.static_profile),
                    limits=token_limits(model.static_profile), identity=identity, input_format=body.input_format,
                    columns=body.columns, id_column=body.id_column) as source:
        rows, input_format = source.rows, source.format.lstrip(".")
        if source.reads_rows_cheaply():  # its first row checked as a request's would be (token ids, mask)
            next(source.iter_batches(0, 1, 1))
    try:
        # made one folder at a time without following a link (a folder of the path swapped for a link to
        # another tenant's since it was checked is refused, nothing made there)
        open_folder(output_dir, what="output folder", fix="name a real folder", create=True).close()
    except OSError as err:
        raise BadInput(f"cannot create output_dir {output_dir} ({err.strerror}); "
                       "name a folder the workers can write") from err
    if body.output_format == "parquet" and (ids := body.id_column or TABLE_ROW_COLUMN) in model.output_names:
        raise BadInput(f"the id column '{ids}' has the name of one of the model's outputs {model.output_names}; "
                       "rename that column for id_column, or write .npy outputs")
    _refuse_finished_output_dir(output_dir, model.output_names, body.output_format)
    batch_size = _batch_size(settings, model, body.batch_size)
    deadline_at = job_deadlines.deadline_at(body, now=now)
    spec = jobs.JobSpec(
        job_id=job_id or jobs.new_job_id(),
        model_name=model.name,
        model_version=model.version,
        input_batch=str(input_path),
        input_format=input_format,
        input_checksum=_checksum_unchanged(input_path, identity),
        input_stat=identity,
        output_dir=str(output_dir),
        output_names=model.output_names,
        rows_total=rows,
        chunk_size=_chunk_size(settings, store, model, body.chunk_size, rows=rows, batch_size=batch_size, now=now),
        batch_size=batch_size,
        priority=_entitled_priority(caller, body, tenant),
        owner=caller["name"],
        tenant=tenant_gate.tenant_of(caller),
        max_priority=tenant_gate.priority_cap(tenant),
        input_options={k: v for k, v in input_options.items() if v is not None},
        deadline_at=deadline_at,
        max_slots=body.max_slots,
        output_format=body.output_format,
    )
    weights, ordering = policy.get_policy(store, default=policy.default_ordering(settings.scheduler.policy))
    if deadline_at is not None:
        try:
            spec = job_deadlines.admitted(settings, store, spec, model, weights=weights, ordering=ordering, now=now)
        except DeadlineInfeasible:
            sla_metrics.count_admission_refusal(store, spec.model_ref)
            raise
    _take_job_place(settings, store, spec, caps, now=now)
    try:
        output_dirs.claim_output_dir(store, spec.output_dir, spec.job_id, caller=caller)
        job_fills.create_job(store, spec, now=now, weights=weights, ordering=ordering,
                             deadline_horizon=settings.sla.deadline_horizon)
    except BaseException:  # (a job never written would hold its place, and its chunks, for the grace)
        tenant_quotas.give_back_job_place(store, spec.tenant, spec.job_id)
        raise
    _keep_output_dir_or_stop(store, spec.job_id, spec.output_dir, now=now)
    tenant_usage.count_job(store, tenant=spec.tenant, owner=spec.owner, model=spec.model_ref, now=now)
    dispatcher.wake_workers()
    return jobs.get_job(store, spec.job_id, now=now)


def _entitled_priority(caller: dict[str, Any], body: JobSubmission, tenant: Tenant | None) -> int:
    """The job's own priority, else its tenant's `default_priority`, else the default; within the tenant's
    `max_priority` (`tenant_gate.check_entitlements`)."""
    if "priority" in body.model_fields_set or tenant is None or tenant.default_priority is None:
        priority = body.priority
    else:
        priority = tenant.default_priority
    tenant_gate.check_entitlements(caller, tenant, priority=priority)
    return priority


@dataclass(frozen=True)
class _Place:
    """What taking a job's place needs of it."""

    tenant: str
    job_id: str
    chunks: int


def _place_of(job: JobRecord) -> _Place:
    return _Place(tenant=job.tenant or job.owner or "", job_id=job.id, chunks=job.chunks_total)


def _take_job_place(settings: Settings, store: Store, spec: jobs.JobSpec | _Place, caps: Tenant, *,
                    now: float) -> None:
    """A place among its tenant's active jobs (`caps.max_inflight`), with room for its chunks among theirs
    (`caps.max_queued_chunks`); else QueueFull (429) with a Retry-After of about one chunk's time, the soonest
    a job of the tenant may end and free one, or BadInput for a job larger than the whole chunk cap."""
    chunks = spec.chunks if isinstance(spec, _Place) else len(jobs.chunk_ranges(spec.rows_total, spec.chunk_size))
    try:
        tenant_quotas.take_job_place(store, spec.tenant, spec.job_id, most=caps.max_inflight, now=now,
                                     chunks=chunks, most_chunks=caps.max_queued_chunks)
    except tenant_quotas.TenantAtLimit as full:
        raise _at_job_limit(settings, spec.tenant, full) from None
    except tenant_quotas.TenantChunksAtLimit as full:
        raise _at_chunk_limit(settings, spec.tenant, full) from None


def _at_chunk_limit(settings: Settings, tenant: str, full: tenant_quotas.TenantChunksAtLimit) -> SitsError:
    """The 429 (or, for a job larger than the whole cap, 400) of a job its tenant's `max_queued_chunks` refused."""
    if full.asked > full.most:
        return BadInput(f"the job has {full.asked:,} chunks, more than tenant '{tenant}' may have queued at all "
                        f"({full.most:,}, tenants.{tenant}.max_queued_chunks); give a larger chunk_size")
    retry_after = max(1, math.ceil(settings.jobs.chunk_seconds))
    return QueueFull(f"tenant '{tenant}' has {full.held:,} chunks in its jobs queued or running; this job's "
                     f"{full.asked:,} more would pass its limit of {full.most:,} (tenants.{tenant}.max_queued_chunks). "
                     f"The job was not queued: retry after {retry_after} s (Retry-After), once one of them ends, "
                     "or with a larger chunk_size", retry_after=retry_after)


def _at_job_limit(settings: Settings, tenant: str, full: tenant_quotas.TenantAtLimit) -> QueueFull:
    """The 429 of a job its tenant's `max_inflight` refused, with a Retry-After of about one chunk's time."""
    retry_after = max(1, math.ceil(settings.jobs.chunk_seconds))
    return QueueFull(f"tenant '{tenant}' has {full.active} jobs queued or running, its limit "
                     f"(tenants.{tenant}.max_inflight); the job was not queued: retry after {retry_after} s "
                     "(Retry-After), or once one of them ends", retry_after=retry_after)


def _checksum_unchanged(path: Path, identity: dict[str, int]) -> str:
    """The file's checksum, if the file is still the one `identity` describes once it is read (a file
    being written while it is hashed would be recorded with a checksum of neither version)."""
    checksum = file_checksum(path)
    if file_identity(path) != identity:
        raise RetryableError(f"input {path} changed while it was being read; submit again once it is written")
    return checksum


def _batch_size(settings: Settings, model: ModelRecord, asked: int | str | None) -> int:
    """The job's own batch size, else the configured one, else (`auto`) the model's best measured one."""
    chosen = asked or settings.jobs.batch_size
    return chosen if isinstance(chosen, int) else chunking.auto_batch_size(model)


def _chunk_size(settings: Settings, store: Store, model: ModelRecord, asked: int | str | None, *, rows: int,
                batch_size: int, now: float) -> int:
    """The job's own chunk size, else the configured one, else (`auto`) one from the model's profile."""
    chosen = asked or settings.jobs.chunk_size
    if isinstance(chosen, int):
        if chosen < (least := chunking.least_chunk_size(rows)):
            where = "chunk_size" if asked else "the server's jobs.chunk_size"
            raise BadInput(f"{where} {chosen:,} cuts {rows:,} rows into {math.ceil(rows / chosen):,} chunks; a job "
                           f"has at most {chunking.MAX_CHUNKS_PER_JOB:,}: give chunk_size {least:,} or more, "
                           "or 'auto' to let the server size them")
        return chosen
    fleet = figures.live_fleet(settings, store, now=now)  # (a GPU worker's streams share one device: one slot)
    return chunking.chunk_size_for(model, rows_total=rows, batch_size=batch_size, live_workers=fleet.workers,
                                   live_slots=fleet.slots, chunk_seconds=settings.jobs.chunk_seconds,
                                   max_chunk_output_bytes=settings.jobs.max_chunk_output_bytes,
                                   calibration=figures.calibrations(store).get(model.version, 1.0))


def _keep_output_dir_or_stop(store: Store, job_id: str, output_dir: str, *, now: float) -> None:
    """After a job became active: Conflict, its job stopped, if another job claimed its folder meanwhile."""
    if output_dirs.holds_output_dir(store, output_dir, job_id):
        return
    job_stops.stop_job(store, job_id, status="failed", now=now,
                  error=f"another job claimed output_dir {output_dir} at the same time")
    raise Conflict(f"output_dir {output_dir} was claimed by another job at the same time; choose another folder")


def _refuse_finished_output_dir(output_dir: Path, output_names: list[str], output_format: str = "npy") -> None:
    """Conflict when the folder holds a finished job's results (a new job would run every row and
    then fail at its merge: the manifest is another job's), or files the job's outputs would replace
    that no job's manifest accounts for: someone's data (another tenant's, or the job's own input)
    that a merge would overwrite without a word."""
    if (output_dir / MANIFEST_NAME).exists():
        raise Conflict(f"output_dir {output_dir} already holds the results of a finished job ({MANIFEST_NAME}); "
                       "choose an empty folder or remove those results first")
    files = {name: output_path(output_dir, name) for name in output_names}
    if output_format == "parquet":
        files = {"all outputs": output_dir / TABLE_OUTPUT_NAME}
    taken = [(name, path.name) for name, path in files.items() if path.exists()]
    if taken:
        held = ", ".join(f"{file} (output '{name}')" for name, file in taken)
        raise Conflict(f"output_dir {output_dir} already holds {held}, which this job's outputs would replace; "
                       "choose another folder or move those files away")


def resume_job(settings: Settings, store: Store, dispatcher: Dispatcher, job_id: str, *, caller: dict[str, Any],
               now: float, tenants: TenantTable | None = None) -> JobRecord:
    """Re-queue a job's unfinished chunks after checking its input and model are still the same; a
    conflict over its folder names the other job only if the `caller` key may see it. A resumed job is
    held to what a submitted one is, as its tenant stands now: the models it may use, its entitlements,
    the caller's roots, and a place among its active jobs (`max_inflight`), so that cancel and resume
    is no way past them."""
    job = jobs.get_job(store, job_id, now=now)
    registry.get_model(store, job.model_ref)
    table = tenants or TenantTable(settings.tenants)
    tenant = tenant_gate.check_model(table, store, caller, job.model)
    tenant_gate.check_entitlements(caller, tenant, priority=job.priority)
    resolve_inside(job.input_batch, caller_roots(settings, table, store, caller, "input"), "input")
    resolve_inside(job.output_dir, caller_roots(settings, table, store, caller, "output"), "output")
    if job.status not in jobs.ACTIVE_STATUSES:  # (an active one holds its place already)
        _take_job_place(settings, store, _place_of(job), tenant_gate.caps_of(caller, tenant), now=now)
    input_path = Path(job.input_batch)
    identity = file_identity(input_path)
    checksum = _checksum_unchanged(input_path, identity)
    if checksum != job.input_checksum:
        raise BadInput(f"input {job.input_batch} changed since the job was submitted "
                       f"({checksum} != {job.input_checksum}); submit a new job for the new data")
    weights, ordering = policy.get_policy(store, default=policy.default_ordering(settings.scheduler.policy))
    manifest = read_manifest(Path(job.output_dir))
    if manifest is not None and manifest.get("job") != job_id:
        other = manifest.get("job")
        holder = jobs.job_owner(store, str(other))
        named = f"job {other}" if owns(caller, holder.owner, holder.tenant) else "another job"
        raise Conflict(f"output_dir {job.output_dir} now holds the results of {named}; "
                       "submit this job again into another folder")
    output_dirs.claim_output_dir(store, job.output_dir, job_id, caller=caller)  # another job may have taken it
    if manifest is None:  # chunks whose parts were deleted (with the folder) run again
        on_disk = chunks_with_parts(Path(job.output_dir), job.output_names or [], job_id=job_id,
                                    output_format=job.output_format)
        job_progress.forget_chunks(store, job_id, sorted(job_progress.done_chunks(store, job_id) - on_disk))
    # capped as the job's tenant stands now (an admin's resume of a capped tenant's job too)
    cap = tenant_gate.priority_cap(table.tenant(store, job.tenant or job.owner or ""))
    job_fills.resume_job(store, job_id, now=now, weights=weights, ordering=ordering, input_stat=identity,
                         deadline_horizon=settings.sla.deadline_horizon, max_priority=cap)
    _keep_output_dir_or_stop(store, job_id, job.output_dir, now=now)
    dispatcher.wake_workers()
    return jobs.get_job(store, job_id, now=now)
