"""Turning tracing on at a process's start, from the standard `OTEL_*` variables.

The API and the worker call `start_tracing` once, each with its own service name and its own
instrumentation (Flask, Celery). The rule (`tracing_wanted`) is the SDK's own variables, read so
that a process nobody asked to trace never imports the SDK: tracing is on when an exporter or an
OTLP endpoint is named, or `OTEL_SDK_DISABLED=false` asks for the SDK's defaults (OTLP to
localhost:4318); `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` keep it off whatever else is
set. Everything else (sampler, batch delays, endpoint, headers, resource attributes) the SDK reads
itself. docs/tracing.md says the same for users.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any

from broker.errors import ConfigError
from broker.tracing import spans

log = logging.getLogger(__name__)

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
"""An OTLP endpoint named in one of these turns tracing on (with the default exporter, `otlp`)."""

_EXPORTER_GROUP = "opentelemetry_traces_exporter"
"""The entry points the SDK's own exporters (and any installed one) are registered under."""


def tracing_wanted(environ: Mapping[str, str]) -> bool:
    """Whether the `OTEL_*` variables in `environ` ask this process to trace (the rule in the module's
    docstring)."""
    disabled = environ.get("OTEL_SDK_DISABLED", "").strip().lower()
    if disabled == "true":
        return False
    exporters = exporter_names(environ)
    if environ.get("OTEL_TRACES_EXPORTER", "").strip() and not exporters:
        return False  # only 'none'
    return bool(exporters) or any(environ.get(name, "").strip() for name in ENDPOINT_VARIABLES) or disabled == "false"


def exporter_names(environ: Mapping[str, str]) -> list[str]:
    """The exporters `OTEL_TRACES_EXPORTER` names (comma-separated, `none` left out); [] when unset."""
    names = [name.strip().lower() for name in environ.get("OTEL_TRACES_EXPORTER", "").split(",")]
    return [name for name in names if name and name != "none"]


def start_tracing(service_name: str, environ: Mapping[str, str]) -> bool:
    """Turn tracing on in this process when `environ` asks for it: an SDK tracer provider (the global one,
    which Flask's and Celery's instrumentations use) named `service_name` unless `OTEL_SERVICE_NAME` or
    `OTEL_RESOURCE_ATTRIBUTES` names it, with a batching processor per exporter. Returns whether tracing
    is on. ConfigError when it is asked for and cannot be: the `tracing` extra is not installed, or an
    exporter named is not."""
    if not tracing_wanted(environ):
        return False
    if spans.tracer() is not None:
        return True  # (once per process: a second app in the same process shares the first's provider)
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as err:
        raise ConfigError(f"the OTEL_* variables ask for traces, but OpenTelemetry is not installed ({err}): "
                          "pip install 'sits[tracing]', or set OTEL_SDK_DISABLED=true") from err
    named = environ.get("OTEL_SERVICE_NAME") or "service.name=" in environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    provider = TracerProvider(resource=Resource.create({} if named else {SERVICE_NAME: service_name}))
    for name in exporter_names(environ) or ["otlp"]:
        provider.add_span_processor(BatchSpanProcessor(_exporter(name, environ)))
    trace.set_tracer_provider(provider)
    spans.activate(provider)
    log.info("tracing on: %s sends its spans to %s", service_name, ", ".join(exporter_names(environ) or ["otlp"]))
    return True


def _exporter(name: str, environ: Mapping[str, str]) -> Any:
    """The span exporter `OTEL_TRACES_EXPORTER` calls `name`: `otlp` is OTLP over HTTP/protobuf (the
    default of `OTEL_EXPORTER_OTLP_PROTOCOL`), or gRPC when that protocol is `grpc`; any other name is
    looked up among the installed exporters (`console` is the SDK's)."""
    if name == "otlp":
        protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        name = "otlp_proto_grpc" if (protocol or "").strip().lower() == "grpc" else "otlp_proto_http"
    found = list(entry_points(group=_EXPORTER_GROUP, name=name))
    if not found:
        known = sorted({point.name for point in entry_points(group=_EXPORTER_GROUP)} | {"otlp", "none"})
        raise ConfigError(f"OTEL_TRACES_EXPORTER names the span exporter '{name}', which is not installed; "
                          f"use one of {', '.join(known)} (gRPC needs opentelemetry-exporter-otlp-proto-grpc)")
    return found[0].load()()
