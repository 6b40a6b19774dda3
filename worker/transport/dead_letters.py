"""Where a failed message goes: a parked copy in the dead-letter queue, or a copy in a
delayed-retry queue.

A copy keeps the original body and properties; ``x-worker-*`` headers say why (machine-readable
``reason`` plus a human ``error``), which handler, how many tries failed, when the first one did,
and the routing key it came with. The original is acked only after the broker confirmed the
copy: a crash in between sends it twice, never zero times.

A parked copy also carries ``x-worker-parking-id``, the id of the worker's own record of it
(``worker.sql.parkings``), written before the copy is published: the headers are what a copy
says about itself, the record is what the worker knows. Anyone who can publish to the work
queue's exchange can make the broker dead-letter a message with headers of their choosing (an
``expiration``), so only a copy with a record is taken for one the worker parked.

This is the consumer's hot path only; what operators do with parked copies afterwards (``worker
dlq list``, ``replay``, ``purge``) is ``worker.ops.dlq``, which reads the headers written here.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from aio_pika.abc import AbstractChannel
from pamqp.commands import Basic
from pamqp.encode import field_table

from worker.core.codec import storable
from worker.core.envelope import ATTEMPTS_HEADER, ROUTING_KEY_HEADER, Delivery, key_or_none
from worker.core.handler import Handler
from worker.errors import HandlerFailed
from worker.sql.parkings import ParkingRow
from worker.transport.deliveries import Copyable
from worker.transport.publisher import persistent, publish_on

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
PARKING_ID = "x-worker-parking-id"
"""The id of the worker's record of a parked copy: a pointer to look the record up, no proof."""

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
        """The delivery's headers plus the ``x-worker-*`` ones that explain this failure (and
        without a parking id it came with: only a parked copy has one, its own)."""
        headers = {k: v for k, v in self.delivery.headers.items() if k != PARKING_ID}
        headers.setdefault(FIRST_FAILURE_AT, datetime.now(UTC).isoformat())
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

    def parking(self, reason: str, *, failed_key: bool) -> ParkingRow:
        """The worker's record of parking a copy of this delivery for ``reason`` (``failed_key``:
        its key is recorded as failed in the inbox too), under a new parking id."""
        return ParkingRow(
            parking_id=uuid.uuid4(),
            handler=self.handler,
            key=key_or_none(self.delivery),
            reason=reason,
            routing_key=storable(self.delivery.routing_key, MAX_ERROR_LENGTH),
            body_sha256=body_digest(self.delivery.body),
            failed_key=failed_key,
            error=self.error,
            exception_type=self.exception_type,
            attempts=self.attempts,
            first_failure_at=self.first_failure_at,
        )

    @property
    def first_failure_at(self) -> str:
        """When the message first failed: as its earlier delayed retry's copy said, else now."""
        first = self.delivery.headers.get(FIRST_FAILURE_AT)
        if isinstance(first, str) and first:
            return storable(first, 64)
        return datetime.now(UTC).isoformat()

    def dead_letter_headers(
        self, reason: str, parking_id: uuid.UUID | None = None
    ) -> dict[str, Any]:
        """``headers`` of the copy parked in the dead-letter queue for ``reason``, under the
        record ``parking_id`` when the worker recorded one."""
        headers = self.headers(**{REASON: reason, DEAD_LETTERED_AT: datetime.now(UTC).isoformat()})
        if parking_id is not None:
            headers[PARKING_ID] = str(parking_id)
        return headers


def body_digest(body: bytes) -> bytes:
    """The SHA-256 of a message body as it travels (not the canonical fingerprint of its JSON):
    what ties a parked copy to its record."""
    return hashlib.sha256(body).digest()


class CopyTooLarge(Exception):
    """The copy's headers would not fit in one AMQP frame: publishing it would make the broker
    close the whole connection (and every delivery in flight on it)."""


MAX_COPY_HEADER_BYTES = 128 * 1024 - 4096
"""Encoded header bytes a copy may carry: RabbitMQ's default ``frame_max`` (128 KiB), less room
for the other properties; the content header of a message must fit in one frame."""


def encodable(headers: Mapping[str, Any]) -> dict[str, Any]:
    """``headers`` that the AMQP client can write back: a value it read but cannot write (a long
    string that is not UTF-8 arrives as bytes, a double beyond a 32-bit float) becomes its
    ``repr``, so a copy is never refused for what another client put in a header. Raises
    ``CopyTooLarge`` when they would not fit in one frame."""
    written: dict[str, Any] = {}
    size = 0
    for name, value in headers.items():
        try:
            size += len(field_table({name: value}))
        except Exception:
            value = storable(repr(value), MAX_ERROR_LENGTH)
            size += len(field_table({name: value}))
        written[name] = value
    if size > MAX_COPY_HEADER_BYTES:
        raise CopyTooLarge(f"the copy's headers take {size} bytes; one frame holds less")
    return written


def cause_of(exc: BaseException) -> BaseException:
    """The exception a failure is about: a handler's own, rather than its ``HandlerFailed``."""
    return exc.__cause__ if isinstance(exc, HandlerFailed) and exc.__cause__ else exc


BROKER_HEADERS = frozenset({"x-delivery-count"})
"""Headers a quorum queue sets on each delivery: a copy leaves them off (its queue counts anew)."""


def moved_headers(message: Copyable) -> dict[str, Any]:
    """The headers of ``message``'s copy as it was published, to put in a queue again through the
    default exchange (``move``): a message that came through another exchange keeps the routing
    key it came with as ``ORIGINAL_ROUTING_KEY`` (the consumer routes by it)."""
    headers = {k: v for k, v in (message.headers or {}).items() if k not in BROKER_HEADERS}
    if message.exchange:
        headers[ORIGINAL_ROUTING_KEY] = message.routing_key or ""
    return headers


def copy_properties(message: Copyable, headers: Mapping[str, Any]) -> Basic.Properties:
    """The properties of a persistent copy of ``message`` with ``headers`` (made ``encodable``)
    instead of its own: the rest of its properties as they were."""
    return persistent(
        message_id=message.message_id,
        headers=encodable(headers),
        content_type=message.content_type,
        correlation_id=message.correlation_id,
        timestamp=message.timestamp,
        content_encoding=message.content_encoding,
        message_type=message.type,
        app_id=message.app_id,
    )


async def park(
    channel: AbstractChannel,
    dead_letter_exchange: str,
    message: Copyable,
    failure: Failure,
    parking: ParkingRow,
) -> None:
    """Publish a copy of ``message`` to the dead-letter exchange as ``parking`` (recorded before,
    see the module docstring); return after the confirm."""
    await publish_on(
        channel,
        message.body,
        copy_properties(message, failure.dead_letter_headers(parking.reason, parking.parking_id)),
        exchange=dead_letter_exchange,
        routing_key=failure.delivery.routing_key,
    )


async def schedule_retry(
    channel: AbstractChannel,
    message: Copyable,
    failure: Failure,
    *,
    retry_queue: str,
) -> None:
    """Publish a copy of ``message`` to ``retry_queue``, whose TTL sends it back to the work
    queue, and wait for the broker's confirm."""
    await publish_on(
        channel,
        message.body,
        copy_properties(message, failure.headers()),
        exchange="",
        routing_key=retry_queue,
    )


async def move(channel: AbstractChannel, message: Copyable, *, queue: str) -> None:
    """Publish ``message``'s copy with ``moved_headers`` to ``queue`` through the default
    exchange, and wait for the broker's confirm."""
    properties = copy_properties(message, moved_headers(message))
    await publish_on(channel, message.body, properties, exchange="", routing_key=queue)
