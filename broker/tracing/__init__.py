"""Traces: the spans SITS makes, the trace context its items carry through Redis, and the SDK set-up.

Off unless the standard `OTEL_*` variables ask for it (`sdk.tracing_wanted`); while off, nothing of
OpenTelemetry is imported by this package (docs/tracing.md).
"""
