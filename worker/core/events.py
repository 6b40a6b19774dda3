"""An event as code records it for the outbox: checked and encoded once, when it is recorded.

``ctx.publish`` inside a handler and ``worker.outbox.publish`` in a producer's own transaction
both turn an ``Event`` into an ``OutboxMessage`` here, so both apply the same defaults and the
same checks. Invariant: a row that reaches the outbox can be published as it is. Whatever the
broker or the outbox's columns would refuse later (a routing key over AMQP's 255 bytes, a NUL
character, a body that is not JSON) is refused now, in the caller's transaction, where the caller
can still see the error, instead of failing on every attempt of the relay until it is parked.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from worker import tracing
from worker.core.codec import JSON_CONTENT_TYPE, encode_json, to_jsonable
from worker.core.envelope import IDEMPOTENCY_KEY_HEADER, check_key, storable_text, unstorable
from worker.errors import InvalidKey
from worker.sql.rows import OutboxMessage

MAX_SHORT_STRING_BYTES = 255
"""AMQP's limit for an exchange name and a routing key (a ``shortstr``), in UTF-8 bytes."""

MAX_DELAY = timedelta(days=36_525)
"""The longest ``delay`` an event may be scheduled with (a hundred years): anything longer is a
unit mistake, and past PostgreSQL's timestamps."""


@dataclass(frozen=True)
class Event:
    """One event to publish through the outbox (see ``worker.outbox.publish`` for each field).

    ``body`` is JSON-encoded unless it is ``bytes`` (then say what it is with ``content_type``).
    ``key`` becomes the event's ``idempotency-key`` header, so that a consumer of the event
    deduplicates it by that key; without one, a consumer keys it by its message id. ``delay`` (a
    ``timedelta``, from the start of the transaction by the database's clock) or ``at`` (an aware
    ``datetime``) schedules the event: the relay publishes it once the database's clock says it
    is due, never before.
    """

    routing_key: str
    body: Any
    key: str | None = None
    ordering_key: str | None = None
    headers: Mapping[str, Any] | None = None
    exchange: str | None = None
    message_id: uuid.UUID | None = None
    correlation_id: str | None = None
    content_type: str | None = None
    delay: timedelta | None = None
    at: datetime | None = None

    def to_outbox(
        self,
        default_exchange: str,
        *,
        causation_id: str | None = None,
        correlation_id: str | None = None,
        keyed: bool = False,
    ) -> OutboxMessage:
        """The outbox row of this event, checked; ``ValueError`` or ``TypeError`` if it could
        never be published. ``correlation_id`` applies when the event names none.

        The ``idempotency-key`` header is ``key``, else the one ``headers`` gives; with neither,
        a consumer of this worker keys the event by its message id, which ``keyed`` also writes
        into the header (for consumers that only read the header).
        """
        exchange = default_exchange if self.exchange is None else self.exchange
        _check_short_string("exchange", exchange, empty_ok=True)
        _check_short_string("routing_key", self.routing_key)
        message_id = self.message_id if self.message_id is not None else uuid.uuid4()
        if not isinstance(message_id, uuid.UUID):
            raise TypeError(f"message_id must be a uuid.UUID, not {type(message_id).__name__}")
        if isinstance(self.body, bytes):
            payload, kind = self.body, self.content_type or "application/octet-stream"
        else:
            payload, kind = encode_json(self.body), self.content_type or JSON_CONTENT_TYPE
        _check_text("content_type", kind)
        due_in, due_at = due(self.delay, self.at)
        headers = dict(self.headers or {})
        key = self.key if self.key is not None else headers.get(IDEMPOTENCY_KEY_HEADER)
        if key is None and keyed:
            key = str(message_id)
        if key is not None:
            try:
                headers[IDEMPOTENCY_KEY_HEADER] = check_key(key)
            except InvalidKey as exc:
                raise ValueError(str(exc)) from exc
        to_jsonable(headers)  # (raises here, not in the statement, for a value JSON cannot hold)
        tracing.inject(headers)
        correlation = self.correlation_id if self.correlation_id is not None else correlation_id
        for name, value in (("ordering_key", self.ordering_key), ("correlation_id", correlation)):
            if value is not None:
                _check_text(name, value)
        return OutboxMessage(
            message_id=message_id,
            exchange=exchange,
            routing_key=self.routing_key,
            body=payload,
            content_type=kind,
            headers=headers,
            correlation_id=correlation,
            causation_id=causation_id,
            ordering_key=self.ordering_key,
            due_in=due_in,
            due_at=due_at,
        )


def due(delay: timedelta | None, at: datetime | None) -> tuple[float | None, datetime | None]:
    """When a scheduled event is due, as ``OutboxMessage`` keeps it: seconds from the start of the
    transaction, or an aware instant; (None, None) for an event due at once. ``TypeError`` or
    ``ValueError`` for both at once, a naive ``at``, or a negative or absurd ``delay``."""
    if delay is not None and at is not None:
        raise ValueError("give delay or at, not both")
    if delay is not None:
        if not isinstance(delay, timedelta):
            raise TypeError(f"delay must be a datetime.timedelta, not {type(delay).__name__}")
        if delay < timedelta(0):
            raise ValueError("delay is negative")
        if delay > MAX_DELAY:
            raise ValueError(f"delay is longer than {MAX_DELAY.days} days")
        return delay.total_seconds(), None
    if at is not None:
        if not isinstance(at, datetime):
            raise TypeError(f"at must be a datetime.datetime, not {type(at).__name__}")
        if at.tzinfo is None or at.tzinfo.utcoffset(at) is None:
            raise ValueError("at is a naive datetime; give one with a timezone (e.g. UTC)")
        return None, at
    return None, None


def _check_short_string(name: str, value: object, *, empty_ok: bool = False) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, not {type(value).__name__}")
    if not value and not empty_ok:
        raise ValueError(f"{name} is empty")
    if len(value.encode("utf-8")) > MAX_SHORT_STRING_BYTES:
        raise ValueError(f"{name} is longer than {MAX_SHORT_STRING_BYTES} bytes (AMQP's limit)")
    if "\x00" in value:
        raise ValueError(f"{name} contains a NUL character")


def _check_text(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, not {type(value).__name__}")
    if not storable_text(value):
        raise ValueError(unstorable(name))
