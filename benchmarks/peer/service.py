"""The payments pipeline written the way FastStream + faststream-outbox document it: the peer of
scenario (f) in ``benchmarks/throughput.py``.

Runs in ``.venv-peer`` (``benchmarks/peer/requirements.txt``), never in the project's
environment: ``benchmarks/peer/__init__.py`` starts it as a subprocess with that interpreter.
It keeps the promise of the worker's (d) with the libraries' own tools, one message at a time:

- ``payment.requested`` (a FastStream RabbitMQ subscriber, its own queue bound to the bench
  exchange): one SQLAlchemy ``AsyncSession`` transaction per message: claim the message's
  ``idempotency-key`` in ``peer_inbox`` (``INSERT ... ON CONFLICT DO NOTHING RETURNING``; a key
  taken before is a duplicate: nothing written), write the ledger row and, when it is new, the
  balance, and publish ``payment.settled`` with ``OutboxBroker.publish(..., session=session)``.
  FastStream acks after the handler returned, i.e. after the commit.
- the relay: an ``OutboxBroker`` subscriber on the outbox queue stacked with a RabbitMQ
  publisher (faststream-outbox's relay idiom), publishing each row to the bench exchange with
  routing key ``payment.settled`` (publisher confirms and ``mandatory``, FastStream's defaults).
- ``payment.settled`` downstream (a second FastStream RabbitMQ subscriber): one transaction
  claiming ``("notice", payment id)`` in ``peer_inbox`` and writing the settlement notice.

The example's tables (``accounts``, ``ledger_entries``, ``settlement_notices``) must exist; the
peer creates its own ``peer_inbox`` and ``peer_outbox`` if missing (``--reset`` empties them).
Defaults are the libraries' own (outbox subscriber: ``max_workers=1``, ``fetch_batch_size=10``,
one DELETE per relayed row, unless ``--relay-workers``, ``--relay-fetch-batch`` or
``--relay-flush-batch`` say otherwise; SQLAlchemy's pool: 5 + 10 overflow) except two: the
RabbitMQ prefetch, ``--prefetch`` (the worker's, 400; FastStream sets none by default, and
every delivery is a task of its own), and the per-message access logs, lowered to DEBUG as the
benchmark runs the worker at WARNING. It prints ``ready`` on stdout once
every subscriber has started, and stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from typing import Any

from faststream.rabbit import Channel, ExchangeType, RabbitBroker, RabbitExchange, RabbitQueue
from faststream.rabbit.annotations import RabbitMessage
from faststream_outbox import OutboxBroker, make_outbox_table
from pydantic import BaseModel, ConfigDict
from sqlalchemy import Column, DateTime, MetaData, Table, Text, func, text
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine

REQUESTED = "payment.requested"
SETTLED = "payment.settled"
IDEMPOTENCY_KEY = "idempotency-key"
OUTBOX_QUEUE = "payment-settled"
"""The outbox's queue (a value of its ``queue`` column) the relay subscriber reads."""

metadata = MetaData()
outbox_table = make_outbox_table(metadata, table_name="peer_outbox")
inbox_table = Table(
    "peer_inbox",
    metadata,
    Column("handler", Text, primary_key=True),
    Column("key", Text, primary_key=True),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

CLAIM = text(
    "INSERT INTO peer_inbox (handler, key) VALUES (:handler, :key) "
    "ON CONFLICT DO NOTHING RETURNING key"
)
RECORD_ENTRY = text(
    "INSERT INTO ledger_entries (payment_id, account, amount_cents) "
    "VALUES (:payment_id, :account, :amount_cents) "
    "ON CONFLICT (payment_id) DO NOTHING RETURNING payment_id"
)
ADD_TO_BALANCE = text(
    "INSERT INTO accounts (account, balance_cents) VALUES (:account, :amount_cents) "
    "ON CONFLICT (account) DO UPDATE "
    "SET balance_cents = accounts.balance_cents + excluded.balance_cents "
    "RETURNING balance_cents"
)
RECORD_NOTICE = text(
    "INSERT INTO settlement_notices "
    "(payment_id, event_id, account, amount_cents, balance_cents) "
    "VALUES (:payment_id, :event_id, :account, :amount_cents, :balance_cents)"
)


class PaymentRequested(BaseModel):
    model_config = ConfigDict(strict=True)

    payment_id: str
    account: str
    amount_cents: int


class PaymentSettled(PaymentRequested):
    balance_cents: int


def build(options: argparse.Namespace, engine: AsyncEngine) -> tuple[RabbitBroker, OutboxBroker]:
    """The two brokers, their subscribers and the relay, on ``options``' names."""
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    rabbit = RabbitBroker(
        options.amqp_url,
        default_channel=Channel(prefetch_count=options.prefetch),
        log_level=logging.DEBUG,
    )
    outbox = OutboxBroker(engine, outbox_table=outbox_table, log_level=logging.DEBUG)
    exchange = RabbitExchange(options.exchange, type=ExchangeType.TOPIC, durable=True)
    requests = RabbitQueue(options.queue, durable=True, routing_key=REQUESTED)
    notices = RabbitQueue(f"{options.queue}.notices", durable=True, routing_key=SETTLED)

    @rabbit.subscriber(requests, exchange)
    async def settle(payment: PaymentRequested, message: RabbitMessage) -> None:
        key = message.headers.get(IDEMPOTENCY_KEY) or message.message_id
        values = payment.model_dump()
        async with sessions() as session, session.begin():
            claim = await session.execute(CLAIM, {"handler": "settle", "key": key})
            if claim.first() is None:
                return  # a duplicate: the key's transaction committed before
            if (await session.execute(RECORD_ENTRY, values)).first() is None:
                return  # this payment was settled under another key
            balance = (await session.execute(ADD_TO_BALANCE, values)).scalar_one()
            event = {**values, "balance_cents": balance}
            await outbox.publish(event, queue=OUTBOX_QUEUE, session=session)

    tuning = {
        name: value
        for name, value in (
            ("max_workers", options.relay_workers),
            ("fetch_batch_size", options.relay_fetch_batch),
            ("terminal_flush_batch_size", options.relay_flush_batch),
        )
        if value is not None
    }

    @rabbit.publisher(exchange=exchange, routing_key=SETTLED)
    @outbox.subscriber(OUTBOX_QUEUE, **tuning)
    async def relay(event: dict[str, Any]) -> dict[str, Any]:
        return event

    @rabbit.subscriber(notices, exchange)
    async def record_notice(event: PaymentSettled, message: RabbitMessage) -> None:
        async with sessions() as session, session.begin():
            claim = await session.execute(CLAIM, {"handler": "notice", "key": event.payment_id})
            if claim.first() is not None:
                notice = {**event.model_dump(), "event_id": message.message_id}
                await session.execute(RECORD_NOTICE, notice)

    return rabbit, outbox


async def prepare_tables(engine: AsyncEngine, *, reset: bool) -> None:
    """Create the peer's own tables if missing; empty them with ``reset``."""
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
        if reset:
            await conn.execute(text("TRUNCATE peer_inbox, peer_outbox"))


async def serve(options: argparse.Namespace) -> None:
    """Start the relay and the subscribers, say ``ready``, run until SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    engine = create_async_engine(options.database_url)
    try:
        await prepare_tables(engine, reset=options.reset)
        rabbit, outbox = build(options, engine)
        await outbox.start()  # the outbox is empty: its relay has nothing to publish yet
        try:
            await rabbit.start()  # consuming from here on
            try:
                print("ready", flush=True)
                await stop.wait()
            finally:
                await rabbit.stop()
        finally:
            await outbox.stop()
    finally:
        await engine.dispose()


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="FastStream + faststream-outbox payments peer")
    parser.add_argument(
        "--database-url",
        default=os.environ.get("PEER_DATABASE_URL"),
        help="postgresql+asyncpg://... ($PEER_DATABASE_URL)",
    )
    parser.add_argument(
        "--amqp-url", default=os.environ.get("PEER_AMQP_URL"), help="amqp://... ($PEER_AMQP_URL)"
    )
    parser.add_argument("--exchange", required=True, help="the topic exchange of the requests")
    parser.add_argument("--queue", required=True, help="the requests' queue; notices: <it>.notices")
    parser.add_argument("--prefetch", type=int, default=400)
    for name, default in (
        ("workers", "max_workers=1"),
        ("fetch-batch", "fetch_batch_size=10"),
        ("flush-batch", "terminal_flush_batch_size=1"),
    ):
        parser.add_argument(f"--relay-{name}", type=int, help=f"the library's default: {default}")
    parser.add_argument("--reset", action="store_true", help="empty peer_inbox and peer_outbox")
    options = parser.parse_args(argv)
    if not options.database_url or not options.amqp_url:
        parser.error("a database URL and an AMQP URL are required")
    return options


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(serve(parse_options()))
