"""The relay's log against the real PostgreSQL and RabbitMQ: events nobody consumes yet are
every one counted and parked, in a couple of warning lines, not one per row and attempt."""

from __future__ import annotations

import logging

import pytest
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.helpers import scalar, wait_until
from tests.integration.support import declare, running_relay
from worker import outbox
from worker.settings import Settings
from worker.telemetry import Count

EVENTS = 60


async def test_unroutable_events_are_summed_up_per_routing_key(
    engine: AsyncEngine,
    settings: Settings,
    amqp: AbstractRobustConnection,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given the worker's exchange, and events for a routing key no queue is bound to
    await declare(amqp, settings)
    async with engine.begin() as conn:
        await outbox.publish_many(
            conn,
            [
                outbox.Event("nobody.listens", {"n": n}, exchange=settings.exchange)
                for n in range(EVENTS)
            ],
        )

    # When a relay tries each of them three times, then parks them
    relay_settings = settings.replace(relay_max_attempts=3, relay_retry_delay=0.05)
    with caplog.at_level(logging.WARNING, "worker.transport.relay"):
        async with running_relay(relay_settings) as relay:
            await wait_until(lambda: _all_parked(engine))
            stats = await relay.shutdown()

    # Then every failure was counted, and the log said so in two lines: the first failure at
    # once, and the sum of the others when the relay stopped (within the minute)
    assert stats[Count.RELAY_FAILED] == 3 * EVENTS
    assert stats[Count.RELAY_PARKED] == EVENTS
    warnings = [r.getMessage() for r in caplog.records if r.name == "worker.transport.relay"]
    assert len(warnings) == 2, warnings
    assert "'nobody.listens'" in warnings[0]
    assert "bind a queue" in warnings[0]
    assert "`worker outbox list --routing-key nobody.listens` shows the events" in warnings[0]
    assert warnings[1].startswith(f"{3 * EVENTS - 1} more events for routing key 'nobody.listens'")
    assert f"{EVENTS} of them parked in outbox_parked" in warnings[1]


async def _all_parked(engine: AsyncEngine) -> bool:
    return await scalar(engine, "SELECT count(*) FROM outbox_parked") == EVENTS
