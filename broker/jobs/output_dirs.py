"""The claim of an output folder by the one job that writes into it.

Two jobs writing into one folder would both run every row, and all but one fail at their merge; a
job of another tenant finishing in a stopped job's folder would block that job's resume. So a job
claims its folder before it becomes active (`claim_output_dir`), and checks it still holds the
claim once it is (`holds_output_dir`).
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from redis.exceptions import WatchError

from broker.errors import Conflict
from broker.jobs.output_layout import PARTS_DIR
from broker.jobs.records import ACTIVE_STATUSES
from broker.jobs.views import JobOwnerView
from broker.state.store import Store, translate_redis_errors
from broker.tenants.apikeys import owns


def claim_output_dir(store: Store, output_dir: str, job_id: str, *, caller: dict[str, Any]) -> None:
    """Make `job_id` the job that writes into `output_dir`; Conflict while another active job holds it,
    naming that job only if the `caller` API key may see it (`apikeys.owns`), and Conflict for a
    folder whose holder, in any status, is a job the caller may not see.

    Two jobs submitted into one folder at once would both pass a check made before either exists,
    run every row, and all but one fail at their merge. The claim is atomic (WATCH on the claims),
    but the job becomes active only after it (created, or resumed), and a claim held by a job that
    is not active (or not created yet) is free to take: so the caller claims, creates or resumes
    its job, then checks it still holds the folder (`holds_output_dir`) and stops its job if not.
    Of jobs racing for one folder, only the last to claim stays.

    A folder stays its holder's tenant's after the job stops: a cancelled or failed job's parts are
    its resumable work, and another tenant's job finishing there would leave a manifest that blocks
    that resume. So a key takes a stopped job's folder only if it owns that job (its tenant's keys,
    admins), or the job is gone from Redis.
    """
    if PARTS_DIR in PurePosixPath(output_dir).parts:
        raise Conflict(f"output_dir {output_dir} lies in a job's {PARTS_DIR} folder, which holds its parts; "
                       "choose a folder of your own")
    key = store.keys.output_dirs
    ancestors = [str(folder) for folder in PurePosixPath(output_dir).parents]
    with translate_redis_errors(), store.client.pipeline() as pipe:
        while True:
            try:
                pipe.watch(key)
                holder = pipe.hget(key, output_dir)
                if holder and holder != job_id:
                    held_by = JobOwnerView.of(pipe.hmget(store.keys.job(holder), JobOwnerView.names()))
                    _refuse_a_held_folder(caller, output_dir, holder, held_by)
                # A folder inside another job's is that job's too: its parts and outputs live there.
                for folder, above in zip(ancestors, pipe.hmget(key, ancestors) if ancestors else [], strict=True):
                    if above and above != job_id:
                        held_by = JobOwnerView.of(pipe.hmget(store.keys.job(above), JobOwnerView.names()))
                        if held_by.status is not None and not owns(caller, held_by.owner, held_by.tenant):
                            raise Conflict(f"output_dir {output_dir} lies inside {folder}, another tenant's job's "
                                           "output folder; choose a folder of your own")
                pipe.multi()
                pipe.hset(key, output_dir, job_id)
                pipe.execute()
                return
            except WatchError:
                continue


def _refuse_a_held_folder(caller: dict[str, Any], output_dir: str, holder: str, held_by: JobOwnerView) -> None:
    """Conflict unless `caller` may take `output_dir` from job `holder` (`held_by`: its status, None when
    the job is gone, its owner and tenant): no one while it is active, only keys that own it
    (`apikeys.owns`) while it exists. Only a key that owns the job is told which one it is."""
    status = held_by.status
    visible = owns(caller, held_by.owner, held_by.tenant)
    if status in ACTIVE_STATUSES:
        if visible:
            raise Conflict(f"output_dir {output_dir} is in use by job {holder} ({status}); "
                           f"choose another folder or cancel {holder} first")
        raise Conflict(f"output_dir {output_dir} is in use by another tenant's active job; choose another folder")
    if status is not None and not visible:
        raise Conflict(f"output_dir {output_dir} was last used by another tenant's job, whose parts or results "
                       "may still be there; choose another folder")


def holds_output_dir(store: Store, output_dir: str, job_id: str) -> bool:
    """Whether `job_id` still holds its claim on `output_dir` (see `claim_output_dir`)."""
    with translate_redis_errors():
        return store.client.hget(store.keys.output_dirs, output_dir) == job_id
