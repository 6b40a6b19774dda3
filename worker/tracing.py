"""OpenTelemetry spans, when the ``opentelemetry`` API is installed (the ``otel`` extra).

Without it every function here does nothing. With it, a delivery's unit of work runs in a
consumer span whose parent is the ``traceparent`` the message carried, and each event a handler
publishes carries the ``traceparent`` of that span in its headers, so a trace follows a message
through the outbox to the next consumer. Correlation and causation ids flow either way (see
``Context.publish``); tracing only adds spans.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

try:
    from opentelemetry import propagate, trace
except ImportError:  # pragma: no cover - exercised where the extra is not installed
    propagate = trace = None  # type: ignore[assignment]

TRACER_NAME = "worker"


@contextlib.contextmanager
def span(
    name: str,
    attributes: Mapping[str, Any],
    *,
    parent_headers: Mapping[str, Any] | None = None,
) -> Iterator[Any]:
    """A span named ``name`` around the block (a consumer span when ``parent_headers`` carry the
    producer's context); yields it, or None without OpenTelemetry."""
    if trace is None:
        yield None
        return
    parent = None
    kind = trace.SpanKind.INTERNAL
    if parent_headers is not None:
        carrier = {k: v for k, v in parent_headers.items() if isinstance(v, str)}
        parent = propagate.extract(carrier)
        kind = trace.SpanKind.CONSUMER
    tracer = trace.get_tracer(TRACER_NAME)
    clean = {k: v for k, v in attributes.items() if v is not None}
    with tracer.start_as_current_span(name, context=parent, kind=kind, attributes=clean) as s:
        yield s


def inject(headers: MutableMapping[str, Any]) -> None:
    """Add the current span's context (``traceparent``) to outgoing ``headers``."""
    if propagate is not None:
        propagate.inject(headers)


def set_attribute(current: Any, name: str, value: Any) -> None:
    """Set an attribute on a span from ``span``, if there is one."""
    if current is not None and value is not None:
        current.set_attribute(name, value)
