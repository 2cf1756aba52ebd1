"""An offline job's record, typed: its hash read back in one place, with its progress, rates and
deadline figures derived (`broker/jobs/records.py`, `get_job`).

Callers read named fields (`job.rows_done`, `job.output_dir`); the record becomes a dict only at the
API's edge (`to_json`). A hash field this record does not name (one an older or newer release wrote)
is carried in `extra`, so that `GET /v1/jobs/<id>` still shows it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class JobRecord:
    """One job: what it runs, over which files, how far it got, and how it stands against its deadline."""

    id: str
    status: str
    """queued, running, succeeded, failed or cancelled."""
    model: str
    model_version: str
    model_ref: str
    owner: str | None
    """The submitting key's name; None for jobs stored without one."""
    tenant: str | None
    """Who its chunks bill: its tenant (jobs stored before tenants: its owner)."""
    input_batch: str
    input_format: str
    input_checksum: str
    input_options: dict[str, Any] | None
    input_stat: dict[str, int] | None
    """The input file's identity when it was checksummed (size, modification time, inode)."""
    output_dir: str
    output_names: list[str]
    output_format: str
    """`npy` or `parquet` (`records.JobSpec.output_format`)."""
    rows_total: int
    rows_done: int
    rows_quarantined: int
    chunks_total: int
    chunks_done: int
    chunk_runs: int
    chunk_size: int
    batch_size: int
    priority: int
    max_slots: int | None
    """The most stream slots its chunks hold at once (None: no cap)."""
    error: str | None
    at_risk: bool
    """Admitted with `sla.admission: flag` although it was predicted to miss its deadline."""
    created_at: float
    started_at: float | None
    finished_at: float | None
    checkpoint_ts: float | None
    resumed_at: float | None
    deadline: float | None
    predicted_finish: float | None
    order_at: float | None
    busy_seconds: float | None
    """Slot time its chunks took, kept by the acks."""
    manifest: dict[str, Any] | None
    retries: dict[str, dict[str, Any]]
    """Failures by class (`broker/failures/retries.py`): attempts, last error and when, of each class."""
    failures: list[dict[str, Any]]
    workers: dict[str, int]
    """Worker name -> chunks it acknowledged."""
    progress: float
    elapsed_seconds: float
    rows_per_second: float
    eta_seconds: float | None
    sla_risk: float | None
    deadline_met: bool | None
    extra: dict[str, Any] = field(default_factory=dict)
    """Hash fields this record does not name, as they are stored."""

    @classmethod
    def of(cls, job: Mapping[str, Any]) -> JobRecord:
        """The record of a decoded job (`records.decode_job`, then `records.with_rates`)."""
        known: dict[str, Any] = {name: job.get(name) for name in _NAMES}
        known["output_names"] = known["output_names"] or []  # (stored with every job: [] only for a broken hash)
        known["created_at"] = known["created_at"] or 0.0
        known["output_format"] = known["output_format"] or "npy"  # (jobs stored before formats were kept)
        return cls(**known, extra={name: value for name, value in job.items() if name not in _NAMES})

    def to_json(self) -> dict[str, Any]:
        """The job as the API reports it."""
        return {**{name: getattr(self, name) for name in _NAMES}, **self.extra}


_NAMES = tuple(item.name for item in dataclasses.fields(JobRecord) if item.name != "extra")
