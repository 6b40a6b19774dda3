"""``worker dlq``: what operators do with the copies parked in the dead-letter queue — list
them, show one, replay them, purge them.

Provenance: a copy is the worker's own only if the worker's record of it (``worker.sql.parkings``,
found by the copy's ``x-worker-parking-id``) exists and names the copy's body (SHA-256) and key.
Then that record, never the headers, says its handler, key, reason and routing key. Any other
copy (made by the broker's own dead-lettering, of a message whose headers anyone who may publish
to the events exchange chose) is ``unverified``: listed with its ``x-worker-*`` headers as claims,
never replayed without ``force``, and a forced replay sends it back as a fresh delivery that
clears no inbox row, so the consumer's own checks (its key's inbox row) decide. A purge takes an
unverified copy only when asked for them (``--reason unverified``) or for everything.

``browse``, ``replaying`` and ``purging`` take the DLQ one message at a time, unacked, and hold no
body but the current one, so memory stays bounded whatever the queue holds; a message they leave
returns to its place when their channel closes, so the queue's order never changes. A replayed
message's failed state is cleared first (only when its record says the worker recorded it), then
it is sent to the work queue and acked in the DLQ after the confirm (a purged one's record is
deleted; a replayed one's stays until it expires); a copy parked longer ago than
``inbox_retention`` is not replayed without ``force``, because its key may have left the inbox.

The copies, their ``x-worker-*`` headers and their records are made by
``worker.transport.dead_letters`` and ``worker.transport.failures`` on the consumer's hot path;
this module only reads them (and deletes the records of copies it purges).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from worker.core.envelope import Delivery, key_or_none
from worker.errors import Reason
from worker.settings import Settings
from worker.sql import inbox, parkings
from worker.sql.parkings import ParkingRow
from worker.transport.dead_letters import (
    ATTEMPTS,
    BROKER_HEADERS,
    DEAD_LETTERED_AT,
    ERROR,
    EXCEPTION_TYPE,
    FIRST_FAILURE_AT,
    HANDLER,
    ORIGINAL_ROUTING_KEY,
    PARKING_ID,
    REASON,
    body_digest,
    copy_properties,
)
from worker.transport.publisher import publish_on

UNVERIFIED = "unverified"
"""The reason a copy without the worker's record of it is listed with (its own is a claim)."""

REASONS: tuple[str, ...] = (*(reason.value for reason in Reason), UNVERIFIED)
"""Every reason a parked copy can be listed with: what ``--reason`` accepts."""

BROKER_DEATH_HEADERS = frozenset(
    {
        "x-death",
        "x-first-death-reason",
        "x-first-death-queue",
        "x-first-death-exchange",
        "x-last-death-reason",
        "x-last-death-queue",
        "x-last-death-exchange",
    }
)
"""Headers the broker's dead-lettering adds: a replayed copy starts without them."""

CLAIMED_HEADERS = {
    "reason": REASON,
    "handler": HANDLER,
    "routing_key": ORIGINAL_ROUTING_KEY,
    "error": ERROR,
    "attempts": ATTEMPTS,
    "dead_lettered_at": DEAD_LETTERED_AT,
    "parking_id": PARKING_ID,
    "broker_reason": "x-first-death-reason",
}
"""What an unverified copy's headers claim, by the name ``worker dlq`` shows it under."""


def header_text(value: object) -> str:
    """A header's (or property's) value as text: bytes decoded, anything else by ``str``."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _text(headers: Mapping[str, Any], name: str, default: str = "") -> str:
    """Header ``name`` as text (``header_text``), else ``default``."""
    value = headers.get(name)
    return default if value is None else header_text(value)


@dataclass(frozen=True)
class Parked:
    """A message in the dead-letter queue, as ``worker dlq`` shows it.

    For a copy the worker parked (``verified``), ``key``, ``handler``, ``reason``,
    ``routing_key`` and ``dead_lettered_at`` are the worker's record's; ``error`` and the other
    failure facts are the headers the worker wrote. For any other copy, ``reason`` is
    ``unverified``, ``unverified_because`` says why, ``handler`` is None, ``key`` is its own
    idempotency key (the one a fresh delivery would run under), ``routing_key`` the one the
    broker routed it by, and what its ``x-worker-*`` headers say is in ``claims``.
    """

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
    parking_id: uuid.UUID | None = None
    failed_key: bool = False
    unverified_because: str | None = None
    claims: Mapping[str, str] = field(default_factory=dict)
    body_sha256: bytes = b""

    @property
    def verified(self) -> bool:
        """True when the worker's own record says it parked this copy."""
        return self.unverified_because is None

    @property
    def id(self) -> str:
        """What ``worker dlq show`` finds the copy by: its parking id when verified, else its
        body's SHA-256 (its first 16 hex digits): an unverified copy has no id the worker made."""
        if self.parking_id is not None and self.verified:
            return str(self.parking_id)
        return f"sha256:{self.body_sha256.hex()[:16]}"

    @classmethod
    def of(
        cls, message: AbstractIncomingMessage, record: ParkingRow | None, settings: Settings
    ) -> Parked:
        """``message`` as the worker's ``record`` of it (found by its parking id) says, or as an
        unverified copy when there is none or it names another body or key."""
        headers = dict(message.headers or {})
        digest = body_digest(message.body)
        key = key_of(message)
        why = _unverified_because(headers, record, digest, key)
        if record is not None and why is None:
            attempts = headers.get(ATTEMPTS)
            return cls(
                key=record.key,
                handler=record.handler,
                reason=record.reason,
                error=_text(headers, ERROR),
                exception_type=_text(headers, EXCEPTION_TYPE),
                attempts=attempts if isinstance(attempts, int) else 0,
                first_failure_at=_text(headers, FIRST_FAILURE_AT),
                routing_key=record.routing_key,
                message_id=message.message_id,
                dead_lettered_at=record.parked_at,
                parking_id=record.parking_id,
                failed_key=record.failed_key,
                body_sha256=digest,
            )
        claims = {
            shown: text for shown, name in CLAIMED_HEADERS.items() if (text := _text(headers, name))
        }
        if broker_reason := claims.get("broker_reason"):
            claims["broker_reason"] = BROKER_REASONS.get(broker_reason, broker_reason)
        return cls(
            key=key,
            handler=None,
            reason=UNVERIFIED,
            error="",
            exception_type="",
            attempts=0,
            first_failure_at="",
            routing_key=broker_routing_key(message, settings),
            message_id=message.message_id,
            dead_lettered_at=_broker_death_time(headers),
            unverified_because=why or "no record",
            claims=claims,
            body_sha256=digest,
        )


def parking_id_of(message: AbstractIncomingMessage) -> uuid.UUID | None:
    """The parking id ``message`` carries, or None when it carries none that is one."""
    try:
        return uuid.UUID(_text(message.headers or {}, PARKING_ID))
    except ValueError:
        return None


def _unverified_because(
    headers: Mapping[str, Any], record: ParkingRow | None, digest: bytes, key: str | None
) -> str | None:
    """Why a copy with ``headers``, body ``digest`` and ``key`` is not the one ``record``
    (found by its parking id) says the worker parked; None when it is."""
    if not _text(headers, PARKING_ID):
        return "no x-worker-parking-id"
    if record is None:
        return "no record of its parking id"
    if record.body_sha256 != digest:
        return "its body is not the one the worker parked"
    if record.key != key:
        return "its idempotency key is not the one the worker parked"
    return None


def broker_routing_key(message: AbstractIncomingMessage, settings: Settings) -> str:
    """The routing key an unverified copy is replayed by: the one the broker dead-lettered it
    with, unless that is the work queue's name (it reached the work queue through the default
    exchange: a delayed retry, or a return to a quorum queue); then the one its
    ``x-worker-original-routing-key`` names, which the consumer routes such a message by too.
    Only the worker and operators may publish through the default exchange
    (``worker.ops.permissions``), so a producer cannot choose that header's routing key."""
    routing_key = message.routing_key or ""
    if routing_key == settings.queue:
        return _text(message.headers or {}, ORIGINAL_ROUTING_KEY) or routing_key
    return routing_key


def key_of(message: AbstractIncomingMessage) -> str | None:
    """The message's idempotency key, or None when it has no valid one."""
    headers = message.headers or {}
    return key_or_none(
        Delivery(body=b"", routing_key="", headers=headers, message_id=message.message_id)
    )


BROKER_REASONS = {"delivery_limit": "delivery-limit"}
"""Reasons of the broker's own dead-lettering (``x-first-death-reason``) shown by the worker's
spelling; the others (``rejected``, ``expired``) as the broker names them."""


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
    (None matches anything). ``reason`` ``unverified`` selects the copies without the worker's
    record; ``handler`` matches only copies with one (an unverified copy's handler is a claim)."""

    key: str | None = None
    reason: str | None = None
    handler: str | None = None
    id: str | None = None

    def matches(self, parked: Parked) -> bool:
        return all(
            wanted is None or wanted == found
            for wanted, found in (
                (self.key, parked.key),
                (self.reason, parked.reason),
                (self.handler, parked.handler),
                (self.id, parked.id),
            )
        )

    @property
    def filters(self) -> bool:
        """True when at least one filter is set."""
        return any(value is not None for value in (self.key, self.reason, self.handler, self.id))


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


async def _parked(
    engine: AsyncEngine, settings: Settings, message: AbstractIncomingMessage
) -> Parked:
    """``message`` as ``Parked``, with the worker's record of its parking id if there is one."""
    record = None
    if (parking_id := parking_id_of(message)) is not None:
        async with engine.connect() as conn:
            record = await parkings.find_parking(conn, parking_id)
    return Parked.of(message, record, settings)


async def _sweep(
    connection: AbstractRobustConnection,
    engine: AsyncEngine,
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
            parked = await _parked(engine, settings, message)
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
    engine: AsyncEngine,
    settings: Settings,
    *,
    selection: Selection = EVERYTHING,
    limit: int | None = None,
) -> AsyncGenerator[Outcome, None]:
    """The parked messages ``selection`` matches (the first ``limit``), oldest first, one at a
    time; they all stay where they are. Close the iterator (``contextlib.aclosing``) when
    leaving it early."""
    return _sweep(connection, engine, settings, _left_parked, selection=selection, limit=limit)


async def list_parked(
    connection: AbstractRobustConnection,
    engine: AsyncEngine,
    settings: Settings,
    *,
    selection: Selection = EVERYTHING,
    limit: int | None = None,
) -> list[Parked]:
    """``browse``'s messages as a list (their headers only), left where they are."""
    async with contextlib.aclosing(
        browse(connection, engine, settings, selection=selection, limit=limit)
    ) as found:
        return [outcome.parked async for outcome in found]


@dataclass(frozen=True)
class Shown:
    """A parked message in full, as ``worker dlq show`` prints it: what ``Parked`` says of it,
    its properties, its headers as they are and its body."""

    parked: Parked
    properties: Mapping[str, Any]
    headers: Mapping[str, Any]
    body: bytes


async def find(
    connection: AbstractRobustConnection, engine: AsyncEngine, settings: Settings, copy_id: str
) -> list[Shown]:
    """The parked messages whose ``Parked.id`` is ``copy_id`` (one, unless copies share a body
    and none has a record), in full; they all stay where they are."""
    found: list[Shown] = []

    async def keep(
        channel: AbstractChannel, message: AbstractIncomingMessage, parked: Parked
    ) -> None:
        properties = {
            "message_id": message.message_id,
            "correlation_id": message.correlation_id,
            "content_type": message.content_type,
            "content_encoding": message.content_encoding,
            "type": message.type,
            "app_id": message.app_id,
            "timestamp": message.timestamp,
            "routing_key": message.routing_key,
        }
        found.append(Shown(parked, properties, dict(message.headers or {}), message.body))

    sweep = _sweep(connection, engine, settings, keep, selection=Selection(id=copy_id), limit=None)
    async with contextlib.aclosing(sweep) as outcomes:
        async for _ in outcomes:
            pass
    return found


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

    For each copy the worker parked: if its record says its key was recorded as failed, that
    failed state (and no other) is cleared (committed); the copy is published to the work queue
    through the default exchange with its recorded routing key in a header and without the
    failure headers; the parked message is acked after the broker's confirm. A crash in between
    leaves the message parked or sends it twice; the inbox makes the second a duplicate.

    Refused and left parked unless ``force``: a copy parked longer than ``inbox_retention`` ago
    (its key's inbox row may have expired, and then nothing would stop the replay from applying
    an effect a second time), and an unverified copy. A forced unverified copy goes back as a
    fresh delivery: no inbox row is cleared, every ``x-worker-*`` and dead-lettering header is
    dropped, and it is routed by ``broker_routing_key``. ``dry_run`` changes nothing.
    """
    started = datetime.now(UTC)
    oldest = started - timedelta(seconds=settings.inbox_retention)

    async def send_back(
        channel: AbstractChannel, message: AbstractIncomingMessage, parked: Parked
    ) -> str | None:
        if not force and (refusal := _unverified(parked) or _too_old(parked, oldest)):
            return refusal
        if not dry_run:
            await _replay_one(channel, engine, settings, message, parked)
        return None

    return _sweep(
        connection,
        engine,
        settings,
        send_back,
        selection=selection,
        limit=limit,
        parked_before=started,
    )


def _unverified(parked: Parked) -> str | None:
    """Why ``parked`` may not be replayed without ``--force`` for want of provenance."""
    if parked.verified:
        return None
    return (
        f"unverified ({parked.unverified_because}): the worker has no record of parking it; "
        "--force replays it as a fresh delivery that clears no inbox row"
    )


def _too_old(parked: Parked, oldest: datetime) -> str | None:
    """Why ``parked`` may not be replayed without ``--force`` for its age, or None when it may."""
    if parked.dead_lettered_at is None:
        return "parked at an unknown time: use --force to replay"
    if parked.dead_lettered_at < oldest:
        return (
            "parked longer ago than inbox_retention: its key may have expired from the inbox, "
            "so a replay could apply it twice; use --force to replay"
        )
    return None


def _fresh_headers(headers: Mapping[str, Any]) -> dict[str, Any]:
    """``headers`` without what a failure or a dead-lettering added: no ``x-worker-*`` header,
    no ``x-death``, no delivery count."""
    return {
        name: value
        for name, value in headers.items()
        if not name.startswith("x-worker-")
        and name not in BROKER_DEATH_HEADERS
        and name not in BROKER_HEADERS
    }


async def _replay_one(
    channel: AbstractChannel,
    engine: AsyncEngine,
    settings: Settings,
    message: AbstractIncomingMessage,
    parked: Parked,
) -> None:
    """Clear the failed key ``parked``'s record names (if it names one), publish its copy to the
    work queue, ack it after the confirm. The record stays (it expires): a second copy of the
    same parking, however it came about, is still the worker's, and its replay a duplicate."""
    if parked.verified and parked.failed_key and parked.handler and parked.key is not None:
        async with engine.begin() as conn:
            await inbox.clear_failure(conn, parked.handler, parked.key)
    headers = _fresh_headers(message.headers or {})
    headers[ORIGINAL_ROUTING_KEY] = parked.routing_key
    properties = copy_properties(message, headers)
    await publish_on(channel, message.body, properties, exchange="", routing_key=settings.queue)
    await message.ack()


async def _forget(engine: AsyncEngine, parked: Parked) -> None:
    """Delete the record of ``parked``'s copy, which was purged (a crash before leaves a record
    without a copy: harmless, it expires)."""
    if parked.verified and parked.parking_id is not None:
        async with engine.begin() as conn:
            await parkings.forget_parking(conn, parked.parking_id)


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
    engine: AsyncEngine,
    settings: Settings,
    *,
    selection: Selection,
    limit: int | None = None,
    dry_run: bool = False,
) -> AsyncGenerator[Outcome, None]:
    """Delete (ack) the parked messages that ``selection`` matches, at most ``limit``, one at a
    time, and their records; the others stay in their order. Messages parked after the purge
    began are left. An unverified copy is deleted only when ``selection`` asks for unverified
    copies or for everything (no filter): a claim in its headers never selects it for deletion.
    ``dry_run`` changes nothing."""
    started = datetime.now(UTC)
    unverified_too = selection.reason == UNVERIFIED or not selection.filters

    async def delete(
        channel: AbstractChannel, message: AbstractIncomingMessage, parked: Parked
    ) -> str | None:
        if not parked.verified and not unverified_too:
            return (
                "unverified: purge takes copies without the worker's record only with "
                "--reason unverified (or --all)"
            )
        if not dry_run:
            await message.ack()
            await _forget(engine, parked)
        return None

    return _sweep(
        connection,
        engine,
        settings,
        delete,
        selection=selection,
        limit=limit,
        parked_before=started,
    )
