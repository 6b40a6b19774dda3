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

``browse``, ``replaying`` and ``purging`` take the DLQ in its order, unacked, a chunk at a time
(``CHUNK`` messages at most, fewer when their bodies are large: ``CHUNK_BYTES``), look up the
chunk's records in one statement, and act on its messages one at a time; they hold no bodies but
the chunk's, so memory stays bounded whatever the queue holds. The messages they leave go back
when they end: a classic queue puts each back in its place, so its order never changes; a quorum
queue puts them, in their order, behind the messages it still holds, so its order is unchanged
by a sweep that reached its end, and one that stopped early moves what it took (its last chunk
included) behind the rest. Given a ``Scan``, they take no more than its limit of messages
(matching or not) and say whether the queue held more: what a page of the console, which must
answer in seconds, reads and acts on.
``grouped`` sums a scan up by reason and handler (``Group``), and ``tally`` sums up what a bulk
action did, for the CLI's summary and the console's preview alike. A replayed
message's failed state is cleared first (only when its record says the worker recorded it), then
it is sent to the work queue and acked in the DLQ after the confirm (a purged one's record is
deleted; a replayed one's stays until it expires); a copy parked longer ago than
``inbox_retention`` is not replayed without ``force``, because its key may have left the inbox.

The copies, their ``x-worker-*`` headers and their records are made by
``worker.transport.dead_letters`` and ``worker.transport.failures`` on the consumer's hot path;
this module only reads them (and deletes the records of copies it purges).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from array import array
from collections import Counter, deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from aio_pika import IncomingMessage
from aio_pika.abc import (
    AbstractChannel,
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustConnection,
)
from aiormq.abc import DeliveredMessage
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
    HANDLER,
    ORIGINAL_ROUTING_KEY,
    PARKING_ID,
    REASON,
    body_digest,
    copy_properties,
)
from worker.transport.publisher import publish_on
from worker.transport.topology import count_queues

UNVERIFIED = "unverified"

NOT_RECORDED = "(not recorded: parked before the worker kept the failure in its record)"
"""The error shown for a parking recorded before migration 0011, whose record has none (its
copy's headers are never shown in its place)."""
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
    """A header's (or property's) value as text: bytes (an AMQP byte array) decoded, each byte
    that is not UTF-8 as ``\\xNN``; anything else by ``str``."""
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "backslashreplace")
    return str(value)


def _text(headers: Mapping[str, Any], name: str, default: str = "") -> str:
    """Header ``name`` as text (``header_text``), else ``default``."""
    value = headers.get(name)
    return default if value is None else header_text(value)


@dataclass(frozen=True)
class Parked:
    """A message in the dead-letter queue, as ``worker dlq`` shows it.

    For a copy the worker parked (``verified``), every field is the worker's record's, never
    the copy's headers (anyone who can dead-letter a copy of a parked message chooses those).
    The first copy of a parking in the DLQ is verified; a later one is not. For any other
    copy, ``reason`` is ``unverified``, ``unverified_because`` says why, ``handler`` is None,
    ``key`` is its own idempotency key (the one a fresh delivery would run under),
    ``routing_key`` the one the broker routed it by, and what its ``x-worker-*`` headers say is
    in ``claims``.
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
        body's SHA-256 (its first 32 hex digits, 128 bits: two bodies an attacker crafted to
        share an id would take a collision search of 2**64): an unverified copy has no id the
        worker made. Acting on an id acts on every copy with that body."""
        if self.parking_id is not None and self.verified:
            return str(self.parking_id)
        return f"sha256:{self.body_sha256.hex()[:32]}"

    @classmethod
    def of(
        cls,
        message: AbstractIncomingMessage,
        record: ParkingRow | None,
        settings: Settings,
        *,
        seen: set[uuid.UUID] | None = None,
    ) -> Parked:
        """``message`` as the worker's ``record`` of it (found by its parking id) says, or as an
        unverified copy when there is none, it names another body or key, or (``seen``: the
        parking ids of the copies before it in the sweep, which this adds its own to) a copy of
        that parking came before it."""
        headers = dict(message.headers or {})
        digest = body_digest(message.body)
        key = key_of(message)
        why = _unverified_because(headers, record, digest, key)
        if record is not None and why is None and record.replayed_at is not None:
            why = f"a copy of parking {record.parking_id}, replayed at {record.replayed_at:%c}"
        if record is not None and why is None and seen is not None:
            if record.parking_id in seen:
                why = f"a second copy of parking {record.parking_id}"
            seen.add(record.parking_id)
        if record is not None and why is None:
            return cls(
                key=record.key,
                handler=record.handler,
                reason=record.reason,
                error=NOT_RECORDED if record.error is None else record.error,
                exception_type=record.exception_type or "",
                attempts=record.attempts or 0,
                first_failure_at=record.first_failure_at or "",
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


NO_HANDLER = "-"
"""What ``--handler`` takes (and ``worker dlq`` shows) for a copy without a handler: one the
worker parked before it knew the handler (no handler for its routing key, say), or an unverified
copy (its handler header is a claim, never matched)."""


@dataclass(frozen=True)
class Selection:
    """Which parked messages a ``worker dlq`` command takes: those matching every filter given
    (None matches anything). ``reason`` ``unverified`` selects the copies without the worker's
    record; ``handler`` matches the record's handler (``NO_HANDLER`` for none: an unverified
    copy's handler header is a claim and never matches); ``ids`` the copies whose ``Parked.id``
    is one of them (the boxes ticked on a page, or ``worker dlq show``'s one)."""

    key: str | None = None
    reason: str | None = None
    handler: str | None = None
    ids: frozenset[str] | None = None

    def matches(self, parked: Parked) -> bool:
        return (
            (self.key is None or self.key == parked.key)
            and (self.reason is None or self.reason == parked.reason)
            and (self.handler is None or self.handler == (parked.handler or NO_HANDLER))
            and (self.ids is None or parked.id in self.ids)
        )

    @property
    def filters(self) -> bool:
        """True when at least one filter is set."""
        return any(value is not None for value in (self.key, self.reason, self.handler, self.ids))

    def describe(self) -> str:
        """The selection as a person chose it: ``reason=… handler=… key=…``, ``ids=…`` (sorted),
        or ``everything``; for a command's summary, a page's title and the audit's target."""
        named = (("reason", self.reason), ("handler", self.handler), ("key", self.key))
        said = [f"{name}={value}" for name, value in named if value is not None]
        if self.ids is not None:
            said.append(f"ids={','.join(sorted(self.ids))}")
        return " ".join(said) or "everything"


EVERYTHING = Selection()


@dataclass
class Scan:
    """How many messages a sweep may take from the queue, matching its selection or not, and what
    it found: ``taken`` messages, and ``more`` when it stopped at ``limit`` with the queue holding
    more (then what it showed or did covers only the first ``limit``)."""

    limit: int
    taken: int = 0
    more: bool = False


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
    """``list``'s action: none; the message goes back to the queue when the sweep ends."""


CHUNK = 100
"""Messages a sweep takes from the DLQ at a time at most (its consumer's prefetch) and looks up
the records of in one statement: the most bodies it holds at once."""

CHUNK_BYTES = 4 * 1024 * 1024
"""Bytes of bodies a sweep means to hold at once: after a chunk whose largest body had ``B``
bytes, the next takes at most ``CHUNK_BYTES // B`` messages (at least one); the first takes one.
A chunk of small bodies followed by large ones is the worst case: ``CHUNK`` large bodies."""

STALL_SECONDS = 2.0
"""How long a sweep waits for a message the queue counted as ready before it cancels its
consumer and asks the queue again (another client took the message meanwhile): a wait, never
a reason to stop early or to skip a message."""

Taken = tuple[AbstractIncomingMessage, ParkingRow | None]
"""A message taken from the DLQ, unacked, with the worker's record of its parking id (if any)."""


class _Taking:
    """The DLQ's messages, unacked, in the queue's order, taken a chunk at a time on a sweep's
    channel, each with the worker's record of its parking id (one statement per chunk, on a
    connection checked out for it alone: none is held while a message is acted on).

    A chunk is a consumer of its own, started with a prefetch of as many messages as the queue
    counts ready (at most ``CHUNK``, fewer after large bodies: ``CHUNK_BYTES``), so the broker
    delivers no more than that, and none after its ``basic.cancel-ok`` (aiormq runs each
    delivery's callback, which keeps the message, before that answer's waiter); the rest stay
    on the broker. Only a queue that counts none ready is asked with ``basic.get``, whose empty
    answer alone ends the sweep (the count can lag behind messages a closed channel is
    returning).

    A classic queue puts a message back in its place however it comes back, and a closing
    channel gives back all of them at once, so the sweep's close is enough. A quorum queue
    puts returned messages behind those it holds, in the order they come back, and a closing
    channel returns each consumer's in order but the consumers in any order: for one
    (``settings.queue_type``), ``give_back`` returns what the sweep took and did not settle
    before its channel closes, one ``basic.nack`` (``multiple``) per chunk, in the order taken
    (one per message would cost a classic queue a requeue each). For that it keeps the delivery
    tag (8 bytes) of each message handed out and not settled, and the last one of each chunk; no
    body.
    """

    def __init__(
        self, channel: AbstractChannel, queue: AbstractQueue, engine: AsyncEngine, *, quorum: bool
    ):
        self._channel = channel
        self._quorum = quorum
        self._queue = queue
        self._engine = engine
        self._held: deque[Taken] = deque()
        self._delivered: list[AbstractIncomingMessage] = []
        self._arrived = asyncio.Event()
        self._largest = CHUNK_BYTES  # the previous chunk's largest body: none yet, so one
        self._given = array("Q")  # the delivery tags of messages handed out and not settled
        self._ends = array("Q")  # the last delivery tag of each take
        self._consuming: str | None = None

    async def next(self, most: int) -> Taken | None:
        """The next message and its record (taking at most ``most`` more from the queue when
        none is held), or None when the queue has none left to give."""
        if not self._held:
            fits = max(1, CHUNK_BYTES // max(1, self._largest))
            taken = await self._take(min(most, CHUNK, fits))
            if taken:
                self._largest = max(len(message.body) for message in taken)
                if self._quorum:
                    self._ends.append(taken[-1].delivery_tag or 0)
            await self._look_up(taken)
        if not self._held:
            return None
        taken_one = self._held.popleft()
        if self._quorum:
            self._given.append(taken_one[0].delivery_tag or 0)
        return taken_one

    def settled(self) -> None:
        """The message handed out last was settled (acked): it is not to be given back."""
        if self._quorum:
            self._given.pop()

    async def give_back(self) -> None:
        """Return every message taken and not settled to a quorum queue, in the order taken
        (a classic queue takes them back in order when the channel closes)."""
        if not self._quorum:
            return
        underlay = await self._channel.get_underlay_channel()
        if self._consuming is not None:
            await underlay.basic_cancel(self._consuming)
            self._consuming = None
        held = (message.delivery_tag or 0 for message, _ in self._held)
        ends = iter(self._ends)
        end, last = next(ends, 0), 0
        for tag in itertools.chain(self._given, held):
            while tag > end:
                if last:
                    await underlay.basic_nack(last, multiple=True, requeue=True)
                end, last = next(ends, tag), 0
            last = tag
        if last:
            await underlay.basic_nack(last, multiple=True, requeue=True)
        self._given, self._held, self._ends = array("Q"), deque(), array("Q")

    async def more(self) -> bool:
        """True when the queue holds another message (which stays where it is, unless only
        ``basic.get`` finds it)."""
        if self._held or await self._ready():
            return True
        message = await self._queue.get(no_ack=False, fail=False)
        if message is None:
            return False
        self._held.append((message, None))
        if self._quorum:
            self._ends.append(message.delivery_tag or 0)
        return True

    async def _ready(self) -> int:
        """The messages the queue counts ready (a passive declare on the sweep's channel)."""
        underlay = await self._channel.get_underlay_channel()
        declared = await underlay.queue_declare(self._queue.name, passive=True)
        return declared.message_count or 0

    async def _take(self, most: int) -> list[AbstractIncomingMessage]:
        """Up to ``most`` messages from the head of the queue, in its order."""
        most = min(most, await self._ready())
        if most == 0:
            message = await self._queue.get(no_ack=False, fail=False)
            return [] if message is None else [message]
        underlay = await self._channel.get_underlay_channel()
        await underlay.basic_qos(prefetch_count=most)
        self._consuming = f"worker-dlq-{uuid.uuid4().hex}"
        await underlay.basic_consume(self._queue.name, self._deliver, consumer_tag=self._consuming)
        while len(self._delivered) < most:
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), STALL_SECONDS)
            except TimeoutError:
                break
        await underlay.basic_cancel(self._consuming)
        self._consuming = None
        taken, self._delivered = self._delivered, []
        return taken

    async def _deliver(self, delivered: DeliveredMessage) -> None:
        """Keep a message the chunk's consumer was delivered (aiormq calls it in order)."""
        self._delivered.append(IncomingMessage(delivered, no_ack=False))
        self._arrived.set()

    async def _look_up(self, messages: list[AbstractIncomingMessage]) -> None:
        """Hold ``messages`` with the worker's records of their parking ids."""
        if not messages:
            return
        ids = {found for message in messages if (found := parking_id_of(message)) is not None}
        records: dict[uuid.UUID, ParkingRow] = {}
        if ids:
            async with self._engine.connect() as conn:
                records = await parkings.find_parkings(conn, ids)
        for message in messages:
            parking_id = parking_id_of(message)
            self._held.append((message, None if parking_id is None else records.get(parking_id)))


async def _sweep(
    connection: AbstractRobustConnection,
    engine: AsyncEngine,
    settings: Settings,
    act: Act,
    *,
    selection: Selection,
    limit: int | None,
    parked_before: datetime | None = None,
    scan: Scan | None = None,
) -> AsyncGenerator[Outcome, None]:
    """Take the DLQ's messages in order, oldest first, and ``act`` on each one that
    ``selection`` matches, one at a time, until ``limit`` are done, ``scan``'s limit are taken
    or the queue has none left to give.

    Every message is taken unacked on a channel of its own (``_Taking``: ``CHUNK`` at a time):
    one the action does not ack goes back to the queue when the sweep ends (see the module's
    docstring for where), and so do the ones taken but not reached; the channel's close gives
    back whatever a failing sweep could not. At most a chunk's bodies are held; the rest are
    delivery tags on the broker (and, for a quorum queue, 8 bytes each here, to give them back),
    so memory stays bounded by ``CHUNK`` bodies. With ``parked_before``, messages parked later
    (a replayed message failing again, say) are left alone, so a sweep never takes back what it
    sent.
    """
    channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
    taking: _Taking | None = None
    try:
        queue = await channel.declare_queue(settings.dead_letter_queue, passive=True)
        taking = _Taking(channel, queue, engine, quorum=settings.queue_type == "quorum")
        seen: set[uuid.UUID] = set()
        done = 0
        while limit is None or done < limit:
            if scan is not None and scan.taken >= scan.limit:
                scan.more = await taking.more()
                break
            taken = await taking.next(CHUNK if scan is None else scan.limit - scan.taken)
            if taken is None:
                break
            if scan is not None:
                scan.taken += 1
            message, record = taken
            parked = Parked.of(message, record, settings, seen=seen)
            if not selection.matches(parked) or _parked_later(parked, parked_before):
                continue
            try:
                outcome = Outcome(parked, await act(channel, message, parked))
            finally:
                if message.locked:  # acked
                    taking.settled()
            del message, taken  # the body goes; the delivery tag stays with the channel
            done += outcome.done
            yield outcome
    except GeneratorExit:  # closed by its reader before the end: as good as the end
        await _give_back(channel, taking)
        raise
    except BaseException:
        with contextlib.suppress(Exception):  # the sweep's own failure is the one to report
            await _give_back(channel, taking)
        raise
    else:
        await _give_back(channel, taking)
    finally:
        await channel.close()


async def _give_back(channel: AbstractChannel, taking: _Taking | None) -> None:
    """Return what ``taking`` took and did not settle, in order, unless its channel closed."""
    if taking is not None and not channel.is_closed:
        await taking.give_back()


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
    scan: Scan | None = None,
) -> AsyncGenerator[Outcome, None]:
    """The parked messages ``selection`` matches (the first ``limit``, among the first
    ``scan.limit`` of the queue), oldest first, one at a time; they all stay where they are.
    Close the iterator (``contextlib.aclosing``) when leaving it early."""
    return _sweep(
        connection, engine, settings, _left_parked, selection=selection, limit=limit, scan=scan
    )


async def list_parked(
    connection: AbstractRobustConnection,
    engine: AsyncEngine,
    settings: Settings,
    *,
    selection: Selection = EVERYTHING,
    limit: int | None = None,
    scan: Scan | None = None,
) -> list[Parked]:
    """``browse``'s messages as a list (their headers only), left where they are."""
    async with contextlib.aclosing(
        browse(connection, engine, settings, selection=selection, limit=limit, scan=scan)
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
    connection: AbstractRobustConnection,
    engine: AsyncEngine,
    settings: Settings,
    copy_id: str,
    *,
    limit: int | None = None,
    scan: Scan | None = None,
) -> list[Shown]:
    """The parked messages whose ``Parked.id`` is ``copy_id`` (one, unless copies share a body
    and none has a record; the first ``limit`` of them), in full; they all stay where they
    are."""
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

    sweep = _sweep(
        connection,
        engine,
        settings,
        keep,
        selection=Selection(ids=frozenset({copy_id})),
        limit=limit,
        scan=scan,
    )
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
    parked_before: datetime | None = None,
    scan: Scan | None = None,
) -> AsyncGenerator[Outcome, None]:
    """Send parked messages that ``selection`` matches (at most ``limit``, among the first
    ``scan.limit`` of the queue) back to the work queue, one at a time, and say what happened
    to each. Messages parked after it began (or after ``parked_before``: when a preview of it
    was made) are left.

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
        parked_before=_earlier(started, parked_before),
        scan=scan,
    )


def _earlier(moment: datetime, other: datetime | None) -> datetime:
    """The earlier of ``moment`` and ``other`` (``moment`` when ``other`` is None)."""
    return moment if other is None else min(moment, other)


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
    work queue, mark the record replayed after the confirm and then ack the copy. The record
    stays (it expires), marked: any other copy of that parking is unverified from then on."""
    if parked.verified and parked.failed_key and parked.handler and parked.key is not None:
        async with engine.begin() as conn:
            await inbox.clear_failure(conn, parked.handler, parked.key)
    headers = _fresh_headers(message.headers or {})
    headers[ORIGINAL_ROUTING_KEY] = parked.routing_key
    properties = copy_properties(message, headers)
    await publish_on(channel, message.body, properties, exchange="", routing_key=settings.queue)
    if parked.verified and parked.parking_id is not None:
        async with engine.begin() as conn:
            await parkings.mark_replayed(conn, parked.parking_id)
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
    parked_before: datetime | None = None,
    scan: Scan | None = None,
) -> AsyncGenerator[Outcome, None]:
    """Delete (ack) the parked messages that ``selection`` matches, at most ``limit`` (among
    the first ``scan.limit`` of the queue), one at a time, and their records; the others stay in
    their order. Messages parked after the purge began (or after ``parked_before``) are left.
    An unverified copy is deleted only when ``selection`` asks for unverified copies, for
    everything (no filter) or for it by its id (its body's digest, which the worker computed): a
    claim in its headers never selects it for deletion. ``dry_run`` changes nothing."""
    started = datetime.now(UTC)
    unverified_too = (
        selection.reason == UNVERIFIED or not selection.filters or selection.ids is not None
    )

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
        parked_before=_earlier(started, parked_before),
        scan=scan,
    )


async def depth(connection: AbstractRobustConnection, settings: Settings) -> int | None:
    """Messages in the DLQ now, or None when it does not exist (it is never declared here)."""
    (found,) = await count_queues(connection, [settings.dead_letter_queue])
    return None if found is None else found.messages


SCAN_LIMIT = 10_000
"""Messages a view of the DLQ (its groups, a page of its messages, a preview, the action it
confirms) takes from the queue at most: about two seconds of reading (``benchmarks.dlq_sweep``)."""


@dataclass(frozen=True)
class Group:
    """The parked messages of one reason and handler (``NO_HANDLER`` for none): how many, when
    the first and the last of them were parked (None when none says), and an example of their
    error (for unverified copies: why one is unverified)."""

    reason: str
    handler: str
    count: int
    first: datetime | None
    last: datetime | None
    example: str

    @property
    def selection(self) -> Selection:
        """The selection of this group's messages."""
        return Selection(reason=self.reason, handler=self.handler)


def _earliest(*moments: datetime | None) -> datetime | None:
    known = [moment for moment in moments if moment is not None]
    return min(known) if known else None


def _latest(*moments: datetime | None) -> datetime | None:
    known = [moment for moment in moments if moment is not None]
    return max(known) if known else None


class Grouping:
    """Parked messages summed up by reason and handler as they are read, one at a time: it
    holds a group's count, times and example, never its messages (and the groups are few: the
    reasons are a closed set, a handler is one the worker recorded, or none)."""

    def __init__(self) -> None:
        self._groups: dict[tuple[str, str], Group] = {}

    def add(self, parked: Parked) -> None:
        """Count ``parked`` in its group."""
        reason, handler = parked.reason, parked.handler or NO_HANDLER
        moment = parked.dead_lettered_at
        example = parked.error if parked.verified else f"unverified: {parked.unverified_because}"
        found = self._groups.get((reason, handler))
        if found is None:
            self._groups[(reason, handler)] = Group(reason, handler, 1, moment, moment, example)
            return
        self._groups[(reason, handler)] = Group(
            reason,
            handler,
            found.count + 1,
            _earliest(found.first, moment),
            _latest(found.last, moment),
            found.example or example,
        )

    def groups(self) -> list[Group]:
        """The groups, the largest first (then by reason and handler)."""
        return sorted(self._groups.values(), key=lambda g: (-g.count, g.reason, g.handler))


@dataclass(frozen=True)
class Groups:
    """What a bounded scan of the DLQ found, by reason and handler: the groups, how many
    messages it took from the queue (``scanned``), and ``more`` when the queue held more than
    it took (then the counts are of the first ``scanned`` only)."""

    groups: list[Group]
    scanned: int
    more: bool

    @property
    def count(self) -> int:
        """The messages in the groups."""
        return sum(group.count for group in self.groups)


async def grouped(
    connection: AbstractRobustConnection,
    engine: AsyncEngine,
    settings: Settings,
    *,
    selection: Selection = EVERYTHING,
    scan_limit: int = SCAN_LIMIT,
) -> Groups:
    """The parked messages ``selection`` matches among the first ``scan_limit`` of the queue,
    by reason and handler; they all stay where they are."""
    scan = Scan(scan_limit)
    grouping = Grouping()
    found = browse(connection, engine, settings, selection=selection, scan=scan)
    async with contextlib.aclosing(found) as outcomes:
        async for outcome in outcomes:
            grouping.add(outcome.parked)
    return Groups(grouping.groups(), scan.taken, scan.more)


@dataclass
class Tally:
    """What a bulk action did (in a dry run: would do), summed up as it goes: the messages done
    by (reason, handler) and the messages refused by why. ``worker dlq``'s summary and the
    console's preview and result are both this."""

    done: Counter[tuple[str, str]] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)

    def add(self, outcome: Outcome) -> None:
        """Count one outcome."""
        if outcome.done:
            self.done[(outcome.parked.reason, outcome.parked.handler or NO_HANDLER)] += 1
        else:
            self.refused[str(outcome.refused)] += 1

    @property
    def done_count(self) -> int:
        return self.done.total()

    @property
    def refused_count(self) -> int:
        return self.refused.total()

    async def carry_out(
        self,
        outcomes: AsyncGenerator[Outcome, None],
        each: Callable[[Outcome], None] | None = None,
    ) -> Tally:
        """Run the bulk action ``outcomes`` to its end, counting each outcome (and calling
        ``each`` with it) as it happens; should it fail, what it did before stays counted."""
        async with contextlib.aclosing(outcomes) as every:
            async for outcome in every:
                self.add(outcome)
                if each is not None:
                    each(outcome)
        return self
