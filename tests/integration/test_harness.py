"""``worker.testing.Harness`` against the real PostgreSQL: the examples through the harness, and
the same deliveries through the harness and through the real worker over RabbitMQ leave the same
database state, the same events and the same dead letters."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from aio_pika.abc import AbstractIncomingMessage, AbstractRobustConnection
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.orders import add_stock
from examples.orders import router as orders
from examples.orders.gateway import charge_id_for
from examples.payments import router as payments
from tests.helpers import payment, rows, scalar, wait_until
from tests.integration.support import TABLES, dead_letters, publish, running_worker
from worker import Batch, Context, Permanent, Retryable, Router, Workflow
from worker.settings import Settings
from worker.testing import Delivered, Harness, Message, Published
from worker.transport import dead_letters as dlq


def order(
    order_id: str, sku: str = "widget", quantity: int = 1, amount_cents: int = 500
) -> dict[str, Any]:
    return {
        "order_id": order_id,
        "sku": sku,
        "quantity": quantity,
        "amount_cents": amount_cents,
        "account": "alice",
    }


async def seed_stock(engine: AsyncEngine, sku: str = "widget", quantity: int = 5) -> None:
    async with engine.begin() as conn:
        await add_stock(conn, sku, quantity)


# The examples through the harness


async def test_a_payment_delivered_twice_changes_the_balance_once_and_emits_one_event(
    engine: AsyncEngine,
) -> None:
    harness = Harness(payments, engine)
    body = payment("p1", "alice", 250)

    first = await harness.deliver("payment.requested", body, key="p1")
    again = await harness.deliver("payment.requested", body, key="p1")

    assert (first.outcome, again.outcome) == ("processed", "duplicate")
    assert await scalar(engine, "SELECT balance_cents FROM accounts WHERE account = 'alice'") == 250
    assert await scalar(engine, "SELECT count(*) FROM ledger_entries") == 1
    settled = {**body, "balance_cents": 250}
    assert [(e.routing_key, e.body) for e in harness.published] == [("payment.settled", settled)]
    assert first.events == tuple(harness.published)
    assert again.events == ()
    assert first.result == settled
    event = first.events[0]
    assert (event.exchange, event.ordering_key, event.causation_id) == ("events", "alice", "p1")
    assert event.headers["causation-id"] == "p1"
    assert await scalar(engine, "SELECT count(*) FROM outbox") == 0  # drained
    assert harness.dead_letters == []


async def test_an_invalid_body_is_dead_lettered_as_invalid(engine: AsyncEngine) -> None:
    harness = Harness(payments, engine)
    body = {"payment_id": "p1", "account": "alice", "amount_cents": "100"}  # strict: not an int

    parked = await harness.deliver("payment.requested", body, key="p1")

    assert (parked.outcome, parked.reason) == ("dead_lettered", "invalid")
    assert parked.error is not None
    assert "amount_cents" in parked.error
    assert parked.dead_letter_headers[dlq.REASON] == "invalid"
    assert harness.dead_letters == [parked]
    assert parked.key == "p1"
    # rejected before any transaction, like the worker: no key recorded, no effect
    assert await scalar(engine, "SELECT count(*) FROM inbox") == 0
    assert await scalar(engine, "SELECT count(*) FROM accounts") == 0
    assert harness.published == []


async def test_the_same_key_with_another_payload_is_dead_lettered_as_key_reused(
    engine: AsyncEngine,
) -> None:
    harness = Harness(payments, engine)
    await harness.deliver("payment.requested", payment("p1", "alice", 100), key="p1")

    reused = await harness.deliver("payment.requested", payment("p1", "alice", 999), key="p1")

    assert (reused.outcome, reused.reason) == ("dead_lettered", "key-reused")
    assert reused.error == "idempotency key reused with a different payload"
    assert await scalar(engine, "SELECT balance_cents FROM accounts") == 100
    # the key keeps its completed state: a reused key is never recorded as failed
    assert await scalar(engine, "SELECT status FROM inbox WHERE key = 'p1'") == "completed"
    assert len(harness.published) == 1


async def test_a_failing_handler_is_dead_lettered_and_its_key_recorded_as_failed(
    engine: AsyncEngine,
) -> None:
    harness = Harness(payments, engine)
    await harness.deliver("payment.requested", payment("p1"), key="k1")

    # the same payment under another key breaks the ledger's primary key inside the handler
    failed = await harness.deliver("payment.requested", payment("p1"), key="k2")
    again = await harness.deliver("payment.requested", payment("p1"), key="k2")

    assert (failed.outcome, failed.reason) == ("dead_lettered", "handler-error")
    assert failed.exception_type == "DuplicatePayment"
    assert failed.dead_letter_headers[dlq.HANDLER] == "payment.requested"
    assert again.outcome == "duplicate_of_failed"
    assert await rows(engine, "SELECT key, status, attempts FROM inbox ORDER BY key") == [
        ("k1", "completed", 1),
        ("k2", "failed", 1),
    ]
    assert await scalar(engine, "SELECT balance_cents FROM accounts") == 100
    assert [d.outcome for d in harness.deliveries] == [
        "processed",
        "dead_lettered",
        "duplicate_of_failed",
    ]


async def test_a_published_event_fed_back_is_handled_once(engine: AsyncEngine) -> None:
    harness = Harness(payments, engine)
    paid = await harness.deliver("payment.requested", payment("p1"), key="p1")
    (settled,) = paid.events

    notice = await harness.deliver_event(settled)
    relayed_twice = await harness.deliver_event(settled)

    assert (notice.outcome, relayed_twice.outcome) == ("processed", "duplicate")
    assert notice.key == settled.message_id  # no idempotency-key header: the message id
    assert await rows(engine, "SELECT payment_id, event_id FROM settlement_notices") == [
        ("p1", settled.message_id)
    ]


async def test_an_order_workflow_ships_once(engine: AsyncEngine) -> None:
    await seed_stock(engine, "widget", 5)
    harness = Harness(orders, engine)

    # Given an order dispatched, waiting for its confirmation, and delivered again meanwhile
    first = await harness.deliver("order.placed", order("o1", quantity=2), key="o1")
    again = await harness.deliver("order.placed", order("o1", quantity=2), key="o1")
    assert (first.outcome, again.outcome) == ("waiting", "waiting")

    # When the carrier confirms it and the resume that confirmation published is delivered
    confirmed = {"order_id": "o1", "tracking": "TRK-1"}
    signal = await harness.deliver("shipping.confirmed", confirmed, message_id="c1")
    shipped, resume = harness.published
    resumed = await harness.deliver_event(resume)
    replayed = await harness.deliver_event(resume)

    # Then the workflow completed once, with the tracking number
    assert (signal.outcome, resumed.outcome, replayed.outcome) == (
        "processed",
        "processed",
        "duplicate",
    )
    assert (shipped.routing_key, resume.routing_key) == ("order.shipped", "order.placed")
    assert shipped.body["charge_id"] == charge_id_for("o1:charge_payment")
    assert (resumed.result["shipment"], resumed.result["tracking"]) == ("o1", "TRK-1")
    assert await scalar(engine, "SELECT available FROM stock WHERE sku = 'widget'") == 3
    assert await scalar(engine, "SELECT count(*) FROM gateway_calls") == 1
    assert await rows(engine, "SELECT step FROM workflow_steps ORDER BY position") == [
        ("reserve_inventory",),
        ("charge_payment",),
        ("dispatch_shipping",),
    ]


async def test_an_order_out_of_stock_is_dead_lettered_with_the_handlers_exception(
    engine: AsyncEngine,
) -> None:
    await seed_stock(engine, "widget", 1)
    harness = Harness(orders, engine)

    parked = await harness.deliver("order.placed", order("o1", quantity=2), key="o1")

    assert (parked.outcome, parked.reason, parked.exception_type) == (
        "dead_lettered",
        "handler-error",
        "Permanent",
    )
    assert "out of stock" in (parked.error or "")
    assert await scalar(engine, "SELECT status FROM inbox WHERE key = 'o1'") == "failed"
    assert await scalar(engine, "SELECT available FROM stock") == 1
    assert harness.published == []


def flaky_router(failures: int) -> tuple[Router, list[int]]:
    """A handler that credits ``acct`` and then fails transiently ``failures`` times."""
    router = Router()
    calls: list[int] = []

    @router.handler("flaky")
    async def flaky(body: dict[str, Any], ctx: Context) -> None:
        calls.append(ctx.attempt)
        await ctx.connection.execute(
            text("INSERT INTO accounts (account, balance_cents) VALUES ('acct', 1)")
        )
        if len(calls) <= failures:
            raise Retryable("the provider is busy")
        ctx.publish("flaky.done", body)

    return router, calls


async def test_a_transient_failure_is_raised_to_the_test_and_commits_nothing(
    engine: AsyncEngine,
) -> None:
    router, calls = flaky_router(failures=1)
    harness = Harness(router, engine)  # one try, as by default

    with pytest.raises(Retryable):
        await harness.deliver("flaky", {"n": 1}, key="k")

    assert calls == [1]
    assert await scalar(engine, "SELECT count(*) FROM inbox") == 0
    assert await scalar(engine, "SELECT count(*) FROM accounts") == 0
    assert harness.deliveries == []
    # delivered again (as the worker's delayed retry would), it goes through
    assert (await harness.deliver("flaky", {"n": 1}, key="k")).outcome == "processed"


async def test_transient_failures_are_retried_in_process_when_asked(engine: AsyncEngine) -> None:
    router, calls = flaky_router(failures=2)
    harness = Harness(router, engine, transient_attempts=3)

    done = await harness.deliver("flaky", {"n": 1}, key="k")

    assert done.outcome == "processed"
    assert calls == [1, 1, 1]
    assert await scalar(engine, "SELECT count(*) FROM accounts") == 1
    assert [e.routing_key for e in done.events] == ["flaky.done"]


async def test_a_permanent_error_raised_in_a_handler_is_dead_lettered_at_once(
    engine: AsyncEngine,
) -> None:
    router = Router()

    @router.handler("doomed")
    async def doomed(body: dict[str, Any], ctx: Context) -> None:
        raise Permanent("no such account")

    parked = await Harness(router, engine).deliver("doomed", {}, message_id="m1")

    assert (parked.reason, parked.error, parked.key) == (
        "handler-error",
        "Permanent: no such account",
        "m1",
    )


async def test_a_message_without_a_key_is_dead_lettered_as_missing_key(
    engine: AsyncEngine,
) -> None:
    parked = await Harness(payments, engine).deliver("payment.requested", payment("p1"))

    assert (parked.outcome, parked.reason, parked.key) == ("dead_lettered", "missing-key", None)


# Batches through the harness, as the consumer takes them


async def test_one_bad_message_in_a_batch_is_parked_while_the_others_commit(
    engine: AsyncEngine,
) -> None:
    # Given a payment settled before under key k1
    harness = Harness(payments, engine)
    await harness.deliver("payment.requested", payment("p1", "alice", 100), key="k1")

    # When one batch holds two good payments, the same payment again under another key (the
    # batch handler names it as its culprit) and a body that fails its checks
    ended = await harness.deliver_batch(
        [
            Message("payment.requested", payment("p2", "bob", 200), key="k2"),
            Message("payment.requested", payment("p1", "alice", 100), key="k-again"),
            Message("payment.requested", {**payment("p3"), "amount_cents": "1"}, key="k3"),
            Message("payment.requested", payment("p4", "bob", 300), key="k4"),
        ]
    )

    # Then the bad ones are parked, the others committed, each with its own events
    assert [(d.outcome, d.reason) for d in ended] == [
        ("processed", None),
        ("dead_lettered", "handler-error"),
        ("dead_lettered", "invalid"),
        ("processed", None),
    ]
    assert ended[1].exception_type == "DuplicatePayment"
    assert await rows(engine, "SELECT account, balance_cents FROM accounts ORDER BY 1") == [
        ("alice", 100),
        ("bob", 500),
    ]
    assert await rows(engine, "SELECT key, status FROM inbox ORDER BY key") == [
        ("k-again", "failed"),
        ("k1", "completed"),
        ("k2", "completed"),
        ("k4", "completed"),
    ]
    assert [[e.causation_id for e in d.events] for d in ended] == [["k2"], [], [], ["k4"]]
    assert ended[3].result == {**payment("p4", "bob", 300), "balance_cents": 500}
    assert harness.dead_letters == [ended[1], ended[2]]
    assert harness.deliveries[1:] == ended


async def test_a_batch_handlers_culprit_is_found_and_parked_and_the_rest_committed(
    engine: AsyncEngine,
) -> None:
    # Given a batch handler that fails, without naming a culprit, when 3 is among its bodies
    router = Router()
    calls: list[list[int]] = []

    @router.batch_handler("many")
    async def many(bodies: list[int], batch: Batch) -> None:
        calls.append(list(bodies))
        await batch.asyncpg.executemany(
            "INSERT INTO accounts (account, balance_cents) VALUES ($1, $2)",
            [(f"a{n}", n) for n in bodies],
        )
        if 3 in bodies:
            raise ValueError("3 is bad")

    # When five messages come as one batch
    ended = await Harness(router, engine).deliver_batch(
        [Message("many", n, key=f"k{n}") for n in range(1, 6)]
    )

    # Then bisection found the culprit: it is parked, its key failed, the rest committed
    assert [d.outcome for d in ended] == [
        "processed",
        "processed",
        "dead_lettered",
        "processed",
        "processed",
    ]
    assert (ended[2].reason, ended[2].exception_type) == ("handler-error", "ValueError")
    assert calls[0] == [1, 2, 3, 4, 5]  # all of them in one call first
    assert await rows(engine, "SELECT account FROM accounts ORDER BY 1") == [
        ("a1",),
        ("a2",),
        ("a4",),
        ("a5",),
    ]
    assert await scalar(engine, "SELECT status FROM inbox WHERE key = 'k3'") == "failed"


async def test_a_key_delivered_twice_in_one_batch_runs_once(engine: AsyncEngine) -> None:
    harness = Harness(payments, engine)
    body = payment("p1", "alice", 250)

    ended = await harness.deliver_batch(
        [
            Message("payment.requested", body, key="p1"),
            Message("payment.requested", payment("p2", "bob", 1), key="p2"),
            Message("payment.requested", body, key="p1"),
        ]
    )

    assert [d.outcome for d in ended] == ["processed", "processed", "duplicate"]
    assert await scalar(engine, "SELECT count(*) FROM ledger_entries") == 2
    assert await scalar(engine, "SELECT balance_cents FROM accounts WHERE account = 'alice'") == 250
    assert [e.routing_key for e in ended[0].events] == ["payment.settled"]
    assert ended[2].events == ()
    assert ended[2].result == ended[0].result
    assert len(harness.published) == 2


async def test_a_workflow_in_a_batch_runs_alone(engine: AsyncEngine) -> None:
    # Given a plain handler and a workflow that each note their transaction's id
    router = Router()
    transactions: dict[str, int] = {}

    async def transaction_id(ctx: Context) -> int:
        return int((await ctx.connection.execute(text("SELECT txid_current()"))).scalar_one())

    @router.handler("plain")
    async def plain(body: dict[str, Any], ctx: Context) -> None:
        transactions[ctx.key] = await transaction_id(ctx)

    @router.workflow("flow")
    async def flow(body: dict[str, Any], wf: Workflow) -> None:
        transactions["flow"] = await wf.step("note", transaction_id)

    # When a batch holds a workflow between two plain messages
    ended = await Harness(router, engine).deliver_batch(
        [Message("plain", {}, key="a"), Message("flow", {}, key="f"), Message("plain", {}, key="b")]
    )

    # Then the plain ones shared one transaction and the workflow ran in its own
    assert [d.outcome for d in ended] == ["processed"] * 3
    assert transactions["a"] == transactions["b"] != transactions["flow"]
    assert await rows(engine, "SELECT key, step FROM workflow_steps") == [("f", "note")]


async def test_a_batch_that_fails_as_a_whole_is_redone_one_delivery_at_a_time(
    engine: AsyncEngine,
) -> None:
    # Given a batch handler that returns one result too few for a batch of several
    router = Router()
    calls: list[list[int]] = []

    @router.batch_handler("short")
    async def short(bodies: list[int], batch: Batch) -> list[int]:
        calls.append(list(bodies))
        return bodies[: max(1, len(bodies) - 1)]

    # When three messages come as one batch
    ended = await Harness(router, engine).deliver_batch(
        [Message("short", n, key=f"k{n}") for n in range(3)]
    )

    # Then the shared transaction failed and each ran in one of its own
    assert [(d.outcome, d.result) for d in ended] == [("processed", n) for n in range(3)]
    assert calls == [[0, 1, 2], [0], [1], [2]]


async def test_a_failure_to_retry_later_in_a_batch_is_raised_after_the_others_ended(
    engine: AsyncEngine,
) -> None:
    # Given a handler that always fails transiently for one of its messages
    router = Router()
    calls: list[str] = []

    @router.handler("busy")
    async def busy(body: dict[str, Any], ctx: Context) -> None:
        calls.append(ctx.key)
        if body["busy"]:
            raise Retryable("the provider is busy")

    harness = Harness(router, engine)  # one try in process, then a delayed retry

    # When it comes in a batch with a message that succeeds, the delayed retry is raised
    with pytest.raises(Retryable):
        await harness.deliver_batch(
            [Message("busy", {"busy": True}, key="k1"), Message("busy", {"busy": False}, key="k2")]
        )

    # Then only after the other one committed: k1 failed in the batch, then once alone
    assert [(d.key, d.outcome) for d in harness.deliveries] == [("k2", "processed")]
    assert await rows(engine, "SELECT key, status FROM inbox") == [("k2", "completed")]
    assert calls == ["k1", "k2", "k1"]


# The harness and the real worker agree


@dataclass(frozen=True)
class Send:
    key: str
    body: Any
    routing_key: str


@dataclass(frozen=True)
class Scenario:
    router: Router
    sends: list[Send]
    seed: Callable[[AsyncEngine], Awaitable[None]]
    queries: tuple[str, ...]


def payments_scenario() -> Scenario:
    """30 payments, 8 of them delivered again, and one of each kind of bad message."""
    rng = random.Random(5)
    unique = [payment(f"p{i}", f"acct-{rng.randrange(3)}", rng.randint(1, 500)) for i in range(30)]
    sends = [Send(p["payment_id"], p, "payment.requested") for p in unique]
    sends += [sends[rng.randrange(len(sends))] for _ in range(8)]
    rng.shuffle(sends)
    bad = [
        Send("bad-1", {**unique[0], "amount_cents": "100"}, "payment.requested"),  # invalid
        Send("bad-2", b"{not json", "payment.requested"),  # undecodable
        Send("p3", {**unique[3], "amount_cents": 1}, "payment.requested"),  # key-reused
        Send("p5-again", unique[5], "payment.requested"),  # handler-error: ledger key taken
        Send("p5-again", unique[5], "payment.requested"),  # duplicate of a failed key
    ]
    return Scenario(
        payments,
        sends + bad,
        seed=lambda engine: _nothing(),
        queries=(
            "SELECT account, balance_cents FROM accounts ORDER BY account",
            "SELECT payment_id, account, amount_cents FROM ledger_entries ORDER BY payment_id",
        ),
    )


def orders_scenario() -> Scenario:
    """Orders through the workflow up to its wait for the shipping confirmation: duplicates (of
    waiting workflows), one out of stock, one invalid, one key reused."""
    placed = [order(f"o{i}", quantity=2) for i in range(4)]
    sends = [Send(o["order_id"], o, "order.placed") for o in placed]
    sends.insert(2, sends[0])
    sends += [
        sends[1],
        Send("o1", {**placed[1], "amount_cents": 1}, "order.placed"),  # key-reused
        Send("o9", {**placed[0], "quantity": "2"}, "order.placed"),  # invalid
        Send("o8", order("o8", sku="gadget"), "order.placed"),  # unknown sku: handler-error
        Send("o3", placed[3], "order.placed"),  # o3 ran out of stock: duplicate of failed
    ]
    return Scenario(
        orders,
        sends,
        seed=lambda engine: seed_stock(engine, "widget", 7),
        queries=(
            "SELECT sku, available FROM stock ORDER BY sku",
            "SELECT order_id, sku, quantity FROM reservations ORDER BY order_id",
            "SELECT order_id, charge_id FROM shipments ORDER BY order_id",
            "SELECT idempotency_key, amount_cents, charge_id FROM gateway_calls ORDER BY id",
            "SELECT handler, key, step, position, output FROM workflow_steps"
            " ORDER BY key, position",
        ),
    )


async def _nothing() -> None:
    return None


INBOX = (
    "SELECT handler, key, status, fingerprint, recovery_point, result, error, attempts,"
    " message_id, routing_key, owner FROM inbox ORDER BY handler, key"
)
OUTBOX = (
    "SELECT exchange, routing_key, body, content_type, correlation_id, causation_id,"
    " ordering_key, headers FROM outbox ORDER BY id"
)
DEAD_LETTER_HEADERS = (
    "idempotency-key",
    dlq.REASON,
    dlq.ERROR,
    dlq.EXCEPTION_TYPE,
    dlq.HANDLER,
    dlq.ATTEMPTS,
    dlq.ORIGINAL_ROUTING_KEY,
)
TRACE_HEADERS = {"traceparent", "tracestate"}
RELAY_HEADERS = {"causation-id", "correlation-id"}
"""Headers the relay adds when it publishes a row (the row holds them as columns)."""


def event_of(e: Published) -> tuple[Any, ...]:
    headers = {k: v for k, v in e.headers.items() if k not in {*RELAY_HEADERS, *TRACE_HEADERS}}
    return (
        e.exchange,
        e.routing_key,
        e.raw,
        e.content_type,
        e.correlation_id,
        e.causation_id,
        e.ordering_key,
        headers,
    )


def outbox_row(row: Any) -> tuple[Any, ...]:
    *columns, headers = row
    columns[2] = bytes(columns[2])
    return (*columns, {k: v for k, v in headers.items() if k not in TRACE_HEADERS})


def parked_of(headers: Any) -> tuple[Any, ...]:
    return tuple(_text(headers.get(name)) for name in DEAD_LETTER_HEADERS)


def _text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


async def database_state(engine: AsyncEngine, scenario: Scenario) -> list[list[Any]]:
    return [[tuple(row) for row in await rows(engine, sql)] for sql in (*scenario.queries, INBOX)]


async def truncate(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.execute(text(f"TRUNCATE {', '.join(TABLES)}"))


@pytest.mark.parametrize("make_scenario", [payments_scenario, orders_scenario])
async def test_the_harness_and_the_worker_agree(
    settings: Settings,
    engine: AsyncEngine,
    amqp: AbstractRobustConnection,
    make_scenario: Callable[[], Scenario],
) -> None:
    scenario = make_scenario()
    # One delivery at a time on both sides, so that both see the same order; the worker's
    # events stay in the outbox (no relay) to be compared with what the harness drained.
    worker_settings = settings.replace(relay=False, concurrency=1, prefetch=1)

    # Through the harness
    await scenario.seed(engine)
    harness = Harness.from_settings(scenario.router, engine, settings)
    outcomes: list[Delivered] = []
    for i, send in enumerate(scenario.sends):
        outcomes.append(
            await harness.deliver(send.routing_key, send.body, key=send.key, message_id=f"m{i}")
        )
    by_harness = await database_state(engine, scenario)
    harness_events = [event_of(e) for e in harness.published]
    harness_parked = [parked_of(d.dead_letter_headers) for d in harness.dead_letters]

    # Through the real worker, over RabbitMQ, on emptied tables
    await truncate(engine)
    await scenario.seed(engine)
    async with running_worker(worker_settings, scenario.router) as worker:
        channel = await amqp.channel(publisher_confirms=True)
        for i, send in enumerate(scenario.sends):
            await publish(
                channel,
                settings,
                send.body,
                key=send.key,
                message_id=f"m{i}",
                routing_key=send.routing_key,
            )
        outcome_names = (
            "processed",
            "duplicate",
            "duplicate_of_failed",
            "waiting",
            "dead_lettered",
        )

        async def settled() -> bool:
            return sum(worker.stats[name] for name in outcome_names) >= len(scenario.sends)

        await wait_until(settled)
        parked: list[AbstractIncomingMessage] = await dead_letters(channel, settings)
    by_worker = await database_state(engine, scenario)
    worker_events = [outbox_row(row) for row in await rows(engine, OUTBOX)]
    worker_parked = [parked_of(message.headers) for message in parked]

    # Then both committed the same effects, inbox rows, events and dead letters
    assert by_harness == by_worker
    assert harness_events == worker_events
    assert harness_parked == worker_parked
    counts = {name: sum(d.outcome == name for d in outcomes) for name in outcome_names}
    assert counts == {name: worker.stats[name] for name in outcome_names}
    assert {d.reason for d in harness.dead_letters} >= {"invalid", "key-reused", "handler-error"}
    assert harness_events  # the comparison was not vacuous


async def test_a_missing_table_is_raised_to_the_test_not_dead_lettered(
    engine: AsyncEngine,
) -> None:
    # Given a handler whose table does not exist (its migration was never applied)
    router = Router()

    @router.handler("audit")
    async def audit(body: dict[str, Any], ctx: Context) -> None:
        await ctx.connection.execute(text("INSERT INTO no_such_table VALUES (1)"))

    harness = Harness(router, engine)
    # Then, as the worker would pause rather than park, the harness raises it to the test
    with pytest.raises(Exception, match="no_such_table"):
        await harness.deliver("audit", {"n": 1}, key="k-audit")
    assert harness.dead_letters == []
    assert await scalar(engine, "SELECT count(*) FROM inbox") == 0


async def test_the_harness_keeps_the_workers_depth_limit(engine: AsyncEngine) -> None:
    harness = Harness(payments, engine, max_json_depth=2)
    deep = b'{"a": {"b": {"c": 1}}, "payment_id": "p", "account": "a", "amount_cents": 1}'
    delivered = await harness.deliver("payment.requested", deep, key="k-deep")
    assert (delivered.outcome, delivered.reason) == ("dead_lettered", "body-too-deep")


async def test_a_scheduled_event_is_published_by_the_harness_only_once_time_has_advanced(
    engine: AsyncEngine,
) -> None:
    # Given a handler that schedules a reminder an hour ahead and publishes a receipt now
    reminders = Router()

    @reminders.handler("invoice.sent")
    async def remind(body: dict[str, Any], ctx: Context) -> None:
        ctx.publish("invoice.receipt", body)
        ctx.publish("invoice.reminder", body, delay=timedelta(hours=1))

    harness = Harness(reminders, engine)

    # When the message is delivered
    delivered = await harness.deliver("invoice.sent", {"invoice": "i1"}, key="i1")

    # Then only the receipt is published; the reminder waits for its due time
    assert [e.routing_key for e in delivered.events] == ["invoice.receipt"]
    assert await scalar(engine, "SELECT count(*) FROM outbox_scheduled") == 1

    # And 59 minutes later it still waits, while an hour later it is published, once
    assert await harness.advance(timedelta(minutes=59)) == []
    [reminder] = await harness.advance(timedelta(minutes=1))
    assert (reminder.routing_key, reminder.body) == ("invoice.reminder", {"invoice": "i1"})
    assert await harness.relay() == []
    assert await scalar(engine, "SELECT count(*) FROM outbox_scheduled") == 0
    with pytest.raises(ValueError, match="forward"):
        await harness.advance(timedelta(seconds=-1))
