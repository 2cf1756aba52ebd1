"""The spans of a SITS process, and the trace context an item carries in its payload (W3C `traceparent`).

Tracing is off until the process turns it on (`broker.tracing.sdk.start_tracing`, at its start, from the
standard `OTEL_*` variables). While it is off every function here returns after one read of a global
and imports nothing of OpenTelemetry, so the hot paths pay nothing measurable.

A queued item's payload holds the `traceparent` of the span that queued it (`traceparent_field`): the
worker that leases it continues that trace (`item_context`), and the span of the batch that runs it,
which serves many traces at once, links to it. docs/tracing.md lists the spans.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

if TYPE_CHECKING:  # (the optional `tracing` extra: never imported at run time while tracing is off)
    from opentelemetry.context import Context
    from opentelemetry.trace import Tracer, TracerProvider

P = ParamSpec("P")
R = TypeVar("R")

TRACEPARENT = "traceparent"
"""The payload field (and HTTP header) of the W3C trace context: `00-<trace id>-<parent span id>-<flags>`."""

_tracer: Tracer | None = None
"""SITS's tracer while tracing is on; None while it is off (the one thing every helper reads first)."""


def activate(provider: TracerProvider) -> None:
    """Turn tracing on in this process, its spans made by `provider` (`sdk.start_tracing`; tests pass
    one with an in-memory exporter)."""
    global _tracer
    _tracer = provider.get_tracer("sits")


def deactivate() -> None:
    """Turn tracing off again (tests)."""
    global _tracer
    _tracer = None


def tracer() -> Tracer | None:
    """SITS's tracer, or None while tracing is off."""
    return _tracer


def traceparent_field() -> dict[str, str]:
    """`{'traceparent': ...}` of the current span, to add to the payload of an item queued under it; {}
    while tracing is off or no span is current. Computed once per call, not once per item."""
    if _tracer is None:
        return {}
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)  # (W3C whatever OTEL_PROPAGATORS says: what workers read back)
    return {TRACEPARENT: carrier[TRACEPARENT]} if TRACEPARENT in carrier else {}


def carried(payload: Mapping[str, Any]) -> dict[str, str]:
    """The `traceparent` field of `payload`, to copy into the payload of an item made from it (a job's
    finalize step from its last chunk): {} when it has none. A plain copy, so it needs tracing on in the
    worker that copies no more than the item needed it."""
    value = payload.get(TRACEPARENT)
    return {TRACEPARENT: value} if isinstance(value, str) else {}


def item_context(payload: Mapping[str, Any]) -> Context | None:
    """The trace context an item's payload carries, as the parent of the spans of its own trace; None
    while tracing is off, or when it carries none (queued untraced) or a malformed one."""
    if _tracer is None or not isinstance(payload.get(TRACEPARENT), str):
        return None
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    context = TraceContextTextMapPropagator().extract({TRACEPARENT: payload[TRACEPARENT]})
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def traced(name: str, attributes: Callable[..., Mapping[str, Any]] | None = None
           ) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Run the decorated function in a span `name`, the current span's child, with the `attributes`
    computed from its arguments (only while tracing is on). An exception marks the span failed."""

    def decorate(function: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(function)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            if _tracer is None:
                return function(*args, **kwargs)
            with _tracer.start_as_current_span(name, attributes=attributes(*args, **kwargs) if attributes else None):
                return function(*args, **kwargs)

        return wrapper

    return decorate


@contextlib.contextmanager
def detached() -> Iterator[None]:
    """Run the block outside any trace: what it starts (a drain ticket sent on for its next time slice)
    begins a trace of its own instead of growing the current one for ever."""
    if _tracer is None:
        yield
        return
    from opentelemetry import context

    token = context.attach(context.Context())
    try:
        yield
    finally:
        context.detach(token)


def bind_current(function: Callable[[], R]) -> Callable[[], R]:
    """`function`, to run on another thread in the current trace context (a chunk's commit thread acks it
    under its batch's span); itself while tracing is off."""
    if _tracer is None:
        return function
    return functools.partial(contextvars.copy_context().run, function)


def seconds_to_ns(seconds: float) -> int:
    """A `time.time()` instant as OpenTelemetry's nanoseconds since the epoch."""
    return int(seconds * 1e9)
