"""The `models` settings section, what registration takes, and `repository`, the Triton model repositories served."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from broker.setting_types import Bytes, Integer, Seconds, parse_size
from broker.setting_types import Section as _Section

MAX_SERIALIZED_BYTES = 2**31 - 1
"""The most a model may hold, weights included: SITS serializes it whole (its version is the hash of
that), and protobuf cannot write a message over 2 GB."""


class ModelSettings(_Section):
    """Limits on the model files `POST /v1/models` registers."""

    max_file_size: Bytes = Field(parse_size("1GiB"), ge=1, le=MAX_SERIALIZED_BYTES)
    """The most bytes a model file and its external data may hold together, told from their sizes
    before any of it is read (413 past it): registration reads the whole model into a process of its own and
    runs it there (`sits_api.intake.model_checks`), so the limit bounds what one registration costs."""
    registrations_per_tenant: Integer = Field(1, ge=0)
    """Most registrations of one tenant at once in one API process (each loads, checks and runs its
    model); one more is a 429. 0: no cap; admin keys are not capped."""
    registration_threads: Integer = Field(2, ge=1, le=64)
    """Threads a process runs registrations on, apart from its request threads."""
    registration_wait: Seconds = Field(10.0, ge=0)
    """How long `POST /v1/models` waits for its registration: done by then, a 201 with the version; else a
    202 with a registration to poll (`GET /v1/models/registrations/{id}`)."""


class RepositorySettings(_Section):
    """Triton model repositories served as they are (docs/models.md, "A Triton model repository")."""

    paths: tuple[Path, ...] = ()
    """Folders of model folders (`config.pbtxt` and numbered version folders), loaded by the API at its
    start; `sitsctl up --model-repository DIR` adds one. Empty: none."""

    @field_validator("paths")
    @classmethod
    def _expand(cls, value: tuple[Path, ...]) -> tuple[Path, ...]:
        return tuple(Path(path).expanduser().resolve() for path in value)
