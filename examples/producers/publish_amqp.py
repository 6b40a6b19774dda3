"""Publish one message to the worker over AMQP, as any producer would (aio-pika).

    python -m examples.producers.publish_amqp payment.requested \
        '{"payment_id": "p-1", "account": "alice", "amount_cents": 250}' --key p-1

The worker applies a message once per ``idempotency-key`` header: publish again with the same key
(a retry after a lost confirm, say) and the copy is acknowledged as a duplicate. The message is
persistent, and the publish waits for the broker's confirm; ``mandatory`` makes a routing key no
queue is bound to an error here (``DeliveryError``) rather than a message silently dropped.
"""

from __future__ import annotations

import argparse
import asyncio
import os

import aio_pika


async def publish(amqp_url: str, exchange: str, routing_key: str, body: bytes, key: str) -> None:
    """Publish ``body`` (JSON) to ``exchange`` with ``routing_key`` and the idempotency ``key``;
    return once the broker has confirmed it (raises ``DeliveryError`` if it was returned)."""
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        # publisher confirms: ``publish`` returns once the broker has the message; with
        # ``on_return_raises``, a message no queue takes raises instead of vanishing
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        events = await channel.get_exchange(exchange)  # declared by the worker: only checked
        await events.publish(
            aio_pika.Message(
                body,
                content_type="application/json",
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                headers={"idempotency-key": key},
            ),
            routing_key=routing_key,
            mandatory=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description="Publish one JSON message to the worker.")
    parser.add_argument("routing_key")
    parser.add_argument("body", help="the message's JSON body")
    parser.add_argument("--key", required=True, help="its idempotency key")
    args = parser.parse_args()
    asyncio.run(
        publish(
            os.environ.get("WORKER_AMQP_URL", "amqp://guest:guest@localhost:5672/"),
            os.environ.get("WORKER_EXCHANGE", "events"),
            args.routing_key,
            args.body.encode(),
            args.key,
        )
    )


if __name__ == "__main__":
    main()
