"""What a delivery is before and after the checks that precede any database work.

``Delivery`` holds the transport facts of one incoming message; ``open_envelope`` turns it into an
``Envelope`` (handler, idempotency key, validated body, fingerprint) or raises a ``Rejected`` that
names the reason. Nothing here touches the database or the broker.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from worker.core.codec import DEFAULT_MAX_DEPTH, DEFAULT_MAX_ITEMS, decode_fingerprinted
from worker.core.handler import Handler, Handlers
from worker.errors import (
    BodyTooLarge,
    InvalidKey,
    InvalidProperty,
    MissingKey,
    NoHandler,
    Rejected,
)
from worker.sql.rows import MAX_ATTEMPTS, InboxKey, KeyClaim

IDEMPOTENCY_KEY_HEADER = "idempotency-key"
CORRELATION_HEADER = "correlation-id"
MAX_KEY_LENGTH = 512

ATTEMPTS_HEADER = "x-worker-attempts"
"""How many deliveries of this message failed before (set on delayed retries and dead letters)."""

ROUTING_KEY_HEADER = "x-worker-original-routing-key"
"""The routing key a message was first published with, kept when it travels through the
default exchange (a delayed retry or a replay) whose routing key is the work queue's name."""


@dataclass(frozen=True)
class Delivery:
    """One incoming message as the broker handed it over, independent of the client library."""

    body: bytes
    routing_key: str
    headers: Mapping[str, Any] = field(default_factory=dict)
    message_id: str | None = None
    correlation_id: str | None = None
    content_type: str | None = None
    exchange: str = ""
    redelivered: bool = False

    @property
    def failed_attempts(self) -> int:
        """Deliveries of this message that failed before this one (0 on a first delivery)."""
        value = self.headers.get(ATTEMPTS_HEADER, 0)  # (an AMQP boolean is no count)
        return min(value, MAX_ATTEMPTS - 1) if type(value) is int and value > 0 else 0

    @property
    def attempt(self) -> int:
        """Which try this delivery is: 1 for the first, n + 1 after n delayed retries."""
        return self.failed_attempts + 1


@dataclass(frozen=True)
class Envelope:
    """A delivery that passed every check and is ready for its unit of work."""

    delivery: Delivery
    handler: Handler
    key: str
    payload: Any
    fingerprint: bytes

    @property
    def inbox_key(self) -> InboxKey:
        """(handler name, idempotency key): the effect this envelope applies."""
        return self.handler.name, self.key

    @property
    def claim(self) -> KeyClaim:
        """The inbox row this envelope claims, or records as failed."""
        return KeyClaim(
            self.handler.name,
            self.key,
            self.fingerprint,
            self.delivery.message_id,
            self.delivery.routing_key,
        )

    @property
    def correlation_id(self) -> str:
        """The incoming correlation id (the property, else the ``correlation-id`` header that
        carries one too long for the property), or the key when the message carries none."""
        header = self.delivery.headers.get(CORRELATION_HEADER)
        return self.delivery.correlation_id or (
            header if isinstance(header, str) and header else self.key
        )


def idempotency_key(delivery: Delivery) -> str:
    """The ``idempotency-key`` header, else the message_id; raises if neither fits."""
    raw = delivery.headers.get(IDEMPOTENCY_KEY_HEADER)
    if raw is None or raw == "" or raw == b"":
        raw = delivery.message_id
    if raw is None or raw == "":
        raise MissingKey()
    if isinstance(raw, bytes | bytearray):  # pamqp reads an AMQP byte array as bytearray
        try:
            raw = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidKey("idempotency key is not UTF-8") from exc
    return check_key(raw)


def check_key(raw: object) -> str:
    """``raw`` as an idempotency key the inbox can store, or ``InvalidKey``: a non-empty string
    of at most ``MAX_KEY_LENGTH`` characters with no NUL. The one rule for every key, however it
    arrives (a header, a producer's ``key=``, an HTTP ``Idempotency-Key``)."""
    if not isinstance(raw, str):
        raise InvalidKey(f"idempotency key must be a string, not {type(raw).__name__}")
    if not raw:
        raise InvalidKey("idempotency key is empty")
    if len(raw) > MAX_KEY_LENGTH:
        raise InvalidKey(f"idempotency key is longer than {MAX_KEY_LENGTH} characters")
    if "\x00" in raw:
        raise InvalidKey("idempotency key contains a NUL character")
    return raw


def check_properties(delivery: Delivery) -> None:
    """Refuse a message_id or correlation id that the inbox and outbox could not store: one
    with a NUL character (PostgreSQL text cannot hold it), or one longer than a key may be."""
    header = delivery.headers.get(CORRELATION_HEADER)
    for name, value in (
        ("message_id", delivery.message_id),
        ("correlation_id", delivery.correlation_id),
        (CORRELATION_HEADER, header if isinstance(header, str) else None),
    ):
        if value is not None and not storable_text(value):
            raise InvalidProperty(unstorable(name))


def storable_text(value: str) -> bool:
    """Whether an identifier the inbox and outbox keep as text (a message id, a correlation id,
    an ordering key) can be stored: no NUL character, at most ``MAX_KEY_LENGTH`` characters."""
    return "\x00" not in value and len(value) <= MAX_KEY_LENGTH


def unstorable(name: str) -> str:
    """Why ``name`` failed ``storable_text``."""
    return f"{name} contains a NUL character or is longer than {MAX_KEY_LENGTH} characters"


def key_or_none(delivery: Delivery) -> str | None:
    """The delivery's idempotency key, or None when it has no valid one."""
    try:
        return idempotency_key(delivery)
    except Rejected:
        return None


def open_envelope(
    delivery: Delivery,
    router: Handlers,
    *,
    max_body_bytes: int,
    max_depth: int = DEFAULT_MAX_DEPTH,
    max_items: int = DEFAULT_MAX_ITEMS,
    decoded: tuple[Any, bytes] | None = None,
) -> Envelope:
    """Check ``delivery`` in order: size, routing, key, properties, JSON (its nesting depth and
    item count first), validation; the first failure wins. ``decoded``: the body's value and
    fingerprint, when the caller made the body from that very value (the ingress's canonical
    body), which is then not decoded again."""
    if len(delivery.body) > max_body_bytes:
        raise BodyTooLarge(f"body has {len(delivery.body)} bytes; the limit is {max_body_bytes}")
    handler = router.find(delivery.routing_key)
    if handler is None:
        raise NoHandler(f"no handler for routing key {delivery.routing_key!r}")
    key = idempotency_key(delivery)
    check_properties(delivery)
    value, digest = decoded or decode_fingerprinted(
        delivery.body, delivery.content_type, max_depth=max_depth, max_items=max_items
    )
    payload = handler.validate(value)
    return Envelope(delivery, handler, key, payload, digest)
