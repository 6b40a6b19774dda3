"""OpenTelemetry (the ``otel`` extra): a unit of work is a consumer span continuing the trace the
message carried, and the events it publishes carry that span's context through the outbox."""

from __future__ import annotations

from typing import Any

import pytest
from aio_pika.abc import AbstractRobustConnection
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.payments import router as payments
from tests.helpers import payment, rows
from tests.integration.support import publish, running_worker, settled
from worker.settings import Settings

EXPORTER = InMemorySpanExporter()


@pytest.fixture
def spans() -> InMemorySpanExporter:
    """Spans recorded by the SDK (installed once per process; cleared for each test)."""
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
        trace.set_tracer_provider(provider)
    EXPORTER.clear()
    return EXPORTER


async def test_a_unit_of_work_continues_the_trace_into_the_events_it_publishes(
    settings: Settings,
    engine: AsyncEngine,
    amqp: AbstractRobustConnection,
    spans: InMemorySpanExporter,
) -> None:
    # Given a producer that sends a payment inside a span of its own
    producer = trace.get_tracer("test.producer")
    headers: dict[str, Any] = {}
    with producer.start_as_current_span("send payment") as sending:
        propagate.inject(headers)
    trace_id = sending.get_span_context().trace_id

    async with running_worker(settings.replace(relay=False), payments) as worker:
        channel = await amqp.channel(publisher_confirms=True)
        await publish(channel, settings, payment("p-trace"), key="k-trace", headers=headers)
        await settled(worker, processed=1)

    # Then the worker's span is a consumer span in the producer's trace, with the message's facts
    [unit] = [s for s in spans.get_finished_spans() if s.name == "payment.requested process"]
    assert unit.kind == trace.SpanKind.CONSUMER
    assert unit.context.trace_id == trace_id
    assert unit.parent is not None
    assert unit.parent.span_id == sending.get_span_context().span_id
    assert unit.attributes is not None
    assert unit.attributes["worker.idempotency_key"] == "k-trace"
    assert unit.attributes["worker.handler"] == "payment.requested"
    assert unit.attributes["worker.outcome"] == "processed"

    # And the event it published carries the worker's span as its parent
    [(event_headers,)] = await rows(engine, "SELECT headers FROM outbox")
    assert event_headers["traceparent"].split("-")[1:3] == [
        f"{trace_id:032x}",
        f"{unit.context.span_id:016x}",
    ]
