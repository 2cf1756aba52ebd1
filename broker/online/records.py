"""An online request's record, typed: what its hash holds, read back in one place.

`broker/online/requests.py` stores a request's fields in its hash and workers complete them; every
reader (the API's `GET /v1/requests/<id>` and v2 answers, a waiting call's inbox, scripts and tests)
gets a `RequestRecord` built here. Its JSON form (`to_json`) is the one place it becomes a dict: at
the API's edge.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from broker.failures.retries import failure_record


@dataclass(frozen=True)
class RequestRecord:
    """One online request as its hash holds it: who sent it, for which model, its status and timings,
    and once done its outputs or its error."""

    id: str
    model: str
    model_version: str
    status: str
    """queued, running, succeeded or failed."""
    owner: str | None
    """The submitting key's name; None for requests stored without one."""
    tenant: str | None
    """Who it is billed to: its tenant, else its owner."""
    rows: int
    created_at: float
    finished_at: float | None
    started_at: float | None
    """When the run that answered it began (its queue time ends there)."""
    batch_size: int | None
    job_rows: int
    """Rows of offline jobs that shared its run."""
    error: str | None
    error_code: str | None
    """The kind of error: bad_input, invalid_model, timeout, ..."""
    outputs: dict[str, np.ndarray] | None = field(default=None, compare=False)
    """Output name -> array, once it succeeded (arrays are left out of `==`)."""
    retries: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Failures by class (`broker/failures/retries.py`): attempts, last error and when, of each class."""
    failures: list[dict[str, Any]] = field(default_factory=list)
    """Its last failures, oldest first."""

    @property
    def latency_ms(self) -> float | None:
        """From its submit to its answer, in milliseconds; None while it is not done."""
        return round((self.finished_at - self.created_at) * 1000, 3) if self.finished_at else None

    @classmethod
    def from_fields(cls, raw: Mapping[str, str], unpack: Callable[[str], np.ndarray]) -> RequestRecord:
        """The record of a request hash's fields; `unpack` decodes one stored output tensor."""
        retries, failures = failure_record(raw)
        outputs = ({name: unpack(text) for name, text in orjson.loads(raw["outputs"]).items()}
                   if raw.get("outputs") else None)
        return cls(
            id=raw["id"], model=raw["model"], model_version=raw["model_version"], status=raw["status"],
            owner=raw.get("owner") or None, tenant=raw.get("tenant") or raw.get("owner") or None,
            rows=int(raw["rows"]), created_at=float(raw["created_at"]),
            finished_at=float(raw["finished_at"]) if raw.get("finished_at") else None,
            started_at=float(raw["started_at"]) if raw.get("started_at") else None,
            batch_size=int(raw["batch_size"]) if raw.get("batch_size") else None,
            job_rows=int(raw.get("job_rows") or 0), error=raw.get("error") or None,
            error_code=raw.get("error_code") or None, retries=retries, failures=failures, outputs=outputs)

    def to_json(self) -> dict[str, Any]:
        """The record as the API reports it (outputs left as arrays: the edge writes them); `latency_ms`
        only once it is done."""
        body = {name: getattr(self, name) for name in _FIELD_NAMES}
        if self.finished_at:
            body["latency_ms"] = self.latency_ms
        return body


_FIELD_NAMES = tuple(item.name for item in dataclasses.fields(RequestRecord))
"""Read once: `to_json` runs for every answered request."""
