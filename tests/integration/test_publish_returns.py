"""Returns matched to their publishes, in process against the real RabbitMQ: aiormq matches a
returned message to its publish by message id, so two publishes of one message id in flight on
one channel at once (two deliveries of one message copied together) must not be confused: the
unroutable one fails, the routed one is confirmed."""

from __future__ import annotations

import asyncio
import uuid

import aiormq

from worker.settings import Settings
from worker.transport.publisher import persistent, publish_confirmed


async def test_of_two_publishes_of_one_message_id_the_unroutable_one_fails(
    settings: Settings,
) -> None:
    connection = await aiormq.connect(settings.amqp_url)
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        routed = (await channel.queue_declare(exclusive=True)).queue
        assert routed is not None
        message_id = f"same-{uuid.uuid4().hex}"

        async def outcome(routing_key: str) -> str:
            properties = persistent(message_id=message_id, headers={}, content_type=None)
            try:
                await publish_confirmed(
                    channel, b"{}", properties, exchange="", routing_key=routing_key
                )
            except aiormq.exceptions.PublishError:
                return "returned"
            return "confirmed"

        # Given two copies of one message id, the first unroutable, published at once
        unroutable = f"worker.test.nowhere.{uuid.uuid4().hex}"
        outcomes = await asyncio.gather(outcome(unroutable), outcome(routed))

        # Then the unroutable one fails and the routed one is confirmed (and is in its queue)
        assert outcomes == ["returned", "confirmed"]
        declared = await channel.queue_declare(routed, passive=True)
        assert declared.message_count == 1
    finally:
        await connection.close()
