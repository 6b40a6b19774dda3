"""The recipes' code (examples/recipes/, shown on docs/recipes/) does what its page says, run
through the harness against the real PostgreSQL: an external API charged once however often the
message comes or its answer is lost; another service's events consumed with the fields it adds
ignored and its message_id as the key; an order and its event written from synchronous code in
one transaction, both or neither."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.recipes import consume_events, external_api, sync_publish
from tests.helpers import rows, scalar
from worker.core.outcomes import Outcome
from worker.errors import Reason
from worker.testing import Harness


@pytest.fixture
def provider(monkeypatch: pytest.MonkeyPatch) -> external_api.PaymentProvider:
    fresh = external_api.PaymentProvider()
    monkeypatch.setattr(external_api, "provider", fresh)
    return fresh


async def test_a_message_delivered_twice_charges_once(
    engine: AsyncEngine, provider: external_api.PaymentProvider
) -> None:
    harness = Harness(external_api.router, engine)
    body = {"invoice_id": "inv-1", "amount_cents": 1250}

    first = await harness.deliver("invoice.charge_requested", body, key="invoice-inv-1")
    again = await harness.deliver("invoice.charge_requested", body, key="invoice-inv-1")

    assert first.outcome is Outcome.PROCESSED
    assert first.result == {"invoice_id": "inv-1", "charge_id": "ch_1"}
    assert again.outcome is Outcome.DUPLICATE
    assert provider.requests == 1  # the committed step's output was replayed, not re-run
    assert provider.charges == {"invoice-inv-1:charge": ("ch_1", 1250)}


async def test_a_lost_answer_is_asked_again_under_the_same_key_and_charges_once(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    class LosesItsFirstAnswer(external_api.PaymentProvider):
        """Charges, then the connection drops before the answer comes back: once."""

        async def charge(self, *, idempotency_key: str, amount_cents: int) -> str:
            charge_id = await super().charge(
                idempotency_key=idempotency_key, amount_cents=amount_cents
            )
            if self.requests == 1:
                raise ConnectionResetError("the provider's answer was lost")
            return charge_id

    provider = LosesItsFirstAnswer()
    monkeypatch.setattr(external_api, "provider", provider)
    harness = Harness(external_api.router, engine, transient_attempts=2)

    delivered = await harness.deliver(
        "invoice.charge_requested", {"invoice_id": "inv-2", "amount_cents": 900}, key="inv-2"
    )

    assert delivered.outcome is Outcome.PROCESSED
    assert provider.requests == 2  # asked twice: the step never committed the first time
    assert provider.charges == {"inv-2:charge": ("ch_1", 900)}  # charged once
    assert delivered.result == {"invoice_id": "inv-2", "charge_id": "ch_1"}


async def test_another_services_event_is_consumed_with_its_new_fields_ignored(
    engine: AsyncEngine,
) -> None:
    harness = Harness(consume_events.router, engine)
    event = {
        "order_id": "o-7",
        "customer_id": "c-1",
        "amount_cents": 4250,
        "currency": "EUR",  # a field billing added after this service was written
    }

    # Billing sends no idempotency-key header: its message_id is the key
    first = await harness.deliver("billing.order_paid", event, key=None, message_id="evt-91")
    again = await harness.deliver("billing.order_paid", event, key=None, message_id="evt-91")

    assert first.outcome is Outcome.PROCESSED
    assert first.key == "evt-91"
    assert [(e.routing_key, e.body) for e in first.events] == [
        ("loyalty.points_awarded", {"customer_id": "c-1", "order_id": "o-7", "points": 42})
    ]
    assert again.outcome is Outcome.DUPLICATE
    assert again.events == ()


async def test_an_event_with_neither_key_nor_message_id_is_parked_not_guessed(
    engine: AsyncEngine,
) -> None:
    harness = Harness(consume_events.router, engine)
    event = {"order_id": "o-8", "customer_id": "c-1", "amount_cents": 100}

    parked = await harness.deliver("billing.order_paid", event)

    assert parked.outcome is Outcome.DEAD_LETTERED
    assert parked.reason is Reason.MISSING_KEY


@pytest.fixture
def shop_table(database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The recipe's own engine (from WORKER_DATABASE_URL) on the test database, which has the
    shop example's table."""
    monkeypatch.setenv("WORKER_DATABASE_URL", database_url)


ORDER: dict[str, str | int] = {
    "order_id": "sync-1",
    "account": "acct-1",
    "sku": "apple",
    "quantity": 2,
    "amount_cents": 300,
}


async def test_synchronous_code_records_the_order_and_its_event_in_one_transaction(
    engine: AsyncEngine, shop_table: None
) -> None:
    # When a synchronous view (run in a thread of its own, as Django and Flask run them) places
    # the order twice
    first = await asyncio.to_thread(sync_publish.place_order, ORDER)
    again = await asyncio.to_thread(sync_publish.place_order, ORDER)

    # Then one order row and one outbox row, under the order's id as the event's key
    assert first is not None
    assert again is None
    assert await scalar(engine, "SELECT count(*) FROM shop_orders") == 1
    assert await rows(engine, "SELECT routing_key, headers->>'idempotency-key' FROM outbox") == [
        ("order.placed", "sync-1")
    ]


async def test_synchronous_code_whose_transaction_fails_leaves_neither(
    engine: AsyncEngine, shop_table: None
) -> None:
    # When the order's event cannot be written (its key, the order id, is longer than a key
    # may be: refused at the call), the order inserted before it is rolled back with it
    broken = {**ORDER, "order_id": "o" * 600}
    with pytest.raises(ValueError, match="idempotency key is longer than"):
        await asyncio.to_thread(sync_publish.place_order, broken)

    assert await scalar(engine, "SELECT count(*) FROM shop_orders") == 0
    assert await scalar(engine, "SELECT count(*) FROM outbox") == 0
