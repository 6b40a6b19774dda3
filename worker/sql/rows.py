"""The plain rows the SQL layer takes and returns: no handler-API objects, so the statements in
``worker.sql`` depend on nothing above them and the core can hand them plain values.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

MAX_ATTEMPTS = 1_000_000
"""The most attempts a delivery is taken to have made, this one included: a forged
``x-worker-attempts`` of 2**40 counts as this many (past any retry chain), and sums of it fit
the inbox's integer column."""

InboxKey = tuple[str, str]
"""(handler name, idempotency key): what identifies an effect in the inbox."""


@dataclass(frozen=True)
class KeyClaim:
    """The inbox row a delivery claims (or records as failed): its key, the fingerprint of its
    payload, and the transport facts kept for operators."""

    handler: str
    key: str
    fingerprint: bytes
    message_id: str | None
    routing_key: str

    @property
    def inbox_key(self) -> InboxKey:
        return self.handler, self.key


@dataclass(frozen=True)
class InboxEntry:
    """The committed record of a key that someone else already claimed."""

    status: str
    fingerprint: bytes
    result: Any
    error: str | None


@dataclass(frozen=True)
class OutboxMessage:
    """An event recorded by a handler, published by the relay after the transaction commits.

    A scheduled event (``due_in`` seconds from the transaction's start by the database's clock,
    or at ``due_at``; at most one of them) is kept in ``outbox_scheduled`` until it is due.
    """

    message_id: uuid.UUID
    exchange: str
    routing_key: str
    body: bytes
    content_type: str
    headers: Mapping[str, Any]
    correlation_id: str | None
    causation_id: str | None
    ordering_key: str | None
    due_in: float | None = None
    due_at: datetime | None = None

    @property
    def scheduled(self) -> bool:
        """Whether the event waits in ``outbox_scheduled`` until it is due."""
        return self.due_in is not None or self.due_at is not None
