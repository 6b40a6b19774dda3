"""The unit of work against the real PostgreSQL: one transaction holds the claim, the effect,
the outbox rows and the completion, or none of them."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.payments import router as payments
from tests.helpers import envelope, payment, rows, scalar
from worker import Context, Retryable, Router
from worker.core.codec import fingerprint
from worker.core.config import UnitOfWorkConfig
from worker.core.outcomes import Outcome
from worker.core.unit_of_work import process
from worker.errors import HandlerFailed, KeyReused

EXCHANGE = "events"
UNIT = UnitOfWorkConfig(exchange=EXCHANGE)


async def test_effect_inbox_and_outbox_commit_together(engine: AsyncEngine) -> None:
    # Given a payment request
    env = envelope(
        payments,
        "payment.requested",
        payment("p1", "alice", 250),
        "key-1",
        message_id="m-1",
        correlation_id="corr-1",
    )

    # When it is processed
    outcome = await process(engine, env, UNIT)

    # Then the effect, the inbox row and the outbox row are all there
    assert outcome is Outcome.PROCESSED
    assert await scalar(engine, "SELECT balance_cents FROM accounts WHERE account='alice'") == 250
    assert await scalar(engine, "SELECT count(*) FROM ledger_entries WHERE payment_id='p1'") == 1
    [inbox] = await rows(
        engine,
        "SELECT handler, key, status, result, fingerprint, message_id, routing_key FROM inbox",
    )
    assert (inbox.handler, inbox.key, inbox.status) == ("payment.requested", "key-1", "completed")
    assert inbox.result == {
        "payment_id": "p1",
        "account": "alice",
        "amount_cents": 250,
        "balance_cents": 250,
    }
    assert bytes(inbox.fingerprint) == fingerprint(payment("p1", "alice", 250))
    assert (inbox.message_id, inbox.routing_key) == ("m-1", "payment.requested")
    [event] = await rows(
        engine,
        "SELECT exchange, routing_key, body, content_type,"
        " correlation_id, causation_id FROM outbox",
    )
    assert (event.exchange, event.routing_key) == (EXCHANGE, "payment.settled")
    assert json.loads(event.body) == inbox.result
    assert event.content_type == "application/json"
    assert (event.correlation_id, event.causation_id) == ("corr-1", "key-1")


async def test_a_completed_key_is_a_duplicate_and_the_handler_does_not_run(
    engine: AsyncEngine,
) -> None:
    calls: list[str] = []
    router = Router()

    @router.handler("count.me")
    async def count(body: dict[str, Any], ctx: Context) -> None:
        calls.append(ctx.key)

    first = await process(engine, envelope(router, "count.me", {"n": 1}, "k"), UNIT)
    second = await process(engine, envelope(router, "count.me", {"n": 1}, "k"), UNIT)

    assert (first, second) == (Outcome.PROCESSED, Outcome.DUPLICATE)
    assert calls == ["k"]


async def test_same_payload_with_other_key_order_is_still_a_duplicate(engine: AsyncEngine) -> None:
    body_a = b'{"payment_id": "p1", "account": "alice", "amount_cents": 5}'
    body_b = b'{"amount_cents":5,"account":"alice","payment_id":"p1"}'
    await process(engine, envelope(payments, "payment.requested", body_a, "k"), UNIT)
    outcome = await process(engine, envelope(payments, "payment.requested", body_b, "k"), UNIT)
    assert outcome is Outcome.DUPLICATE
    assert await scalar(engine, "SELECT balance_cents FROM accounts") == 5


async def test_a_key_reused_with_another_payload_is_refused_and_the_first_effect_stands(
    engine: AsyncEngine,
) -> None:
    await process(
        engine,
        envelope(payments, "payment.requested", payment("p1", amount_cents=100), "k"),
        UNIT,
    )

    with pytest.raises(KeyReused, match="idempotency key reused with a different payload"):
        await process(
            engine,
            envelope(payments, "payment.requested", payment("p1", amount_cents=999), "k"),
            UNIT,
        )

    assert await scalar(engine, "SELECT balance_cents FROM accounts") == 100
    assert await scalar(engine, "SELECT count(*) FROM outbox") == 1


async def test_a_handler_exception_rolls_back_effect_inbox_and_outbox(engine: AsyncEngine) -> None:
    router = Router()

    @router.handler("explode")
    async def explode(body: dict[str, Any], ctx: Context) -> None:
        await ctx.session.execute(
            text("INSERT INTO accounts (account, balance_cents) VALUES ('bob', 1)")
        )
        await ctx.session.commit()  # must not escape the unit of work's transaction
        ctx.publish("exploded", {"x": 1})
        raise ValueError("boom")

    with pytest.raises(HandlerFailed, match="ValueError: boom"):
        await process(engine, envelope(router, "explode", {}, "k"), UNIT)

    assert await scalar(engine, "SELECT count(*) FROM accounts") == 0
    assert await scalar(engine, "SELECT count(*) FROM inbox") == 0
    assert await scalar(engine, "SELECT count(*) FROM outbox") == 0


async def test_a_result_the_database_cannot_store_fails_the_message_not_the_worker(
    engine: AsyncEngine,
) -> None:
    router = Router()

    @router.handler("nul")
    async def nul(body: dict[str, Any], ctx: Context) -> str:
        ctx.publish("side.effect", {"ok": True})
        return "\x00"  # jsonb cannot hold NUL

    with pytest.raises(HandlerFailed):
        await process(engine, envelope(router, "nul", {}, "k"), UNIT)
    assert await scalar(engine, "SELECT count(*) FROM outbox") == 0


async def test_a_transient_failure_propagates_as_it_is_for_the_caller_to_retry(
    engine: AsyncEngine,
) -> None:
    router = Router()

    @router.handler("flaky")
    async def flaky(body: dict[str, Any], ctx: Context) -> None:
        raise Retryable("gateway busy")

    with pytest.raises(Retryable):
        await process(engine, envelope(router, "flaky", {}, "k"), UNIT)
    assert await scalar(engine, "SELECT count(*) FROM inbox") == 0


async def test_publish_names_exchange_headers_and_ordering_key(engine: AsyncEngine) -> None:
    router = Router()

    @router.handler("fan.out")
    async def fan_out(body: dict[str, Any], ctx: Context) -> None:
        ctx.publish("a", {"i": 1})
        ctx.publish(
            "b",
            b"raw",
            exchange="audit",
            headers={"tenant": "t1"},
            ordering_key="acct-1",
            content_type="text/plain",
        )

    await process(engine, envelope(router, "fan.out", {}, "k"), UNIT)

    events = await rows(
        engine,
        "SELECT exchange, routing_key, body, content_type, headers,"
        " ordering_key FROM outbox ORDER BY id",
    )
    assert [(e.exchange, e.routing_key) for e in events] == [(EXCHANGE, "a"), ("audit", "b")]
    assert bytes(events[1].body) == b"raw"
    assert events[1].content_type == "text/plain"
    assert events[1].headers == {"tenant": "t1"}
    assert (events[0].ordering_key, events[1].ordering_key) == (None, "acct-1")


class _Gate:
    """Holds a handler inside its open transaction until the test lets it go."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()


def _gated_router(gate: _Gate, calls: list[str], fail_first: bool = False) -> Router:
    router = Router()

    @router.handler("payment.requested")
    async def settle(body: dict[str, Any], ctx: Context) -> None:
        calls.append(ctx.key)
        await ctx.connection.execute(
            text(
                "INSERT INTO accounts VALUES (:a, :c) ON CONFLICT (account) DO UPDATE"
                " SET balance_cents = accounts.balance_cents + excluded.balance_cents"
            ),
            {"a": body["account"], "c": body["amount_cents"]},
        )
        if len(calls) == 1:
            gate.entered.set()
            await gate.release.wait()
            if fail_first:
                raise RuntimeError("first delivery fails after its write")

    return router


async def _wait_for_lock_waiter(engine: AsyncEngine) -> None:
    """Until some backend of this database waits on a lock (the second claim)."""
    for _ in range(500):
        waiting = await scalar(
            engine,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock'",
        )
        if waiting:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the second delivery never waited on the first one's claim")


@pytest.mark.parametrize("first_commits", [True, False], ids=["first-commits", "first-rolls-back"])
async def test_concurrent_deliveries_of_one_key_have_exactly_one_effect(
    engine: AsyncEngine, first_commits: bool
) -> None:
    # Given a first delivery holding its transaction open after its write
    gate, calls = _Gate(), []
    router = _gated_router(gate, calls, fail_first=not first_commits)
    body = payment("p1", "alice", 700)
    first = asyncio.create_task(
        process(engine, envelope(router, "payment.requested", body, "k"), UNIT)
    )
    await gate.entered.wait()

    # When a second delivery of the same key arrives meanwhile
    second = asyncio.create_task(
        process(engine, envelope(router, "payment.requested", body, "k"), UNIT)
    )
    await _wait_for_lock_waiter(engine)
    assert not second.done()  # it waits on the uncommitted inbox row
    gate.release.set()
    results = await asyncio.gather(first, second, return_exceptions=True)

    # Then exactly one effect exists
    if first_commits:
        assert results == [Outcome.PROCESSED, Outcome.DUPLICATE]
        assert calls == ["k"]
    else:
        assert isinstance(results[0], HandlerFailed)
        assert results[1] is Outcome.PROCESSED  # it claimed the key once the first rolled back
        assert calls == ["k", "k"]
    assert await scalar(engine, "SELECT balance_cents FROM accounts WHERE account='alice'") == 700
    assert await scalar(engine, "SELECT count(*) FROM inbox WHERE status='completed'") == 1
