"""Celery tasks: thin glue over `drain_loop` and `profiler` (parse, call, map the result)."""

from __future__ import annotations

import logging
from typing import Any

from broker.tracing import spans
from sits_worker.celery_app import app
from sits_worker.serving.context import worker_context
from sits_worker.serving.drain_loop import Outcome, drain
from sits_worker.serving.drain_report import DrainReport
from sits_worker.serving.profiler import BillPayer

log = logging.getLogger(__name__)


def send_drain(ticket: str) -> None:
    """Publish the drain task of `ticket`, in a trace of its own when Celery is traced: a ticket circulates
    for as long as there is work, and its time slices chained in one trace would make a trace without end."""
    with spans.detached():
        app.send_task("sits.drain", args=[ticket], queue=app.conf.task_default_queue)  # this deployment's


@app.task(name="sits.drain")
def drain_task(ticket: str) -> dict[str, Any]:
    """Serve batches under one batch ticket; re-queue the ticket when its time slice ends. The result says
    how the drain ended and what it ran (`DrainReport`): Flower shows it on the task's page."""
    report = DrainReport()
    try:
        outcome = drain(worker_context(), ticket, report)
    except Exception:
        # Redis gone or a bug: keep the ticket circulating (a second later) rather than losing it
        # until the reaper's ticket timeout; the leases of what was running expire on their own.
        log.exception("drain under ticket %s failed; re-sending it in 1 s", ticket)
        with spans.detached():
            app.send_task("sits.drain", args=[ticket], queue=app.conf.task_default_queue, countdown=1.0)
        report.outcome = "error"
        return report.to_json()
    if outcome is Outcome.YIELD:
        send_drain(ticket)
    return report.to_json()


@app.task(name="sits.profile_model")
def profile_model_task(model_ref: str, profile_mode: str, enable_fusion: bool, tenant: str = "",
                       owner: str = "") -> dict[str, Any]:
    """Measure a model version on this worker's device and/or fuse its graph; results go to the registry
    (and its record, as JSON, to the task's result). The device time is billed to `tenant` (the
    registering key's; `owner` its name), as a run of its work would be."""
    from sits_worker.serving.profiler import profile_and_record

    return profile_and_record(worker_context(), model_ref, profile_mode=profile_mode, enable_fusion=enable_fusion,
                              payer=BillPayer(tenant, owner)).to_json()
