"""The API's traces: one per HTTP request (Flask's instrumentation), which SITS's own spans join.

A request's span continues the client's `traceparent` header when it sends one (the W3C trace
context, and the propagators `OTEL_PROPAGATORS` names); the spans of what it queues are its
children, and the items carry their trace on to the workers (`broker.tracing.spans`). Off unless the
`OTEL_*` variables ask for it (`broker.tracing.sdk.tracing_wanted`): nothing of OpenTelemetry is
imported then.
"""

from __future__ import annotations

from collections.abc import Mapping

from flask import Flask

from broker.tracing.sdk import start_tracing


def instrument_app(app: Flask, environ: Mapping[str, str]) -> bool:
    """Trace `app`'s requests when `environ` asks for traces; whether it does. Called before any other
    request hook is added, so a request refused by one (a wrong key's 401) has its span too."""
    if not start_tracing("sits-api", environ):
        return False
    from opentelemetry.instrumentation.flask import FlaskInstrumentor

    FlaskInstrumentor.instrument_app(app)
    return True
