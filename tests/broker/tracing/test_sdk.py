"""When a process traces: the standard OTEL_* variables decide, off unless they ask, and a request for
traces that cannot be met stops the process with what to do."""

from __future__ import annotations

import pytest

from broker.errors import ConfigError
from broker.tracing import spans
from broker.tracing.sdk import exporter_names, start_tracing, tracing_wanted

ENDPOINT = "http://collector:4318"


@pytest.mark.parametrize(("environ", "wanted"), [
    ({}, False),
    ({"OTEL_SERVICE_NAME": "api", "OTEL_TRACES_SAMPLER": "always_on"}, False),  # (nothing names where to send)
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": ENDPOINT + "/v1/traces"}, True),
    ({"OTEL_TRACES_EXPORTER": "console"}, True),
    ({"OTEL_TRACES_EXPORTER": "otlp,console"}, True),
    ({"OTEL_SDK_DISABLED": "false"}, True),  # the SDK's defaults: OTLP to localhost:4318
    ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}, False),
    ({"OTEL_SDK_DISABLED": "TRUE", "OTEL_TRACES_EXPORTER": "console"}, False),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}, False),
    ({"OTEL_TRACES_EXPORTER": " ", "OTEL_EXPORTER_OTLP_ENDPOINT": ""}, False),
])
def test_tracing_is_on_only_when_the_otel_variables_ask_for_it(environ: dict[str, str], wanted: bool) -> None:
    assert tracing_wanted(environ) is wanted


def test_the_exporters_are_the_ones_named_none_left_out() -> None:
    assert exporter_names({"OTEL_TRACES_EXPORTER": "OTLP, console,none"}) == ["otlp", "console"]
    assert exporter_names({}) == []


def test_an_exporter_that_is_not_installed_stops_the_start_with_the_names_to_use() -> None:
    with pytest.raises(ConfigError) as raised:
        start_tracing("sits-api", {"OTEL_TRACES_EXPORTER": "zipkin"})
    assert "'zipkin'" in raised.value.message and "console" in raised.value.message
    with pytest.raises(ConfigError, match="opentelemetry-exporter-otlp-proto-grpc"):
        start_tracing("sits-api", {"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    assert spans.tracer() is None  # (nothing turned on half-way)


def test_a_process_nobody_asked_to_trace_does_not_start_tracing() -> None:
    assert start_tracing("sits-worker", {"OTEL_SERVICE_NAME": "worker"}) is False
    assert spans.tracer() is None
