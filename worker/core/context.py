"""What a handler gets besides its body: the transaction, and the outbox to publish through.

Everything a handler does through its ``Context`` belongs to the unit of work's one transaction:
``session`` (SQLAlchemy ORM), ``connection`` (SQLAlchemy Core) and ``asyncpg`` (the driver's own
connection, the fastest) share it, and ``publish`` only records an outbox row that is inserted in
the same transaction, so no event can exist without the effect that caused it.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, overload

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from worker.core.connection import HandlerConnection, HandlerSession
from worker.core.envelope import Envelope
from worker.core.events import Event
from worker.sql import outbox as outbox_sql
from worker.sql.rows import OutboxMessage


class _Session:
    """An ORM session on ``connection``, opened on first use, that joins its transaction and can
    only roll it back: the unit of work alone commits."""

    connection: AsyncConnection
    _session: AsyncSession | None

    @property
    def session(self) -> AsyncSession:
        """An ORM session bound to the unit of work's transaction; it cannot commit on its own."""
        if self._session is None:
            session = (
                HandlerSession if isinstance(self.connection, HandlerConnection) else AsyncSession
            )
            self._session = session(
                bind=self.connection,
                expire_on_commit=False,
                join_transaction_mode="rollback_only",
            )
        return self._session

    async def flush(self) -> None:
        """Send the session's pending ORM changes; called by the unit of work before commit."""
        if self._session is not None:
            await self._session.flush()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


@dataclass
class Context(_Session):
    """The handler's view of its unit of work."""

    connection: AsyncConnection
    envelope: Envelope
    default_exchange: str
    outbox: list[OutboxMessage] = field(default_factory=list)
    step: str | None = None
    _session: AsyncSession | None = None
    asyncpg: Any = None
    """The ``asyncpg.Connection`` under ``connection``, in the same transaction: statements sent on
    it skip SQLAlchemy's execution layer. Do not begin, commit or roll back on it."""
    batchmates: Sequence[Context] = field(default=(), repr=False, compare=False)
    """The contexts of the other messages handled in this transaction (and this one): an event
    one of them recorded is not in the database yet, so ``cancel`` looks for it here."""
    cancelled: list[uuid.UUID] = field(default_factory=list, repr=False, compare=False)
    """Message ids of batchmates' events this handler cancelled: dropped at commit, unless this
    handler's work is undone (``recorded``)."""

    @property
    def key(self) -> str:
        """The idempotency key of the message being handled."""
        return self.envelope.key

    @property
    def step_key(self) -> str:
        """``<key>:<step>`` inside a workflow step: the idempotency key to give an external
        service, the same on every re-run of the step; the plain key outside a workflow."""
        return self.key if self.step is None else f"{self.key}:{self.step}"

    @property
    def message_id(self) -> str | None:
        """The incoming message's id (for events from the relay: the outbox row's stable id)."""
        return self.envelope.delivery.message_id

    @property
    def attempt(self) -> int:
        """1 on a message's first try, n + 1 after n delayed retries (in-process tries aside)."""
        return self.envelope.delivery.attempt

    def publish(
        self,
        routing_key: str,
        body: Any,
        *,
        exchange: str | None = None,
        headers: Mapping[str, Any] | None = None,
        ordering_key: str | None = None,
        content_type: str | None = None,
        message_id: uuid.UUID | None = None,
        delay: timedelta | None = None,
        at: datetime | None = None,
    ) -> uuid.UUID:
        """Record an event in the outbox of this transaction and return its stable message id.

        ``body`` is JSON-encoded unless it is ``bytes`` (then give ``content_type``). The event
        goes to ``exchange`` (default: the worker's exchange) once the transaction commits; it
        carries the incoming message's correlation id, and its key as causation id. ``delay`` or
        ``at`` schedules it, as ``worker.outbox.publish`` does.
        """
        message = Event(
            routing_key,
            body,
            ordering_key=ordering_key,
            headers=headers,
            exchange=exchange,
            message_id=message_id,
            content_type=content_type,
            delay=delay,
            at=at,
        ).to_outbox(
            self.default_exchange,
            causation_id=self.envelope.key,
            correlation_id=self.envelope.correlation_id,
        )
        self.outbox.append(message)
        return message.message_id

    async def cancel(self, message_id: uuid.UUID) -> bool:
        """Take back the unpublished event ``message_id`` in this transaction (as
        ``worker.outbox.cancel``): one this handler, or the handler of another message of this
        transaction, published earlier in it is dropped before it is written; True if the event
        will now never be published."""
        for position, message in enumerate(self.outbox):
            if message.message_id == message_id:
                del self.outbox[position]
                return True
        if any(message_id in mate.cancelled for mate in self.batchmates):
            return False
        if any(m.message_id == message_id for mate in self.batchmates for m in mate.outbox):
            self.cancelled.append(message_id)
            return True
        return await outbox_sql.cancel(self.connection, message_id)


def recorded(contexts: Sequence[Context]) -> list[OutboxMessage]:
    """The events ``contexts`` recorded, in order, less those one of them cancelled."""
    cancelled = {message_id for ctx in contexts for message_id in ctx.cancelled}
    return [m for ctx in contexts for m in ctx.outbox if m.message_id not in cancelled]


class Batch(_Session, Sequence[Context]):
    """A batch handler's view of its unit of work: the ``Context`` of each message, in the order
    of the bodies it was given, and the one transaction they all share (``connection``,
    ``session``). Everything it writes commits, or rolls back, with the whole batch."""

    def __init__(
        self, connection: AsyncConnection, contexts: Sequence[Context], *, asyncpg: Any = None
    ) -> None:
        self.connection = connection
        self.asyncpg = asyncpg
        """The ``asyncpg.Connection`` of the batch's transaction (see ``Context.asyncpg``)."""
        self._contexts = list(contexts)
        self._session = None

    @overload
    def __getitem__(self, index: int) -> Context: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Context]: ...
    def __getitem__(self, index: int | slice) -> Context | Sequence[Context]:
        return self._contexts[index]

    def __len__(self) -> int:
        return len(self._contexts)
