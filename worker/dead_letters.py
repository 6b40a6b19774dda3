"""Where a failed message goes: the dead-letter queue, or a delayed-retry queue, and back.

A copy keeps the original body and properties; ``x-worker-*`` headers say why (machine-readable
``reason`` plus a human ``error``), which handler, how many tries failed, when the first one did,
and the routing key it came with. The original is acked only after the broker confirmed the
copy: a crash in between sends it twice, never zero times.

``list_parked`` and ``replay`` serve ``worker dlq``: a replayed message's failed state is cleared
first (so it runs again), then it is sent to the work queue and acked in the DLQ after the confirm.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from aio_pika import DeliveryMode, Message
from aio_pika.abc import (
    AbstractChannel,
    AbstractExchange,
    AbstractIncomingMessage,
    AbstractRobustConnection,
)
from sqlalchemy.ext.asyncio import AsyncEngine

from worker import queries
from worker.codec import storable
from worker.envelope import ATTEMPTS_HEADER, ROUTING_KEY_HEADER, Delivery, key_or_none
from worker.errors import HandlerFailed
from worker.router import Handler
from worker.settings import Settings

log = logging.getLogger(__name__)

REASON = "x-worker-reason"
ERROR = "x-worker-error"
EXCEPTION_TYPE = "x-worker-exception-type"
HANDLER = "x-worker-handler"
ATTEMPTS = ATTEMPTS_HEADER
FIRST_FAILURE_AT = "x-worker-first-failure-at"
ORIGINAL_EXCHANGE = "x-worker-original-exchange"
ORIGINAL_ROUTING_KEY = ROUTING_KEY_HEADER
DEAD_LETTERED_AT = "x-worker-dead-lettered-at"

FAILURE_HEADERS = frozenset(
    {REASON, ERROR, EXCEPTION_TYPE, HANDLER, ATTEMPTS, FIRST_FAILURE_AT, DEAD_LETTERED_AT}
)
"""Headers that describe a failure; a replayed message starts without them."""

MAX_ERROR_LENGTH = 2000


@dataclass(frozen=True)
class Failure:
    """Why a delivery failed, and the facts about it that travel with its copy.

    ``error`` is ``codec.storable``: no NUL, control character or lone surrogate can make the
    copy's headers or the inbox row that records it unwritable.
    """

    delivery: Delivery
    error: str
    exception_type: str
    handler: str | None = None

    @classmethod
    def of(cls, delivery: Delivery, exc: Exception, handler: Handler | None) -> Failure:
        """The failure ``exc`` of ``delivery``; a handler's own exception names its type."""
        return cls(
            delivery,
            error=storable(str(exc) or repr(exc), MAX_ERROR_LENGTH),
            exception_type=type(cause_of(exc)).__name__,
            handler=handler.name if handler is not None else None,
        )

    @property
    def attempts(self) -> int:
        """Failed deliveries including this one."""
        return self.delivery.failed_attempts + 1

    def headers(self, **extra: Any) -> dict[str, Any]:
        """The delivery's headers plus the ``x-worker-*`` ones that explain this failure."""
        headers: dict[str, Any] = dict(self.delivery.headers)
        now = datetime.now(UTC).isoformat()
        headers.setdefault(FIRST_FAILURE_AT, now)
        headers.setdefault(ORIGINAL_EXCHANGE, self.delivery.exchange)
        headers.update(
            {
                ERROR: self.error,
                EXCEPTION_TYPE: self.exception_type,
                ATTEMPTS: self.attempts,
                ORIGINAL_ROUTING_KEY: self.delivery.routing_key,
                **extra,
            }
        )
        if self.handler is not None:
            headers[HANDLER] = self.handler
        return headers

    def dead_letter_headers(self, reason: str) -> dict[str, Any]:
        """``headers`` of the copy parked in the dead-letter queue for ``reason``."""
        return self.headers(**{REASON: reason, DEAD_LETTERED_AT: datetime.now(UTC).isoformat()})


def cause_of(exc: BaseException) -> BaseException:
    """The exception a failure is about: a handler's own, rather than its ``HandlerFailed``."""
    return exc.__cause__ if isinstance(exc, HandlerFailed) and exc.__cause__ else exc


def copy_of(message: AbstractIncomingMessage, headers: Mapping[str, Any]) -> Message:
    """A persistent copy of ``message`` with ``headers`` instead of its own."""
    return Message(
        body=message.body,
        headers=dict(headers),
        content_type=message.content_type,
        content_encoding=message.content_encoding,
        correlation_id=message.correlation_id,
        message_id=message.message_id,
        timestamp=message.timestamp,
        type=message.type,
        app_id=message.app_id,
        delivery_mode=DeliveryMode.PERSISTENT,
    )


async def park(
    dead_letter_exchange: AbstractExchange,
    message: AbstractIncomingMessage,
    failure: Failure,
    *,
    reason: str,
) -> None:
    """Publish a copy of ``message`` to the dead-letter exchange; return after the confirm."""
    await dead_letter_exchange.publish(
        copy_of(message, failure.dead_letter_headers(reason)),
        routing_key=failure.delivery.routing_key,
        mandatory=True,
    )


async def schedule_retry(
    default_exchange: AbstractExchange,
    message: AbstractIncomingMessage,
    failure: Failure,
    *,
    retry_queue: str,
) -> None:
    """Publish a copy of ``message`` to ``retry_queue``, whose TTL sends it back to the work
    queue, and wait for the broker's confirm."""
    await default_exchange.publish(
        copy_of(message, failure.headers()), routing_key=retry_queue, mandatory=True
    )


@dataclass(frozen=True)
class Parked:
    """A message in the dead-letter queue, as ``worker dlq list`` shows it."""

    key: str | None
    handler: str | None
    reason: str
    error: str
    exception_type: str
    attempts: int
    first_failure_at: str
    routing_key: str
    message_id: str | None

    @classmethod
    def of(cls, message: AbstractIncomingMessage) -> Parked:
        headers = dict(message.headers or {})

        def text(name: str, default: str = "") -> str:
            value = headers.get(name)
            if isinstance(value, bytes):
                return value.decode("utf-8", "replace")
            return default if value is None else str(value)

        return cls(
            key=key_of(message),
            handler=text(HANDLER) or None,
            # without x-worker headers, the broker itself dead-lettered the message
            reason=text(REASON, "broker"),
            error=text(ERROR),
            exception_type=text(EXCEPTION_TYPE),
            attempts=attempts if isinstance(attempts := headers.get(ATTEMPTS), int) else 0,
            first_failure_at=text(FIRST_FAILURE_AT),
            routing_key=text(ORIGINAL_ROUTING_KEY) or message.routing_key or "",
            message_id=message.message_id,
        )


def key_of(message: AbstractIncomingMessage) -> str | None:
    """The message's idempotency key, or None when it has no valid one."""
    headers = message.headers or {}
    return key_or_none(
        Delivery(body=b"", routing_key="", headers=headers, message_id=message.message_id)
    )


@contextlib.asynccontextmanager
async def _browsing(
    connection: AbstractRobustConnection, settings: Settings, limit: int | None = None
) -> AsyncIterator[tuple[AbstractChannel, list[AbstractIncomingMessage]]]:
    """The DLQ's messages (the first ``limit``), taken unacked on a channel of their own; the
    ones the caller does not ack return to the queue, in their order, when the channel closes.

    Messages are taken until the queue has none left to give (a passive declare's message count
    can lag behind requeued messages, so it is not used as the bound).
    """
    channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
    try:
        queue = await channel.declare_queue(settings.dead_letter_queue, passive=True)
        messages: list[AbstractIncomingMessage] = []
        while limit is None or len(messages) < limit:
            message = await queue.get(no_ack=False, fail=False)
            if message is None:
                break
            messages.append(message)
        yield channel, messages
    finally:
        await channel.close()


async def list_parked(
    connection: AbstractRobustConnection, settings: Settings, *, limit: int | None = None
) -> list[Parked]:
    """The messages in the dead-letter queue, oldest first, left where they are."""
    async with _browsing(connection, settings, limit) as (_, messages):
        return [Parked.of(message) for message in messages]


async def replay(
    connection: AbstractRobustConnection,
    engine: AsyncEngine,
    settings: Settings,
    *,
    limit: int | None = None,
    key: str | None = None,
) -> list[Parked]:
    """Send parked messages (those with ``key``, at most ``limit``) back to the work queue.

    For each: its key's failed state is cleared (committed), the copy is published to the work
    queue through the default exchange with its original routing key in a header and without
    the failure headers, and the parked message is acked after the broker's confirm. A crash in
    between leaves the message parked or sends it twice; the inbox makes the second a duplicate.
    """
    replayed: list[Parked] = []
    async with _browsing(connection, settings, limit if key is None else None) as (
        channel,
        messages,
    ):
        for message in messages:
            if limit is not None and len(replayed) >= limit:
                break
            parked = Parked.of(message)
            if key is not None and parked.key != key:
                continue
            if parked.key is not None and parked.handler is not None:
                async with engine.begin() as conn:
                    await queries.clear_failure(conn, parked.handler, parked.key)
            headers = {
                name: value
                for name, value in (message.headers or {}).items()
                if name not in FAILURE_HEADERS and name != "x-death"
            }
            headers[ORIGINAL_ROUTING_KEY] = parked.routing_key
            await channel.default_exchange.publish(
                copy_of(message, headers), routing_key=settings.queue, mandatory=True
            )
            await message.ack()
            replayed.append(parked)
    return replayed
