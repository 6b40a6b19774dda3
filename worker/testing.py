"""Testing with the real PostgreSQL: a scratch database, and a harness that runs your handlers.

``scratch_database`` and ``empty_database`` run their own event loop, so call them outside one:
in a session-scoped pytest fixture, say, or before ``asyncio.run``.

``Harness`` delivers messages to a router without RabbitMQ, through the worker's own code: the
checks of ``open_envelope``, then ``unit_of_work.apply`` (one transaction, or a workflow's run),
the real inbox claim and the real outbox insert, all committed to your test database. Only the
transport is in memory: a rejected delivery is kept in ``Harness.dead_letters`` (its key recorded
as failed, as the worker records it) instead of a dead-letter queue, and ``Harness.relay`` drains
the outbox table into ``Harness.published`` instead of publishing. What the harness commits is
what the worker would commit for the same deliveries in the same order::

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

Empty your tables between tests (``TRUNCATE``): the inbox remembers every key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from sqlalchemy.ext.asyncio import AsyncEngine

from worker import backoff, schema
from worker.core import unit_of_work
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
from worker.sql import inbox, outbox
from worker.sql.outbox import OutboxRow
from worker.transport.dead_letters import Failure, cause_of
from worker.transport.relay import message_of

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
    ``duplicate_of_failed`` or ``dead_lettered``. ``key`` is the idempotency key (of a dead
    letter: when it had a valid one). A dead letter has the ``reason`` and ``error`` its
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


class Harness:
    """Delivers messages to ``router``'s handlers on ``engine`` as the worker would, minus
    RabbitMQ; one delivery at a time, each committed before ``deliver`` returns.

    Like the consumer: ``open_envelope`` checks the delivery, then ``unit_of_work.apply`` runs it
    (one transaction, or a workflow's run holding a lease of ``workflow_lease`` seconds), tried up
    to ``transient_attempts`` times while it fails transiently. Where a failure goes, the worker's
    own policy decides (``policy.decide``, with ``retry_delays``): a delivery it parks is
    dead-lettered here, not raised, returned and kept in ``dead_letters``, and a keyed one has its
    key recorded as failed when the policy says so (not for ``key-reused``).
    Unlike the consumer: a failure the worker would retry later (a delayed retry), park as
    ``internal-error`` (a bug it logs) or pause for (the deployment's fault: a missing table or
    privilege) is raised to the test; the database is the test's, so it is never probed; the
    relay is ``relay()``, run after every delivery, which drains the outbox table into
    ``published`` without publishing.
    """

    def __init__(
        self,
        router: Router,
        engine: AsyncEngine,
        *,
        exchange: str = "events",
        max_body_bytes: int = Settings.max_body_bytes,
        max_json_depth: int = Settings.max_json_depth,
        workflow_lease: float = Settings.workflow_lease,
        transient_attempts: int = 1,
        retry_delays: tuple[float, ...] = Settings.retry_delays,
    ) -> None:
        self.router = router
        self.engine = engine
        self.exchange = exchange
        self.max_body_bytes = max_body_bytes
        self.max_json_depth = max_json_depth
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
        """Every delivery that ended (not raised) so far, in order."""
        self._turn = asyncio.Lock()

    @classmethod
    def from_settings(cls, router: Router, engine: AsyncEngine, settings: Settings) -> Harness:
        """A harness with the worker's exchange, body and depth limits, workflow lease,
        in-process tries and delayed retries from ``settings``."""
        return cls(
            router,
            engine,
            exchange=settings.exchange,
            max_body_bytes=settings.max_body_bytes,
            max_json_depth=settings.max_json_depth,
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
        all_headers = dict(headers or {})
        if key is not None:
            all_headers[IDEMPOTENCY_KEY_HEADER] = key
        return await self.handle(
            Delivery(
                body=body if isinstance(body, bytes) else encode_json(body),
                routing_key=routing_key,
                headers=all_headers,
                message_id=message_id,
                correlation_id=correlation_id,
                content_type=content_type,
                exchange=self.exchange,
            )
        )

    async def deliver_event(self, event: Published) -> Delivered:
        """Deliver a published event back to the router, as the broker would hand it over
        (for chains: an event one handler emits and another consumes)."""
        return await self.handle(
            Delivery(
                body=event.raw,
                routing_key=event.routing_key,
                headers=dict(event.headers),
                message_id=event.message_id,
                correlation_id=event.correlation_id,
                content_type=event.content_type,
                exchange=event.exchange,
            )
        )

    async def handle(self, delivery: Delivery) -> Delivered:
        """Run one ``Delivery`` to its end, as the consumer does, and drain the outbox."""
        async with self._turn:
            try:
                delivered = await self._handle(delivery)
            except BaseException:
                with contextlib.suppress(Exception):
                    await self._relay()  # what committed before the failure (workflow steps)
                raise
            events = tuple(await self._relay())
            delivered = replace(delivered, events=events)
            self.deliveries.append(delivered)
            if delivered.outcome is Outcome.DEAD_LETTERED:
                self.dead_letters.append(delivered)
            return delivered

    async def relay(self) -> list[Published]:
        """Drain the outbox table: take every due row in id order, delete it, and return it as
        published (also appended to ``published``). Deliveries do this themselves; call it for
        rows committed outside them."""
        async with self._turn:
            return await self._relay()

    async def _relay(self) -> list[Published]:
        drained: list[Published] = []
        while True:
            async with self.engine.begin() as conn:
                rows = await outbox.claim_outbox(conn, RELAY_BATCH_SIZE)
                await outbox.delete_outbox(conn, [row.id for row in rows])
            if not rows:
                break
            drained.extend(published_of(row) for row in rows)
        self.published.extend(drained)
        return drained

    async def _handle(self, delivery: Delivery) -> Delivered:
        envelope: Envelope | None = None
        try:
            envelope = open_envelope(
                delivery,
                self.router,
                max_body_bytes=self.max_body_bytes,
                max_depth=self.max_json_depth,
            )
            outcome: Outcome = await backoff.in_process(self.transient_attempts, log)(
                unit_of_work.apply,
                self.engine,
                envelope,
                UnitOfWorkConfig(exchange=self.exchange, workflow_lease=self.workflow_lease),
            )
        except Exception as exc:
            facts = FailureFacts.of(delivery, self.policy, opened=envelope is not None)
            decision = decide(exc, facts, self.policy)
            if not isinstance(decision, Park) or decision.unexpected:
                raise  # a delayed retry, a bug or a pause: the test should say why
            return await self._dead_letter(delivery, envelope, exc, decision)
        async with self.engine.begin() as conn:
            key = (envelope.handler.name, envelope.key)
            entry = (await inbox.fetch_keys(conn, [key])).get(key)
        return Delivered(
            delivery,
            outcome,
            key=envelope.key,
            handler=envelope.handler.name,
            result=None if entry is None else entry.result,
        )

    async def _dead_letter(
        self, delivery: Delivery, envelope: Envelope | None, exc: Exception, park: Park
    ) -> Delivered:
        """What the consumer does with a delivery the policy parks (``failures.park``), with the
        dead-letter queue in memory."""
        handler = (
            envelope.handler if envelope is not None else self.router.find(delivery.routing_key)
        )
        failure = Failure.of(delivery, exc, handler)
        if envelope is not None and park.record_key:
            async with self.engine.begin() as conn:
                await inbox.record_failure(
                    conn, envelope.claim, error=failure.error, attempts=failure.attempts
                )
        return Delivered(
            delivery,
            Outcome.DEAD_LETTERED,
            key=envelope.key if envelope is not None else key_or_none(delivery),
            handler=failure.handler,
            reason=park.reason,
            error=failure.error,
            exception=cause_of(exc),
            dead_letter_headers=failure.dead_letter_headers(park.reason),
        )


def published_of(row: OutboxRow) -> Published:
    """An outbox row as the relay publishes it (``relay.message_of``)."""
    message = message_of(row)
    body: Any = row.body
    if is_json_content_type(row.content_type):
        with contextlib.suppress(Rejected):
            body = decode_json(row.body, row.content_type)
    return Published(
        exchange=row.exchange,
        routing_key=row.routing_key,
        message_id=str(message.message_id),
        body=body,
        raw=row.body,
        content_type=row.content_type,
        headers=dict(message.headers),
        correlation_id=message.correlation_id,
        causation_id=row.causation_id,
        ordering_key=row.ordering_key,
    )
