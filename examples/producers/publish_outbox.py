"""Publish an event through the worker's outbox, in your own transaction.

    python -m examples.producers.publish_outbox p-1 alice 250

The event commits with the transaction's other writes, or not at all; the worker's relay
publishes it once committed. The engine comes from the worker's own ``WORKER_DATABASE_URL``
(``postgresql://...`` as ``psql`` takes it).
"""

from __future__ import annotations

import asyncio
import sys

from worker import outbox


async def request_payment(payment_id: str, account: str, amount_cents: int) -> None:
    engine = outbox.engine_from_env()  # WORKER_DATABASE_URL, driven by asyncpg
    try:
        async with engine.begin() as conn:
            # ... your own writes on conn, in the same transaction ...
            await outbox.publish(
                conn,
                "payment.requested",
                {"payment_id": payment_id, "account": account, "amount_cents": amount_cents},
                key=payment_id,  # the idempotency-key header: a retry is applied once
            )
    finally:
        await engine.dispose()


if __name__ == "__main__":
    payment_id, account, amount_cents = sys.argv[1:]
    asyncio.run(request_payment(payment_id, account, int(amount_cents)))
