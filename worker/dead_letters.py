"""Parking a message in the dead-letter queue with the reason it could not be processed.

The parked copy keeps the original body and properties; ``x-worker-*`` headers say why
(machine-readable ``reason`` plus a human ``error``), which handler, and where it came from.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from aio_pika import DeliveryMode, Message
from aio_pika.abc import AbstractExchange, AbstractIncomingMessage

REASON = "x-worker-reason"
ERROR = "x-worker-error"
EXCEPTION_TYPE = "x-worker-exception-type"
HANDLER = "x-worker-handler"
ORIGINAL_EXCHANGE = "x-worker-original-exchange"
ORIGINAL_ROUTING_KEY = "x-worker-original-routing-key"
DEAD_LETTERED_AT = "x-worker-dead-lettered-at"

MAX_ERROR_LENGTH = 2000


def dead_letter_headers(
    message: AbstractIncomingMessage,
    *,
    reason: str,
    error: str,
    exception_type: str,
    handler: str | None,
) -> dict[str, Any]:
    """The original headers plus the ``x-worker-*`` headers that explain the parking."""
    headers: dict[str, Any] = dict(message.headers or {})
    headers.update(
        {
            REASON: reason,
            ERROR: error[:MAX_ERROR_LENGTH],
            EXCEPTION_TYPE: exception_type,
            ORIGINAL_EXCHANGE: message.exchange or "",
            ORIGINAL_ROUTING_KEY: message.routing_key or "",
            DEAD_LETTERED_AT: datetime.now(UTC).isoformat(),
        }
    )
    if handler is not None:
        headers[HANDLER] = handler
    return headers


async def park(
    dead_letter_exchange: AbstractExchange,
    message: AbstractIncomingMessage,
    *,
    reason: str,
    error: str,
    exception_type: str,
    handler: str | None = None,
) -> None:
    """Publish a copy of ``message`` to the dead-letter exchange and wait for the broker's confirm.

    The caller acks the original only after this returns: a crash in between parks it twice,
    never zero times.
    """
    copy = Message(
        body=message.body,
        headers=dead_letter_headers(
            message,
            reason=reason,
            error=error,
            exception_type=exception_type,
            handler=handler,
        ),
        content_type=message.content_type,
        content_encoding=message.content_encoding,
        correlation_id=message.correlation_id,
        message_id=message.message_id,
        timestamp=message.timestamp,
        type=message.type,
        app_id=message.app_id,
        delivery_mode=DeliveryMode.PERSISTENT,
    )
    await dead_letter_exchange.publish(copy, routing_key=message.routing_key or "", mandatory=True)
