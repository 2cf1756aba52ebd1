"""Offline jobs, online requests and the schedulability analysis, as `/v1/jobs`, `/v1/requests` and
`/v1/sla/analysis` answer them."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class Job(BaseModel):
    """One offline job with its progress, rates and deadline figures (`broker.jobs.job_record.JobRecord`)."""

    id: str
    status: str = Field(description="queued, running, succeeded, failed or cancelled")
    model: str
    model_version: str
    model_ref: str = Field(description="name@version")
    owner: str | None = Field(description="the submitting key's name")
    tenant: str | None
    input_batch: str
    input_format: str
    input_checksum: str
    input_options: dict[str, Any] | None
    input_stat: dict[str, int] | None
    output_dir: str
    output_names: list[str]
    output_format: str = Field(description="npy or parquet")
    rows_total: int
    rows_done: int
    rows_quarantined: int
    chunks_total: int
    chunks_done: int
    chunk_runs: int
    chunk_size: int
    batch_size: int
    priority: int
    max_slots: int | None = Field(description="the most stream slots its chunks hold at once (null: no cap)")
    error: str | None
    at_risk: bool
    created_at: float = Field(description="unix seconds, as every time of a job")
    started_at: float | None
    finished_at: float | None
    checkpoint_ts: float | None
    resumed_at: float | None
    deadline: float | None
    predicted_finish: float | None
    order_at: float | None
    busy_seconds: float | None
    manifest: dict[str, Any] | None
    retries: dict[str, dict[str, Any]] = Field(description="failures by class: attempts, last error and when")
    failures: list[dict[str, Any]]
    workers: dict[str, int] = Field(description="worker name -> chunks it acknowledged")
    progress: float
    elapsed_seconds: float
    rows_per_second: float
    eta_seconds: float | None
    sla_risk: float | None
    deadline_met: bool | None


class JobList(BaseModel):
    """`GET /v1/jobs`: newest first."""

    jobs: list[Job]


class RequestResult(BaseModel):
    """One online request: its status and timings and, once it succeeded, its outputs as nested lists."""

    id: str
    model: str
    model_version: str
    status: str = Field(description="queued, running, succeeded or failed")
    owner: str | None
    tenant: str | None
    rows: int
    created_at: float
    finished_at: float | None
    started_at: float | None
    batch_size: int | None
    job_rows: int = Field(description="rows of offline jobs that shared its run")
    error: str | None
    error_code: str | None
    retries: dict[str, dict[str, Any]]
    failures: list[dict[str, Any]]
    outputs: dict[str, list[Any]] | None = Field(description="output name -> values, nested by the tensor's shape")
    latency_ms: float | None = Field(None, description="from submit to answer; only once done")


class RequestQueued(BaseModel):
    """`POST /v1/requests` without a wait (or not done in time): the request to poll."""

    id: str
    status: str
    model: str
    model_version: str


class TaskAnswer(BaseModel):
    """One task of an analysed set: its priority and times, and whether its response time meets its deadline."""

    name: str
    priority: int = Field(description="1: the most urgent")
    wcet_ms: float
    wcet_source: str
    period_ms: float
    deadline_ms: float
    section_ms: float
    section_source: str
    blocking_ms: float
    blocking_source: str
    response_ms: float | None
    slack_ms: float | None
    meets: bool
    reason: str
    derived: dict[str, Any] | None = Field(None, description="a model task's: how its wcet_ms was derived")


class SlaAnalysis(BaseModel):
    """`POST /v1/sla/analysis`: utilisation against the Liu-Layland bound and each task's response time."""

    policy: str
    workers: int
    feasible: bool
    verdict: str
    analysis: str
    utilisation: float
    bound: dict[str, Any] = Field(description="the Liu-Layland test: value, utilisation, verdict, reason")
    tasks: list[TaskAnswer]
    notes: list[str] = Field([], description="what the answer assumes of the live policy")
