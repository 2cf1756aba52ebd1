"""Tracing in tests: SITS's spans recorded in memory, with the SDK's own in-memory exporter.

Only for tests in this process; a stack's processes export over OTLP instead (tests/e2e/test_tracing.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from broker.tracing import spans


@contextmanager
def recorded_spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on for the block, every span SITS ends kept in the exporter yielded; off again after."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    spans.activate(provider)
    try:
        yield exporter
    finally:
        spans.deactivate()
        provider.shutdown()


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    """The finished spans called `name`, in the order they ended."""
    return [span for span in exporter.get_finished_spans() if span.name == name]


def traceparent_of(span: ReadableSpan) -> str:
    """The W3C `traceparent` that names `span`."""
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"
