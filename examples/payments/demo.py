"""Demo traffic for the payments example: N payment requests, some of them sent twice.

``worker demo --handlers examples.payments`` runs ``demo`` below (the module's ``demo`` hook,
found by ``worker.ops.demo``) so that ``docker compose up`` shows the whole flow in its logs.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aio_pika import DeliveryMode, Message

from examples.payments import router as payments_router
from worker.core.envelope import IDEMPOTENCY_KEY_HEADER
from worker.ops.demo import DemoOptions
from worker.ops.runner import connect_broker
from worker.settings import Settings
from worker.transport.topology import declare_topology

ROUTING_KEY = "payment.requested"


@dataclass(frozen=True)
class DemoPlan:
    """What the demo sends: unique payments, the duplicates among them, the expected totals."""

    payments: list[dict[str, object]]
    sends: list[dict[str, object]]
    expected_balances: dict[str, int]


def plan_payments(count: int, duplicate_ratio: float, accounts: int, seed: int) -> DemoPlan:
    """``count`` messages, about ``duplicate_ratio`` of them repeats of earlier payments."""
    rng = random.Random(seed)
    duplicates = round(count * duplicate_ratio)
    payments = [
        {
            "payment_id": f"demo-{seed}-{i}",
            "account": f"account-{rng.randrange(accounts)}",
            "amount_cents": rng.randint(100, 10_000),
        }
        for i in range(count - duplicates)
    ]
    sends = payments + [rng.choice(payments) for _ in range(duplicates)] if payments else []
    rng.shuffle(sends)
    balances: Counter[str] = Counter()
    for payment in payments:
        balances[str(payment["account"])] += int(str(payment["amount_cents"]))
    return DemoPlan(payments, sends, dict(balances))


def request_message(payment: dict[str, object], headers: dict[str, Any] | None = None) -> Message:
    """A persistent ``payment.requested`` message keyed (and identified) by its payment id."""
    key = str(payment["payment_id"])
    return Message(
        json.dumps(payment).encode(),
        content_type="application/json",
        message_id=key,
        headers={IDEMPOTENCY_KEY_HEADER: key, **(headers or {})},
        delivery_mode=DeliveryMode.PERSISTENT,
    )


async def publish_demo(settings: Settings, plan: DemoPlan) -> None:
    """Publish ``plan.sends`` to the exchange with publisher confirms."""
    connection = await connect_broker(settings, name="worker-demo")
    async with connection:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        topology = await declare_topology(channel, settings, payments_router.routing_keys())
        for payment in plan.sends:
            await topology.exchange.publish(request_message(payment), routing_key=ROUTING_KEY)


async def demo(settings: Settings, options: DemoOptions) -> Sequence[str]:
    """``worker demo``'s traffic: ``options.count`` payment requests over ``options.accounts``
    accounts, a share ``options.duplicates`` of them resent; the balances to expect after."""
    plan = plan_payments(options.count, options.duplicates, options.accounts, options.seed)
    await publish_demo(settings, plan)
    return [
        f"published {len(plan.sends)} payment requests: {len(plan.payments)} unique payments, "
        f"{len(plan.sends) - len(plan.payments)} duplicates",
        *(
            f"  expected balance of {account}: {cents} cents (from this run)"
            for account, cents in sorted(plan.expected_balances.items())
        ),
    ]
