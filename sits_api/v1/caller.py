"""What the calling key may see: another tenant's job or request answers as a missing one, and
another tenant's model without its owner and paths."""

from __future__ import annotations

import time
from typing import Any

from flask import g

from broker.errors import Forbidden, SitsError
from broker.jobs import records as jobs
from broker.jobs.job_record import JobRecord
from broker.models.model_record import ModelRecord
from broker.tenants.apikeys import may_read, owns, owns_name
from sits_api.state import app_state


def check_visible(owner: str | None, tenant: str | None, not_found: SitsError, *, steer: bool = False) -> None:
    """Nothing if the caller's key may read the work of `owner` in `tenant` (a job or a request:
    `apikeys.may_read`), or with `steer` cancel, stop or resume it (`apikeys.owns`); else `not_found`: the
    very error an unknown id gets, so that no tenant learns that another's ids exist (a viewer of the
    tenant gets a 403 when steering)."""
    if steer and may_read(g.identity, owner, tenant) and not owns(g.identity, owner, tenant):
        raise Forbidden(f"key '{g.identity.get('name')}' has the '{g.identity.get('role')}' role: it may read its "
                        "tenant's work, not steer it")
    if not may_read(g.identity, owner, tenant):
        raise not_found


def model_as_seen(record: ModelRecord) -> dict[str, Any]:
    """A model record as the caller may see it: to the keys that own its name (`apikeys.owns_name`: the
    tenant's keys, admins) whole; to other keys with `owner` None (as for a name no tenant owns) and
    the file paths None too, the registered `source_path` (which names folders of the registrant's,
    often the tenant itself), the stored copy's `path` and a fused graph's, so that no tenant learns
    another's name or files. Any key may use the model either way."""
    shown = record.to_json()
    if owns_name(g.identity, record.owner):
        return shown
    hidden = shown | {"owner": None, "path": None, "source_path": None}
    if record.fusion is not None:
        hidden["fusion"] = record.fusion | {"path": None}
    return hidden


def caller_job(job_id: str, *, steer: bool = False) -> JobRecord:
    """The job `job_id`, if the caller may see it (with `steer`: and steer it); JobNotFound otherwise, and
    for an id no job could have (`jobs.JOB_ID_PATTERN`), without a look into Redis: `<id>:done` would
    name another of the job's keys, of another type."""
    if not jobs.JOB_ID_PATTERN.fullmatch(job_id):
        raise jobs.job_not_found(job_id)
    job = jobs.get_job(app_state().store, job_id, now=time.time())
    check_visible(job.owner, job.tenant, jobs.job_not_found(job_id), steer=steer)
    return job
