"""``worker dlq``: what operators do with the copies parked in the dead-letter queue — list
them, replay them, purge them.

``browse``, ``replaying`` and ``purging`` take the DLQ one message at a time, unacked, and hold no
body but the current one, so memory stays bounded whatever the queue holds; a message they leave
returns to its place when their channel closes, so the queue's order never changes. A replayed
message's failed state is cleared first (so it runs again), then it is sent to the work queue and
acked in the DLQ after the confirm; a copy parked longer ago than ``inbox_retention`` is not
replayed without ``force``, because its key may have left the inbox.

The copies and their ``x-worker-*`` headers are made by ``worker.transport.dead_letters`` on the
consumer's hot path; this module only reads them.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from worker.core.envelope import Delivery, key_or_none
from worker.settings import Settings
from worker.sql import inbox
from worker.transport.dead_letters import (
    ATTEMPTS,
    DEAD_LETTERED_AT,
    ERROR,
    EXCEPTION_TYPE,
    FIRST_FAILURE_AT,
    HANDLER,
    ORIGINAL_ROUTING_KEY,
    REASON,
    copy_of,
)

FAILURE_HEADERS = frozenset(
    {REASON, ERROR, EXCEPTION_TYPE, HANDLER, ATTEMPTS, FIRST_FAILURE_AT, DEAD_LETTERED_AT}
)
"""Headers that describe a failure; a replayed message starts without them."""


@dataclass(frozen=True)
class Parked:
    """A message in the dead-letter queue, as ``worker dlq`` shows it: its headers, not its body."""

    key: str | None
    handler: str | None
    reason: str
    error: str
    exception_type: str
    attempts: int
    first_failure_at: str
    routing_key: str
    message_id: str | None
    dead_lettered_at: datetime | None = None

    @classmethod
    def of(cls, message: AbstractIncomingMessage) -> Parked:
        headers = dict(message.headers or {})

        def text(name: str, default: str = "") -> str:
            value = headers.get(name)
            if isinstance(value, bytes):
                return value.decode("utf-8", "replace")
            return default if value is None else str(value)

        # without x-worker headers, the broker itself dead-lettered the message
        reason = text(REASON) or BROKER_REASONS.get(text("x-first-death-reason"), "broker")
        return cls(
            key=key_of(message),
            handler=text(HANDLER) or None,
            reason=reason,
            error=text(ERROR) or BROKER_ERRORS.get(reason, ""),
            exception_type=text(EXCEPTION_TYPE),
            attempts=attempts if isinstance(attempts := headers.get(ATTEMPTS), int) else 0,
            first_failure_at=text(FIRST_FAILURE_AT),
            routing_key=text(ORIGINAL_ROUTING_KEY) or message.routing_key or "",
            message_id=message.message_id,
            dead_lettered_at=_parse_time(text(DEAD_LETTERED_AT)) or _broker_death_time(headers),
        )


def key_of(message: AbstractIncomingMessage) -> str | None:
    """The message's idempotency key, or None when it has no valid one."""
    headers = message.headers or {}
    return key_or_none(
        Delivery(body=b"", routing_key="", headers=headers, message_id=message.message_id)
    )


def _parse_time(value: str) -> datetime | None:
    """An ISO 8601 time (UTC when it names no zone), or None when ``value`` is not one."""
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


BROKER_REASONS = {"delivery_limit": "delivery-limit"}
"""Reasons of the broker's own dead-lettering (``x-first-death-reason``) shown by name; the
others (a rejected or expired message) show as ``broker``."""

BROKER_ERRORS = {
    "delivery-limit": "delivered the work queue's delivery_limit times without a settlement"
}
"""What a reason of the broker's own dead-lettering means, shown as the error."""


def _broker_death_time(headers: Mapping[str, Any]) -> datetime | None:
    """When the broker last dead-lettered a message it parked itself (``x-death``'s newest
    entry), or None."""
    deaths = headers.get("x-death")
    if not isinstance(deaths, list) or not deaths or not isinstance(deaths[0], Mapping):
        return None
    moment = deaths[0].get("time")
    if not isinstance(moment, datetime):
        return None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


@dataclass(frozen=True)
class Selection:
    """Which parked messages a ``worker dlq`` command takes: those matching every filter given
    (None matches anything)."""

    key: str | None = None
    reason: str | None = None
    handler: str | None = None

    def matches(self, parked: Parked) -> bool:
        return all(
            wanted is None or wanted == found
            for wanted, found in (
                (self.key, parked.key),
                (self.reason, parked.reason),
                (self.handler, parked.handler),
            )
        )

    @property
    def filters(self) -> bool:
        """True when at least one filter is set."""
        return any(value is not None for value in (self.key, self.reason, self.handler))


EVERYTHING = Selection()


@dataclass(frozen=True)
class Outcome:
    """What a bulk command did with one selected message: ``done`` (replayed, purged; in a dry
    run: would be), or left parked because ``refused`` says why not."""

    parked: Parked
    refused: str | None = None

    @property
    def done(self) -> bool:
        return self.refused is None


Act = Callable[[AbstractChannel, AbstractIncomingMessage, Parked], Awaitable[str | None]]
"""What a bulk command does with one selected message: None when done, else why it refused."""


async def _left_parked(
    channel: AbstractChannel, message: AbstractIncomingMessage, parked: Parked
) -> None:
    """``list``'s action: none; the message returns to its place when the channel closes."""


async def _sweep(
    connection: AbstractRobustConnection,
    settings: Settings,
    act: Act,
    *,
    selection: Selection,
    limit: int | None,
    parked_before: datetime | None = None,
) -> AsyncGenerator[Outcome, None]:
    """Take the DLQ's messages one at a time, oldest first, and ``act`` on each one that
    ``selection`` matches, until ``limit`` are done or the queue has none left to give.

    Every message is taken unacked on a channel of its own: one the action does not ack returns
    to its place in the queue when the channel closes. Only the current message's body is held;
    the rest are delivery tags on the broker, so memory stays bounded by one message whatever
    the queue holds. A passive declare's message count can lag behind requeued messages, so it
    is not the bound. With ``parked_before``, messages parked later (a replayed message failing
    again, say) are left alone, so a sweep never takes back what it sent.
    """
    channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
    try:
        queue = await channel.declare_queue(settings.dead_letter_queue, passive=True)
        done = 0
        while limit is None or done < limit:
            message = await queue.get(no_ack=False, fail=False)
            if message is None:
                break
            parked = Parked.of(message)
            if not selection.matches(parked) or _parked_later(parked, parked_before):
                continue
            outcome = Outcome(parked, await act(channel, message, parked))
            del message  # the body goes; the delivery tag stays with the channel
            done += outcome.done
            yield outcome
    finally:
        await channel.close()


def _parked_later(parked: Parked, moment: datetime | None) -> bool:
    """True when ``parked`` was dead-lettered after ``moment`` (never when either is unknown)."""
    if moment is None or parked.dead_lettered_at is None:
        return False
    return parked.dead_lettered_at > moment


def browse(
    connection: AbstractRobustConnection,
    settings: Settings,
    *,
    selection: Selection = EVERYTHING,
    limit: int | None = None,
) -> AsyncGenerator[Outcome, None]:
    """The parked messages ``selection`` matches (the first ``limit``), oldest first, one at a
    time; they all stay where they are. Close the iterator (``contextlib.aclosing``) when
    leaving it early."""
    return _sweep(connection, settings, _left_parked, selection=selection, limit=limit)


async def list_parked(
    connection: AbstractRobustConnection,
    settings: Settings,
    *,
    selection: Selection = EVERYTHING,
    limit: int | None = None,
) -> list[Parked]:
    """``browse``'s messages as a list (their headers only), left where they are."""
    async with contextlib.aclosing(
        browse(connection, settings, selection=selection, limit=limit)
    ) as found:
        return [outcome.parked async for outcome in found]


def replaying(
    connection: AbstractRobustConnection,
    engine: AsyncEngine,
    settings: Settings,
    *,
    selection: Selection = EVERYTHING,
    limit: int | None = None,
    force: bool = False,
    dry_run: bool = False,
) -> AsyncGenerator[Outcome, None]:
    """Send parked messages that ``selection`` matches (at most ``limit``) back to the work
    queue, one at a time, and say what happened to each.

    For each: its key's failed state is cleared (committed), the copy is published to the work
    queue through the default exchange with its original routing key in a header and without
    the failure headers, and the parked message is acked after the broker's confirm. A crash in
    between leaves the message parked or sends it twice; the inbox makes the second a duplicate.

    A message parked longer than ``inbox_retention`` ago (or at an unknown time) is refused and
    stays parked unless ``force``: its key's inbox row may have expired, and then nothing would
    stop the replay from applying an effect a second time. ``dry_run`` changes nothing.
    """
    started = datetime.now(UTC)
    oldest = started - timedelta(seconds=settings.inbox_retention)

    async def send_back(
        channel: AbstractChannel, message: AbstractIncomingMessage, parked: Parked
    ) -> str | None:
        if not force and (refusal := _too_old(parked, oldest)):
            return refusal
        if not dry_run:
            await _replay_one(channel, engine, settings, message, parked)
        return None

    return _sweep(
        connection,
        settings,
        send_back,
        selection=selection,
        limit=limit,
        parked_before=started,
    )


def _too_old(parked: Parked, oldest: datetime) -> str | None:
    """Why ``parked`` may not be replayed without ``--force``, or None when it may."""
    if parked.dead_lettered_at is None:
        return "parked at an unknown time (no x-worker-dead-lettered-at): use --force to replay"
    if parked.dead_lettered_at < oldest:
        return (
            "parked longer ago than inbox_retention: its key may have expired from the inbox, "
            "so a replay could apply it twice; use --force to replay"
        )
    return None


async def _replay_one(
    channel: AbstractChannel,
    engine: AsyncEngine,
    settings: Settings,
    message: AbstractIncomingMessage,
    parked: Parked,
) -> None:
    """Clear ``parked``'s failed key, publish its copy to the work queue, ack it after the
    confirm."""
    if parked.key is not None and parked.handler is not None:
        async with engine.begin() as conn:
            await inbox.clear_failure(conn, parked.handler, parked.key)
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


async def replay(
    connection: AbstractRobustConnection,
    engine: AsyncEngine,
    settings: Settings,
    *,
    limit: int | None = None,
    key: str | None = None,
    force: bool = False,
) -> list[Parked]:
    """``replaying`` the messages with ``key`` (all when None); the ones replayed."""
    replayed = replaying(
        connection, engine, settings, selection=Selection(key=key), limit=limit, force=force
    )
    async with contextlib.aclosing(replayed) as outcomes:
        return [outcome.parked async for outcome in outcomes if outcome.done]


def purging(
    connection: AbstractRobustConnection,
    settings: Settings,
    *,
    selection: Selection,
    limit: int | None = None,
    dry_run: bool = False,
) -> AsyncGenerator[Outcome, None]:
    """Delete (ack) the parked messages that ``selection`` matches, at most ``limit``, one at a
    time; the others stay in their order. Messages parked after the purge began are left.
    ``dry_run`` changes nothing."""
    started = datetime.now(UTC)

    async def delete(
        channel: AbstractChannel, message: AbstractIncomingMessage, parked: Parked
    ) -> None:
        if not dry_run:
            await message.ack()

    return _sweep(
        connection, settings, delete, selection=selection, limit=limit, parked_before=started
    )
