"""`POST /v1/sla/analysis`: read what a periodic task set names from Redis, then analyse it.

The one impure step: a task given as `model` and `rows` reads the model's
registry record (its measured profile) and the job sizes the server would
give it; everything else is `broker.sla.analysis`, pure.
"""

from __future__ import annotations

from typing import Any

from broker.config.settings import Settings
from broker.jobs import chunking
from broker.models import registry
from broker.queueing import policy
from broker.sla import analysis as sla_analysis
from broker.sla.task_sets import PeriodicTask, TaskSet, TaskSpec, given_task, model_cost, model_task
from broker.state.store import Store


def analyse_task_set(settings: Settings, store: Store, body: TaskSet) -> dict[str, Any]:
    """The analysis of `body`, with notes on what it assumes of this server's live policy."""
    tasks = [given_task(spec) if spec.wcet_ms is not None else _model_task(settings, store, spec, body)
             for spec in body.tasks]
    answer = sla_analysis.analyse(tasks, policy=body.policy, workers=body.workers)
    return answer | {"notes": _notes(settings, store, tasks)}


def _model_task(settings: Settings, store: Store, spec: TaskSpec, body: TaskSet) -> PeriodicTask:
    """A task whose C is derived from its model's measured profile, at the sizes its jobs would get."""
    assert spec.model is not None and spec.rows is not None
    record = registry.get_model(store, spec.model)
    batch_size, batch_source = _size(spec.batch_size, settings.jobs.batch_size, "jobs.batch_size")
    if batch_size is None:
        batch_size, batch_source = chunking.auto_batch_size(record), "auto: the best measured batch size"
    chunk_size, chunk_source = _size(spec.chunk_size, settings.jobs.chunk_size, "jobs.chunk_size")
    if chunk_size is None:
        chunk_size = chunking.chunk_size_for(record, rows_total=spec.rows, batch_size=batch_size,
                                             live_workers=body.workers, chunk_seconds=settings.jobs.chunk_seconds,
                                             max_chunk_output_bytes=settings.jobs.max_chunk_output_bytes)
        chunk_source = f"auto: about jobs.chunk_seconds of work, for {body.workers} worker(s)"
    cost = model_cost(record, task=spec.name, rows=spec.rows, batch_size=batch_size, chunk_size=chunk_size,
                      item_overhead_ms=body.item_overhead_ms, device=spec.device)
    cost.detail.update(batch_size_source=batch_source, chunk_size_source=chunk_source)
    return model_task(spec, cost)


def _size(asked: int | None, configured: int | str, setting: str) -> tuple[int | None, str]:
    """A job size as `services.submit_job` picks it: the task's own, else the configured one; None for `auto`."""
    if asked is not None:
        return asked, "given"
    return (configured, setting) if isinstance(configured, int) else (None, "auto")


def _notes(settings: Settings, store: Store, tasks: list[PeriodicTask]) -> list[str]:
    """What the answer assumes of how the tasks' jobs are submitted and ordered, with warnings where the
    live policy breaks it."""
    weights, ordering = policy.get_policy(store, default=policy.default_ordering(settings.scheduler.policy))
    notes = ["submit each task's jobs with a priority level in the order of `priority` (1: the highest "
             "level), one level apart at least",
             "not counted: the time to submit a job and for a worker to take it up (docs/sla.md, \"What the "
             "analysis leaves out\")"]
    if ordering == "fifo":
        notes.append("warning: the live queue ordering is fifo, so workers ignore job priorities and these "
                     "response times do not hold; set it to dynamic (PUT /v1/policy {\"ordering\": \"dynamic\"})")
    if settings.scheduler.policy == "round-robin":
        notes.append("warning: scheduler.policy is round-robin, so workers take model queues in turns, not by "
                     "priority; the response times hold only for tasks of one model")
    longest = max(task.deadline_ms for task in tasks)
    if weights.delta > 0 and longest / 1000 >= 1 / weights.delta:
        notes.append(f"warning: aging (delta {weights.delta:g} points/s) lets a job overtake one a level above "
                     f"after {1 / weights.delta:g} s of waiting, within the longest deadline "
                     f"({longest / 1000:g} s); give the tasks levels further apart")
    return notes
