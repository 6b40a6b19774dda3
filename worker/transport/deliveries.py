"""A delivery of the work queue as the consumer holds it: taken from aiormq's ``basic_consume``
(no aio-pika ``IncomingMessage`` per delivery), kept as a small record until it is settled.

Invariant: a ``Received`` names the aiormq channel it came on, the only channel its delivery tag
means anything on; once that channel has closed (``void``) the tag is dead: it is never settled
(the broker delivers the message again), and a new channel's tags are never confused with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import aiormq.abc
from pamqp.commands import Basic


class Copyable(Protocol):
    """What a copy of a delivery (``dead_letters.copy_properties``) reads of it: a ``Received``,
    or an aio-pika message an operator command took with ``basic.get``."""

    @property
    def body(self) -> bytes: ...
    @property
    def headers(self) -> Any: ...
    @property
    def content_type(self) -> str | None: ...
    @property
    def content_encoding(self) -> str | None: ...
    @property
    def correlation_id(self) -> str | None: ...
    @property
    def message_id(self) -> str | None: ...
    @property
    def timestamp(self) -> datetime | None: ...
    @property
    def type(self) -> str | None: ...
    @property
    def app_id(self) -> str | None: ...
    @property
    def exchange(self) -> str | None: ...
    @property
    def routing_key(self) -> str | None: ...


@dataclass(frozen=True, slots=True, eq=False)
class Received:
    """One delivery of the work queue: its ``body``, AMQP ``properties``, where it was routed,
    and its ``delivery_tag`` on ``channel`` (aiormq's), the channel it is settled on."""

    body: bytes
    properties: Basic.Properties
    delivery_tag: int
    redelivered: bool
    exchange: str
    routing_key: str
    channel: aiormq.abc.AbstractChannel

    @property
    def void(self) -> bool:
        """True once its channel has closed: its tag can no longer be settled."""
        return self.channel.is_closed

    @property
    def headers(self) -> dict[str, Any]:
        return self.properties.headers or {}

    @property
    def message_id(self) -> str | None:
        return self.properties.message_id

    @property
    def correlation_id(self) -> str | None:
        return self.properties.correlation_id

    @property
    def content_type(self) -> str | None:
        return self.properties.content_type

    @property
    def content_encoding(self) -> str | None:
        return self.properties.content_encoding

    @property
    def timestamp(self) -> datetime | None:
        return self.properties.timestamp

    @property
    def type(self) -> str | None:
        return self.properties.message_type

    @property
    def app_id(self) -> str | None:
        return self.properties.app_id


def received_from(message: aiormq.abc.DeliveredMessage) -> Received:
    """The record of a delivery aiormq handed to a consumer (a ``Basic.Deliver``)."""
    delivery = message.delivery
    assert isinstance(delivery, Basic.Deliver)
    assert delivery.delivery_tag is not None
    return Received(
        body=message.body,
        properties=message.header.properties,
        delivery_tag=delivery.delivery_tag,
        redelivered=bool(delivery.redelivered),
        exchange=delivery.exchange or "",
        routing_key=delivery.routing_key or "",
        channel=message.channel,
    )
