"""Testing with the real PostgreSQL: a scratch database, and a harness that runs your handlers.

``scratch_database`` and ``empty_database`` run their own event loop, so call them outside one:
in a session-scoped pytest fixture, say, or before ``asyncio.run``.

``Harness`` delivers messages to a router without RabbitMQ, one at a time or as one batch,
through the worker's own code: the checks of ``open_envelope``, the batch's grouping
(``core.batches``), the units of work (``core.unit_of_work``) with the real inbox claim and the
real outbox insert, all committed to your test database, and the worker's failure policy
(``worker/core/policy.py`` says where a failure goes). Only the transport is in memory: a parked
delivery is kept in ``Harness.dead_letters`` instead of a dead-letter queue, and
``Harness.relay`` drains the outbox table into ``Harness.published`` instead of publishing. What
the harness commits is what the worker would commit for the same deliveries in the same order::

    @pytest.fixture(scope="session")
    def database() -> Iterator[Settings]:
        with scratch_database(Settings.load(), router) as scratch:   # migrated, dropped after
            yield scratch

    @pytest.fixture
    async def engine(database: Settings) -> AsyncIterator[AsyncEngine]:
        engine = create_engine(database)  # from worker.database
        yield engine
        await engine.dispose()

    async def test_paying_twice_charges_once(engine: AsyncEngine) -> None:
        harness = Harness(router, engine)
        body = {"payment_id": "p1", "account": "alice", "amount_cents": 100}
        first = await harness.deliver("payment.requested", body, key="p1")
        again = await harness.deliver("payment.requested", body, key="p1")
        assert (first.outcome, again.outcome) == ("processed", "duplicate")
        assert [e.routing_key for e in harness.published] == ["payment.settled"]

    async def test_a_bad_payment_is_parked_and_its_batch_commits(engine: AsyncEngine) -> None:
        body = {"payment_id": "p1", "account": "alice", "amount_cents": 100}
        ended = await Harness(router, engine).deliver_batch([
            Message("payment.requested", body, key="p1"),
            Message("payment.requested", b"{not json", key="p2"),
        ])
        assert [d.outcome for d in ended] == ["processed", "dead_lettered"]

Empty your tables between tests (``TRUNCATE``): the inbox remembers every key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from sqlalchemy.ext.asyncio import AsyncEngine

from worker import backoff, schema
from worker.core import keyspace, unit_of_work
from worker.core.batches import after_commit, checked, grouped
from worker.core.codec import JSON_CONTENT_TYPE, decode_json, encode_json, is_json_content_type
from worker.core.config import UnitOfWorkConfig
from worker.core.envelope import (
    IDEMPOTENCY_KEY_HEADER,
    Delivery,
    Envelope,
    key_or_none,
    open_envelope,
)
from worker.core.outcomes import Outcome
from worker.core.policy import FailureFacts, Park, PolicySettings, decide
from worker.core.router import Router
from worker.database import one_connection
from worker.errors import Reason, Rejected
from worker.settings import Settings
from worker.sql import inbox, outbox, waits
from worker.sql.outbox import OutboxRow
from worker.sql.rows import InboxEntry, InboxKey
from worker.transport.dead_letters import Failure, cause_of
from worker.transport.publisher import properties_of

log = logging.getLogger(__name__)


@contextlib.contextmanager
def scratch_database(
    settings: Settings, router: Router | None = None, *, prefix: str = "worker_scratch"
) -> Iterator[Settings]:
    """A new database beside ``settings.database_url``, migrated to head for the worker and
    ``router``'s handler modules; yields ``settings`` pointing at it and drops it on exit."""
    with empty_database(settings, prefix=prefix) as scratch:
        schema.upgrade(scratch, router)
        yield scratch


@contextlib.contextmanager
def empty_database(settings: Settings, *, prefix: str = "worker_scratch") -> Iterator[Settings]:
    """A new, empty database beside ``settings.database_url``; yields ``settings`` pointing at
    it and drops it on exit."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    _execute(settings, f'CREATE DATABASE "{name}"')
    try:
        parts = urlsplit(settings.database_url)
        yield settings.replace(database_url=urlunsplit(parts._replace(path="/" + name)))
    finally:
        _execute(settings, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _execute(settings: Settings, sql: str) -> None:
    """Run ``sql`` outside a transaction (as CREATE DATABASE must), on the worker's own kind of
    engine: the same TLS options as every other connection of the worker."""

    async def execute() -> None:
        async with one_connection(settings, "worker-scratch") as engine, engine.connect() as conn:
            await conn.execution_options(isolation_level="AUTOCOMMIT")
            await conn.exec_driver_sql(sql)

    asyncio.run(execute())


# The harness: the worker's units of work with an in-memory delivery side

RELAY_BATCH_SIZE = 500
"""Outbox rows the harness's relay takes per transaction."""


@dataclass(frozen=True)
class Published:
    """An event drained from the outbox, as the relay would have published it.

    ``body`` is the decoded JSON (the raw bytes when the content type is not JSON); ``headers``
    are the published headers: the handler's, plus ``causation-id``.
    """

    exchange: str
    routing_key: str
    message_id: str
    body: Any
    raw: bytes
    content_type: str
    headers: Mapping[str, Any]
    correlation_id: str | None
    causation_id: str | None
    ordering_key: str | None


@dataclass(frozen=True)
class Delivered:
    """How one delivery ended, and the events that its transactions committed.

    ``outcome`` is the worker's ``Outcome``: ``processed``, ``duplicate``,
    ``duplicate_of_failed``, ``waiting`` (a workflow stopped at a wait: what resumes it is
    published, for the test to deliver) or ``dead_lettered``. ``key`` is the idempotency key (of
    a dead letter: when it had a valid one). A dead letter has the ``reason`` and ``error`` its
    ``x-worker-reason`` and ``x-worker-error`` headers would carry, ``exception`` the exception
    that rejected it (for ``handler-error``, the handler's own), and ``dead_letter_headers`` the
    headers of the copy the worker would park. ``result`` is what the key's inbox row stores
    after the delivery (the handler's return value, as JSON).
    """

    delivery: Delivery
    outcome: Outcome
    key: str | None = None
    handler: str | None = None
    reason: Reason | None = None
    error: str | None = None
    exception: BaseException | None = None
    events: tuple[Published, ...] = ()
    result: Any = None
    dead_letter_headers: Mapping[str, Any] = field(default_factory=dict)

    @property
    def exception_type(self) -> str | None:
        """The ``x-worker-exception-type`` of a dead letter, e.g. ``"Permanent"``."""
        return None if self.exception is None else type(self.exception).__name__


@dataclass(frozen=True)
class Message:
    """One message of ``Harness.deliver_batch``: what ``Harness.deliver`` takes, as a value."""

    routing_key: str
    body: Any
    key: str | None = None
    message_id: str | None = None
    headers: Mapping[str, Any] | None = None
    content_type: str | None = JSON_CONTENT_TYPE
    correlation_id: str | None = None


@dataclass
class _Ends:
    """How a batch's deliveries ended so far, by their place in the batch: ``delivered``, or
    ``raised`` to the test."""

    delivered: dict[int, Delivered] = field(default_factory=dict)
    raised: dict[int, Exception] = field(default_factory=dict)


_Failing = tuple[int, Delivery, Envelope | None, Exception]
"""A delivery that failed (its place in the batch; its envelope, None when it failed its checks)
and the error it failed with."""


class Harness:
    """Delivers messages to ``router``'s handlers on ``engine`` as the worker would, minus
    RabbitMQ: one at a time (``deliver``) or several as one batch (``deliver_batch``), each
    committed before the call returns.

    Like the consumer, it checks deliveries (``open_envelope``), groups a batch's deliveries
    (``core.batches``), runs them (``unit_of_work.process_batch`` for those that share a
    transaction, ``unit_of_work.apply`` for one alone: a workflow's run holds a lease of
    ``workflow_lease`` seconds; tried ``transient_attempts`` times in process) and sends each
    failure where the worker's failure policy sends it (``core.policy.decide``, with
    ``retry_delays``). A delivery it parks ends ``dead_lettered`` (and is kept in
    ``dead_letters``); a decision to retry later, to pause, or a failure the worker logs as a bug
    (``internal-error``) is raised to the test instead. Unlike the consumer: the database is the
    test's, so it is never probed, and the relay is ``relay()``, run after every transaction,
    which drains the outbox table into ``published`` without publishing.
    """

    def __init__(
        self,
        router: Router,
        engine: AsyncEngine,
        *,
        exchange: str = "events",
        max_body_bytes: int = Settings.max_body_bytes,
        max_json_depth: int = Settings.max_json_depth,
        max_json_items: int = Settings.max_json_items,
        workflow_lease: float = Settings.workflow_lease,
        transient_attempts: int = 1,
        retry_delays: tuple[float, ...] = Settings.retry_delays,
    ) -> None:
        self.router = router
        self.engine = engine
        self.exchange = exchange
        self.max_body_bytes = max_body_bytes
        self.max_json_depth = max_json_depth
        self.max_json_items = max_json_items
        self.workflow_lease = workflow_lease
        self.transient_attempts = transient_attempts
        self.policy = PolicySettings.of(
            Settings(transient_attempts=transient_attempts, retry_delays=retry_delays)
        )
        self.published: list[Published] = []
        """Every event drained from the outbox so far, in outbox (commit) order."""
        self.dead_letters: list[Delivered] = []
        """Every dead-lettered delivery so far, in delivery order."""
        self.deliveries: list[Delivered] = []
        """Every delivery that ended (not raised) so far, in delivery order."""
        self._turn = asyncio.Lock()

    @classmethod
    def from_settings(cls, router: Router, engine: AsyncEngine, settings: Settings) -> Harness:
        """A harness with the worker's exchange, body, depth and item limits, workflow lease,
        in-process tries and delayed retries from ``settings``."""
        return cls(
            router,
            engine,
            exchange=settings.exchange,
            max_body_bytes=settings.max_body_bytes,
            max_json_depth=settings.max_json_depth,
            max_json_items=settings.max_json_items,
            workflow_lease=settings.workflow_lease,
            transient_attempts=settings.transient_attempts,
            retry_delays=settings.retry_delays,
        )

    async def deliver(
        self,
        routing_key: str,
        body: Any,
        *,
        key: str | None = None,
        message_id: str | None = None,
        headers: Mapping[str, Any] | None = None,
        content_type: str | None = JSON_CONTENT_TYPE,
        correlation_id: str | None = None,
    ) -> Delivered:
        """Deliver ``body`` (JSON-encoded unless it is ``bytes``) with ``routing_key``.

        ``key`` becomes the ``idempotency-key`` header; without it the ``message_id`` is the key
        (none is made up: a message with neither is dead-lettered as ``missing-key``).
        """
        message = Message(routing_key, body, key, message_id, headers, content_type, correlation_id)
        return await self.handle(self._delivery_of(message))

    async def deliver_event(self, event: Published) -> Delivered:
        """Deliver a published event back to the router, as the broker would hand it over
        (for chains: an event one handler emits and another consumes)."""
        return await self.handle(self._delivery_of(event))

    async def deliver_batch(self, messages: Iterable[Message | Published]) -> list[Delivered]:
        """Deliver ``messages`` (each as ``deliver`` or ``deliver_event`` would) as ONE batch of
        the consumer, and return how each ended, in their order.

        As in the worker, those that pass their checks share one transaction, and a delivery
        whose handler fails in it is taken out while the others commit; a workflow, and a
        delivery left alone, run on their own; a batch that fails as a whole is redone one
        delivery per transaction. A delivery's ``events`` are those its own transaction
        committed; in a shared transaction, those whose causation id is its key.

        A delivery the harness raises for (see the class) does not stop the others: once they
        all ended (and are in ``deliveries``), the first such error in the batch's order is
        raised.
        """
        return await self.handle_batch([self._delivery_of(message) for message in messages])

    async def handle(self, delivery: Delivery) -> Delivered:
        """Run one ``Delivery`` to its end, as the consumer does, and drain the outbox."""
        [delivered] = await self.handle_batch([delivery])
        return delivered

    async def handle_batch(self, deliveries: Sequence[Delivery]) -> list[Delivered]:
        """Run ``deliveries`` to their end as one batch of the consumer (``deliver_batch``)."""
        ends = _Ends()
        async with self._turn:
            try:
                await self._run_batch(list(enumerate(deliveries)), ends)
                await self._relay()  # rows committed outside the harness meanwhile
            except BaseException:
                with contextlib.suppress(Exception):
                    await self._relay()  # what committed before the failure (workflow steps)
                raise
            ended = [ends.delivered[index] for index in sorted(ends.delivered)]
            self.deliveries.extend(ended)
            self.dead_letters.extend(d for d in ended if d.outcome is Outcome.DEAD_LETTERED)
        if ends.raised:
            raise ends.raised[min(ends.raised)]
        return ended

    async def relay(self) -> list[Published]:
        """Drain the outbox table: move the scheduled events that are due by the database's
        clock into it (as a relay does), take every due row in id order, delete it, and return it
        as published (also appended to ``published``). Deliveries do this themselves; call it for
        rows committed outside them, and ``advance`` to make scheduled events due."""
        async with self._turn:
            return await self._relay()

    async def advance(self, by: timedelta) -> list[Published]:
        """Let ``by`` pass for what is scheduled: every scheduled event (``ctx.publish(delay=)``,
        a waiting workflow's timer) and every open wait of a workflow is made due that much
        sooner, by moving its due time in the database (the clock the worker goes by, which the
        harness cannot move), then the outbox is drained as ``relay`` does; returns what was
        drained. Events still not due stay scheduled."""
        if by < timedelta(0):
            raise ValueError("time only moves forward")
        async with self._turn:
            async with self.engine.begin() as conn:
                await outbox.bring_forward(conn, by.total_seconds())
                await waits.bring_forward(conn, by.total_seconds())
            return await self._relay()

    async def _relay(self) -> list[Published]:
        drained: list[Published] = []
        while True:
            async with self.engine.begin() as conn:
                await outbox.move_due(conn, RELAY_BATCH_SIZE)
                rows = await outbox.claim_outbox(conn, RELAY_BATCH_SIZE)
                await outbox.delete_outbox(conn, [row.id for row in rows])
            if not rows:
                break
            drained.extend(published_of(row) for row in rows)
        self.published.extend(drained)
        return drained

    def _delivery_of(self, message: Message | Published) -> Delivery:
        """``message`` as the broker would hand it over."""
        if isinstance(message, Published):
            body, headers, exchange = message.raw, dict(message.headers), message.exchange
        else:
            body = message.body if isinstance(message.body, bytes) else encode_json(message.body)
            headers = dict(message.headers or {})
            if message.key is not None:
                headers[IDEMPOTENCY_KEY_HEADER] = message.key
            exchange = self.exchange
        return Delivery(
            body=body,
            routing_key=message.routing_key,
            headers=headers,
            message_id=message.message_id,
            correlation_id=message.correlation_id,
            content_type=message.content_type,
            exchange=exchange,
        )

    def _open(self, delivery: Delivery) -> Envelope:
        return open_envelope(
            delivery,
            self.router,
            max_body_bytes=self.max_body_bytes,
            max_depth=self.max_json_depth,
            max_items=self.max_json_items,
        )

    @property
    def _unit_of_work(self) -> UnitOfWorkConfig:
        return UnitOfWorkConfig(exchange=self.exchange, workflow_lease=self.workflow_lease)

    async def _run_batch(self, deliveries: Sequence[tuple[int, Delivery]], ends: _Ends) -> None:
        """The consumer's ``handle_batch``, minus the broker: the deliveries that share a
        transaction, then those that failed their checks, then those that run alone."""
        check = checked(deliveries, self._open)
        opened, refused = await keyspace.refused_keys(self.engine, check.opened)
        split = grouped(opened)
        if split.together:
            await self._process_together(split.together, ends)
        await self._fail([(index, d, None, exc) for index, d, exc in check.rejected], ends)
        await self._fail([(i, e.delivery, None, exc) for i, e, exc in refused], ends)
        for index, envelope in split.alone:
            await self._process_alone(index, envelope, ends)

    async def _process_together(
        self, together: Sequence[tuple[int, Envelope]], ends: _Ends
    ) -> None:
        """One transaction for ``together`` (``unit_of_work.process_batch``), then each delivery
        where ``after_commit`` sends it; if the transaction fails, each runs alone."""
        envelopes = [envelope for _, envelope in together]
        try:
            finished = await unit_of_work.process_batch(self.engine, envelopes, self._unit_of_work)
        except Exception as exc:
            log.info(
                "a batch of %d failed (%r); processing its messages one by one", len(together), exc
            )
            for index, envelope in together:
                await self._process_alone(index, envelope, ends)
            return
        after = after_commit(together, finished)
        events = await self._relay()
        stored = await self._stored([envelope for _, envelope, _ in after.committed])
        for index, envelope, outcome in after.committed:
            mine = (e for e in events if e.causation_id == envelope.key)
            ends.delivered[index] = replace(
                self._ended(envelope, outcome, stored),
                events=tuple(mine) if outcome is Outcome.PROCESSED else (),
            )
        failed = [(index, env.delivery, env, exc) for index, env, exc in after.failed]
        await self._fail(failed, ends, database_answers=True)
        for index, envelope in after.alone:
            await self._process_alone(index, envelope, ends)

    async def _process_alone(self, index: int, envelope: Envelope, ends: _Ends) -> None:
        """One delivery in a unit of work of its own, tried in process while it fails
        transiently, then the outbox drained into its ``events``."""
        try:
            outcome: Outcome = await backoff.in_process(self.transient_attempts, log)(
                unit_of_work.apply, self.engine, envelope, self._unit_of_work
            )
        except Exception as exc:
            await self._fail([(index, envelope.delivery, envelope, exc)], ends)
        else:
            ends.delivered[index] = self._ended(envelope, outcome, await self._stored([envelope]))
        events = tuple(await self._relay())
        if index in ends.delivered:
            ends.delivered[index] = replace(ends.delivered[index], events=events)

    async def _stored(self, envelopes: Sequence[Envelope]) -> dict[InboxKey, InboxEntry]:
        """The inbox rows of ``envelopes``' keys, as committed."""
        if not envelopes:
            return {}
        async with self.engine.begin() as conn:
            return await inbox.fetch_keys(conn, [envelope.inbox_key for envelope in envelopes])

    @staticmethod
    def _ended(
        envelope: Envelope, outcome: Outcome, stored: Mapping[InboxKey, InboxEntry]
    ) -> Delivered:
        entry = stored.get(envelope.inbox_key)
        return Delivered(
            envelope.delivery,
            outcome,
            key=envelope.key,
            handler=envelope.handler.name,
            result=None if entry is None else entry.result,
        )

    async def _fail(
        self, failing: Sequence[_Failing], ends: _Ends, *, database_answers: bool | None = None
    ) -> None:
        """Send each failed delivery where the failure policy says: parked ones are dead-lettered
        together (``_dead_letter``); any other decision is raised to the test."""
        parked: list[tuple[_Failing, Park]] = []
        for failed in failing:
            index, delivery, envelope, exc = failed
            facts = FailureFacts.of(
                delivery,
                self.policy,
                opened=envelope is not None,
                database_answers=database_answers,
            )
            decision = decide(exc, facts, self.policy)
            if isinstance(decision, Park) and not decision.unexpected:
                parked.append((failed, decision))
            else:
                ends.raised[index] = exc  # a delayed retry, a bug or a pause: the test says why
        ends.delivered.update(await self._dead_letter(parked))

    async def _dead_letter(self, parked: Sequence[tuple[_Failing, Park]]) -> dict[int, Delivered]:
        """What the consumer does with the deliveries the policy parks (``failures``), with the
        dead-letter queue in memory: the keys to record as failed, in one transaction."""
        delivered: dict[int, Delivered] = {}
        failed_keys: list[inbox.FailedKey] = []
        for (index, delivery, envelope, exc), park in parked:
            handler = (
                envelope.handler if envelope is not None else self.router.find(delivery.routing_key)
            )
            failure = Failure.of(delivery, exc, handler)
            if envelope is not None and park.record_key:
                failed_keys.append((envelope.claim, failure.error, failure.attempts))
            delivered[index] = Delivered(
                delivery,
                Outcome.DEAD_LETTERED,
                key=envelope.key if envelope is not None else key_or_none(delivery),
                handler=failure.handler,
                reason=park.reason,
                error=failure.error,
                exception=cause_of(exc),
                dead_letter_headers=failure.dead_letter_headers(park.reason),
            )
        if failed_keys:
            async with self.engine.begin() as conn:
                await inbox.record_failures(conn, failed_keys)
        return delivered


def published_of(row: OutboxRow) -> Published:
    """An outbox row as the relay publishes it (``publisher.properties_of``)."""
    properties = properties_of(row)
    body: Any = row.body
    if is_json_content_type(row.content_type):
        with contextlib.suppress(Rejected):
            body = decode_json(row.body, row.content_type)
    return Published(
        exchange=row.exchange,
        routing_key=row.routing_key,
        message_id=str(properties.message_id),
        body=body,
        raw=row.body,
        content_type=row.content_type,
        headers=dict(properties.headers or {}),
        correlation_id=properties.correlation_id,
        causation_id=row.causation_id,
        ordering_key=row.ordering_key,
    )
