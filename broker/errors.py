"""The one exception hierarchy of SITS.

Every error that crosses a module boundary is a `SitsError`. Two branches
matter to the rest of the system: `RetryableError` (the same work may
succeed later: connection lost, device out of memory, time-out) and
`PermanentError` (retrying cannot help: bad input, unknown model). The API
maps `http_status` to a response in one handler. Each class also names its
`failure_class`, the row of the retry matrix it falls in (`broker/failures/retry_policy.py`
classifies every failure by it; docs/failures.md). Third-party exceptions are
translated at the boundary (`raise DeviceOutOfMemory(...) from err`).
"""

from __future__ import annotations

from typing import Any


class SitsError(Exception):
    """Root of every SITS error; `message` says what was wrong and what to do."""

    http_status: int = 500
    retryable: bool = False
    code: str = "internal_error"
    failure_class: str = "transient"
    """The retry policy this error falls under (`retry.<class>` in the settings); an error of no
    better-known kind is taken as a transient one, as a crash of unknown cause was always retried."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_dict(self) -> dict[str, Any]:
        """The JSON body the API answers with."""
        return {"error": self.message, "code": self.code}


# --- retryable -------------------------------------------------------------


class RetryableError(SitsError):
    """The same work may succeed if tried again later."""

    retryable = True
    http_status = 503
    code = "unavailable"
    failure_class = "transient"


class ConnectionLost(RetryableError):
    """Redis (or the Celery broker) could not be reached."""

    code = "connection_lost"


class StoreFull(RetryableError):
    """Redis refused a write: it holds `maxmemory` and evicts nothing (as SITS needs)."""

    code = "store_full"


class StoreBusy(RetryableError):
    """Redis answered but cannot take the command now: it is running a long script (BUSY), refuses writes
    after a failed save (MISCONF), is a read-only replica (READONLY), or has lost its master (MASTERDOWN)."""

    code = "store_busy"


class StorageUnavailable(RetryableError):
    """A file system call failed for a reason that may pass (EAGAIN, EIO, ENOSPC: busy, a disk error,
    the disk full)."""

    code = "storage_unavailable"


class WorkerLost(RetryableError):
    """An item's lease expired before its worker finished it: the worker died, froze or lost Redis."""

    code = "worker_lost"
    failure_class = "worker_lost"


class DeviceOutOfMemory(RetryableError):
    """The device could not allocate memory for a batch."""

    code = "device_out_of_memory"
    failure_class = "device_oom"


class HostMemoryCapped(DeviceOutOfMemory):
    """A run would take ONNX Runtime past its worker's `resources.host_memory_limit`: out of memory as any
    (halved, retried), but once a model has run on the worker such a refusal is its request's own, as when
    a graph's allocation follows its input's values, and it counts on no breaker."""


class InferenceTimeout(RetryableError):
    """A batch or a wait ran past its time limit."""

    http_status = 504
    code = "timeout"
    failure_class = "run_timeout"


class QueueFull(RetryableError):
    """A model's queue (or one of its priority levels) holds `max_queue_size` waiting requests: the
    request was not queued. The API answers 429 with a `Retry-After` of `retry_after` seconds."""

    http_status = 429
    code = "queue_full"

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = max(1, int(retry_after))


class RunFailed(RetryableError):
    """An online request's runs kept failing (its workers died or errored) until its attempts ran out."""

    code = "run_failed"


# --- permanent -------------------------------------------------------------


class PermanentError(SitsError):
    """Retrying cannot help; the caller must change something."""

    http_status = 400
    code = "bad_request"
    failure_class = "bad_input"


class ConfigError(PermanentError):
    """The configuration file or a SITS_* variable is invalid."""

    code = "config_error"


class BadInput(PermanentError):
    """A request or an input file does not match what the model expects."""

    code = "bad_input"

    @classmethod
    def from_validation(cls, err: Any, what: str, prefix: str) -> BadInput:
        """A BadInput listing a pydantic ValidationError's problems, each as `field: message` (`what` for
        a problem of the whole object), after `prefix`."""
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or what}: {e['msg']}" for e in err.errors())
        return cls(f"{prefix}{problems}")


class InvalidModel(PermanentError):
    """An ONNX file is malformed, unreadable or unsafe (external data escaping its folder)."""

    http_status = 422
    code = "invalid_model"
    failure_class = "invalid_model"


class Cancelled(PermanentError):
    """The work was cancelled (its job stopped) while it ran."""

    http_status = 409
    code = "cancelled"
    failure_class = "cancelled"


class DeadlineInfeasible(PermanentError):
    """A job's deadline cannot be met with the work ahead of it (`broker/sla/admission.py`)."""

    http_status = 422
    code = "deadline_infeasible"

    def __init__(self, message: str, *, predicted_finish: float | None, earliest_deadline: float | None) -> None:
        super().__init__(message)
        self.predicted_finish = predicted_finish
        self.earliest_deadline = earliest_deadline

    def to_dict(self) -> dict[str, Any]:
        """The error with the predicted finish and the earliest deadline that would be accepted now
        (unix seconds; None when none was found)."""
        return {**super().to_dict(), "predicted_finish": self.predicted_finish,
                "earliest_deadline": self.earliest_deadline}


class PathNotAllowed(PermanentError):
    """A path lies outside the configured roots for its kind (models, inputs, outputs)."""

    http_status = 403
    code = "path_not_allowed"


class NotFound(PermanentError):
    """A named thing does not exist."""

    http_status = 404
    code = "not_found"


class ModelNotFound(NotFound):
    """No model (or no such version) is registered under that name."""

    code = "model_not_found"


class JobNotFound(NotFound):
    """No job has that id."""

    code = "job_not_found"


class FileMissing(NotFound):
    """A file the request names does not exist."""

    code = "file_not_found"


class Conflict(PermanentError):
    """The operation does not fit the object's current state (e.g. resuming a finished job)."""

    http_status = 409
    code = "conflict"


class BodyTimeout(PermanentError):
    """The request's body stopped arriving (`api.body_timeout`)."""

    http_status = 408
    code = "body_timeout"


class PayloadTooLarge(PermanentError):
    """A request body is larger than the configured limit."""

    http_status = 413
    code = "payload_too_large"


class Unauthorized(PermanentError):
    """No API key, or an unknown one."""

    http_status = 401
    code = "unauthorized"


class Forbidden(PermanentError):
    """The API key's role may not do this."""

    http_status = 403
    code = "forbidden"


class PriorityNotAllowed(Forbidden):
    """The work asks a priority above its tenant's `max_priority`."""

    code = "priority_not_allowed"


class TierNotAllowed(Forbidden):
    """The request names a `user_tier` its tenant's `user_tiers` do not hold."""

    code = "tier_not_allowed"


class ModelsAtLimit(Forbidden):
    """A registration would take its tenant's stored models past its `max_model_versions` or `max_model_bytes`."""

    code = "models_at_limit"


def error_for_code(code: str, message: str) -> SitsError:
    """The error of class `code` (its `code` attribute) carrying `message`, e.g. to answer a failed
    request with the HTTP status its worker's error had; a plain `SitsError` (500) for an unknown code."""
    pending: list[type[SitsError]] = [SitsError]
    while pending:
        kind = pending.pop()
        if kind.code == code:
            return kind(message)
        pending += kind.__subclasses__()
    return SitsError(message)
