"""The settings sections of the edge: `api` (the REST server) and `paths` (where files may be read and written)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, field_validator

from broker.setting_types import Bytes, Integer, Seconds, parse_size
from broker.setting_types import Section as _Section


class ApiSettings(_Section):
    """The REST edge."""

    host: str = "127.0.0.1"
    port: Integer = Field(8470, ge=0, le=65535)
    max_body_bytes: Bytes = parse_size("16MiB")
    body_timeout: Seconds = Field(default=30.0, gt=0)
    """The longest a request's body may pause, no byte of it arriving, once its headers came (a 408
    past it): a client that stops part-way must not hold a request thread for ever. (A client that
    trickles its body, or stalls inside its headers, is a slow client for a buffering proxy in front
    of the API to absorb, as gunicorn's documentation advises.)"""
    server: Literal["gunicorn", "granian"] = "gunicorn"
    """The HTTP server the embedded stack runs the API under. gunicorn (its gthread workers) answers
    malformed HTTP in the API's JSON error form and enforces `body_timeout`. granian (a Rust HTTP
    server; `pip install 'sits[granian]'`) costs about a quarter less CPU per online request, but its
    own HTTP layer answers malformed requests with a bare status and reads bodies before the app does
    (docs/operations.md, "The API's HTTP server")."""
    workers: Integer = Field(2, ge=1, le=64)
    """API server processes; each runs `threads` request threads."""
    threads: Integer = Field(16, ge=1, le=1024)
    """Request threads per API process; a `wait=true` call holds one while it waits."""
    max_waits_per_tenant: Integer = Field(8, ge=0)
    """Most calls of one tenant waiting for their results at once in one API process (v1 `wait`, v2
    `infer`); one more is a 429. Half the default `threads`, so one tenant never holds them all (0: no
    cap; admin keys are not capped)."""
    url: str = ""
    """The URL clients use; empty means http://host:port."""
    grpc_port: Integer = Field(8001, ge=0, le=65535)
    """The port of the KServe v2 gRPC server (`python -m sits_api.grpc`, Triton's 8001 by default) on
    `host`, beside the REST API; 0: no gRPC server runs."""

    def public_url(self) -> str:
        """The URL a client should call."""
        return self.url or f"http://{self.host}:{self.port}"

    def grpc_address(self) -> str:
        """The `host:port` a gRPC client dials ('' when no gRPC server runs: `grpc_port` 0)."""
        if not self.grpc_port:
            return ""
        return f"[{self.host}]:{self.grpc_port}" if ":" in self.host else f"{self.host}:{self.grpc_port}"


class PathSettings(_Section):
    """Where files may be read and written; every path a request names must lie in these roots."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)  # expand the defaults too

    home: Path = Path("~/.sits")
    model_roots: tuple[Path, ...] = (Path("."),)
    input_roots: tuple[Path, ...] = (Path("."),)
    output_roots: tuple[Path, ...] = (Path("."),)
    model_store: Path | None = None
    """Where registered model versions are copied; default `<home>/models`."""

    @field_validator("home", "model_store")
    @classmethod
    def _expand(cls, value: Path | None) -> Path | None:
        return None if value is None else value.expanduser().resolve()

    @field_validator("model_roots", "input_roots", "output_roots")
    @classmethod
    def _expand_roots(cls, value: tuple[Path, ...]) -> tuple[Path, ...]:
        return tuple(Path(root).expanduser().resolve() for root in value)

    def store(self) -> Path:
        """The folder that holds copies of registered models."""
        return self.model_store or self.home / "models"
