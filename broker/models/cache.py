"""Model registry records kept a moment per process, for the hot paths that read one per request.

The API reads a model's record for every request it takes, and a worker for every batch it
runs. A version's graph never changes, but its record does: a measured profile lands after
registration, and a bare name moves to a newly registered version. So a record is kept for
`ttl_seconds` and read again after, and the API and the workers share this one cache with
their own TTLs (the API's is shorter: a bare name should move to a new version quickly).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from broker.models import registry
from broker.models.model_record import ModelRecord
from broker.state.store import Store

API_RECORD_TTL_SECONDS = 2.0
"""How long an API process keeps a record: a new version or profile is seen within seconds."""
WORKER_RECORD_TTL_SECONDS = 5.0
"""How long a worker keeps a record: what it derives from one (batching, padding) is derived again
only when it is read again."""


class ModelRecordCache:
    """Records by model ref (`name` or `name@version`), each kept `ttl_seconds` from when it was read.

    A record read by its bare name is kept under its pinned ref too, so the next request that names
    the version (as v2 requests do) finds it. The store is passed to each read: a process has one
    Redis. Thread-safe; `clock` is passed in for tests.
    """

    def __init__(self, ttl_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_seconds = ttl_seconds
        self._clock = clock
        self._records: dict[str, tuple[float, ModelRecord]] = {}
        self._lock = threading.Lock()

    def get(self, store: Store, ref: str) -> ModelRecord:
        """The record of `ref`, from the cache while it is fresh, else from the registry (which raises
        `ModelNotFound` for an unknown one)."""
        now = self._clock()
        with self._lock:
            cached = self._records.get(ref)
        if cached is not None and now - cached[0] < self.ttl_seconds:
            return cached[1]
        record = registry.get_model(store, ref)
        self.remember(ref, record, read_at=now)
        return record

    def remember(self, ref: str, record: ModelRecord, *, read_at: float | None = None) -> None:
        """Keep `record` as the current one of `ref` (a process that just wrote it sees it at once)."""
        entry = (self._clock() if read_at is None else read_at, record)
        pinned = record.ref if record.name and record.version else ref
        with self._lock:
            self._records[ref] = entry
            self._records[pinned] = entry
