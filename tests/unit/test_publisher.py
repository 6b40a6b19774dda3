"""The properties the lean publisher sends for an outbox row or a failure copy are, byte for byte,
those aio-pika's ``Message`` held when they were published through it."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import aio_pika
import pytest
from aiormq.abc import DeliveredMessage
from pamqp.commands import Basic
from pamqp.header import ContentHeader

from worker.sql.outbox import OutboxRow
from worker.transport.dead_letters import copy_properties, encodable, moved_headers
from worker.transport.publisher import properties_of


def row(correlation_id: str | None, headers: dict[str, object]) -> OutboxRow:
    return OutboxRow(
        id=1,
        message_id=uuid.uuid4(),
        exchange="events",
        routing_key="payment.settled",
        body=b'{"n": 1}',
        content_type="application/json",
        headers=dict(headers),
        correlation_id=correlation_id,
        causation_id="cause-1",
        ordering_key=None,
        attempts=0,
        created_at=datetime(2026, 11, 26, 1, 2, 3, tzinfo=UTC),
    )


def as_aio_pika_built_it(r: OutboxRow) -> Basic.Properties:
    """The relay's message before the lean publisher (``relay.message_of``), as aio-pika sent it."""
    correlation_id = r.correlation_id
    headers = {**r.headers, "causation-id": r.causation_id}
    if correlation_id is not None:
        headers["correlation-id"] = correlation_id
        if len(correlation_id.encode("utf-8")) > 255:
            correlation_id = None
    return aio_pika.Message(
        r.body,
        headers=headers,
        content_type=r.content_type,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        message_id=str(r.message_id),
        correlation_id=correlation_id,
        timestamp=r.created_at,
    ).properties


def encoded(properties: Basic.Properties) -> bytes:
    return ContentHeader(0, 8, properties).marshal()


@pytest.mark.parametrize(
    ("correlation_id", "headers"),
    [
        (None, {}),
        ("corr-1", {"tenant": "t1"}),
        ("k" * 255, {"n": 3, "nested": {"a": [1, "b"]}}),
        ("ü" * 200, {"tenant": "t1"}),  # 400 bytes: only the header carries it
    ],
)
def test_an_outbox_rows_properties_are_those_aio_pika_sent(
    correlation_id: str | None, headers: dict[str, object]
) -> None:
    r = row(correlation_id, headers)
    assert encoded(properties_of(r)) == encoded(as_aio_pika_built_it(r))


def test_a_long_correlation_id_travels_in_the_header_only() -> None:
    properties = properties_of(row("ü" * 200, {}))
    assert properties.correlation_id is None
    assert properties.headers is not None
    assert properties.headers["correlation-id"] == "ü" * 200
    assert properties.delivery_mode == 2


def incoming(exchange: str, headers: dict[str, object]) -> aio_pika.IncomingMessage:
    """A delivery as aio-pika hands it to the consumer, every copied property set."""
    properties = Basic.Properties(
        content_type="application/json",
        content_encoding="utf-8",
        headers=headers,
        delivery_mode=1,
        correlation_id="corr-1",
        message_id="m-1",
        timestamp=datetime(2026, 11, 26, 1, 2, 3, tzinfo=UTC),
        message_type="payment.requested",
        app_id="shop",
    )
    delivered = DeliveredMessage(
        delivery=Basic.Deliver("ctag", 7, False, exchange, "payment.requested"),
        header=ContentHeader(0, 2, properties),
        body=b"{}",
        channel=None,  # type: ignore[arg-type]
    )
    return aio_pika.IncomingMessage(delivered, no_ack=True)


def aio_pika_copy(
    message: aio_pika.IncomingMessage, headers: dict[str, object]
) -> aio_pika.Message:
    """The copy the worker published through aio-pika before it built properties itself: the
    reference its properties must equal, byte for byte."""
    return aio_pika.Message(
        body=message.body,
        headers=encodable(headers),
        content_type=message.content_type,
        content_encoding=message.content_encoding,
        correlation_id=message.correlation_id,
        message_id=message.message_id,
        timestamp=message.timestamp,
        type=message.type,
        app_id=message.app_id,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
    )


@pytest.mark.parametrize("exchange", ["", "events"])
def test_a_failure_copys_properties_are_those_aio_pika_sent(exchange: str) -> None:
    message = incoming(exchange, {"idempotency-key": "k-1", "x-delivery-count": 2})
    headers = {"x-worker-reason": "handler-failed", "n": 1}
    assert encoded(copy_properties(message, headers)) == encoded(
        aio_pika_copy(message, headers).properties
    )
    moved = moved_headers(message)
    assert encoded(copy_properties(message, moved)) == encoded(
        aio_pika_copy(message, moved).properties
    )
