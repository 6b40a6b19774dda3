"""Failure isolation inside a batch, against the real PostgreSQL: a handler that fails in a batch
of several messages is taken out of it (its group rolled back to a savepoint and run again
without it), the others commit in the same transaction, and the culprit is left unclaimed to run
on its own. Nothing is applied twice; each culprit takes exactly its own failure path."""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from aio_pika import Message
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.payments import router as payments
from tests.helpers import broker_depth, envelope, payment, rows, scalar, wait_until
from tests.integration.support import (
    dead_letters,
    running_worker,
    wait_for_consumer,
    worker_process,
)
from tests.integration.test_batching import publish_all
from worker import Batch, Context, Retryable, Router
from worker.core.config import UnitOfWorkConfig
from worker.core.contention import Contention
from worker.core.outcomes import Outcome
from worker.core.unit_of_work import MAX_SAVEPOINTS, Isolated, process_batch
from worker.errors import HandlerFailed, MessageFailed, Reason
from worker.faults import FAILURES_PARKED, FAILURES_RECORDED, UNIT_OF_WORK_ISOLATING
from worker.settings import Settings
from worker.telemetry import Count, dead_lettered_because
from worker.transport.topology import declare_topology

UNIT = UnitOfWorkConfig(exchange="events")
REQUESTED = "payment.requested"


def requested(payment_id: str, key: str, account: str = "alice", cents: int = 100) -> Any:
    return envelope(payments, REQUESTED, payment(payment_id, account, cents), key)


def notes_router(calls: list[Any], *, fail_on: set[int]) -> Router:
    """A plain handler that writes a note per message (Core, ORM and asyncpg alike), publishes an
    event, and raises for the bodies in ``fail_on`` after writing."""
    router = Router()

    @router.handler("note")
    async def note(body: int, ctx: Context) -> int:
        calls.append(body)
        await ctx.connection.execute(
            text("INSERT INTO accounts (account, balance_cents) VALUES (:a, :n)"),
            {"a": f"core-{body}", "n": body},
        )
        await ctx.asyncpg.execute(
            "INSERT INTO accounts (account, balance_cents) VALUES ($1, $2)", f"raw-{body}", body
        )
        await ctx.session.execute(
            text("INSERT INTO accounts (account, balance_cents) VALUES (:a, :n)"),
            {"a": f"orm-{body}", "n": body},
        )
        ctx.publish("noted", {"n": body})
        if body in fail_on:
            raise ValueError(f"note {body} is bad")
        return body

    return router


async def accounts(engine: AsyncEngine) -> set[str]:
    return {r.account for r in await rows(engine, "SELECT account FROM accounts")}


async def test_a_plain_handler_culprit_is_taken_out_and_the_rest_commit(
    engine: AsyncEngine,
) -> None:
    # Given five messages of a plain handler, the third of which fails after writing
    calls: list[Any] = []
    router = notes_router(calls, fail_on={3})
    batch = [envelope(router, "note", n, f"k{n}") for n in (1, 2, 3, 4, 5)]

    # When they are processed as one batch
    ends = await process_batch(engine, batch, UNIT)

    # Then the culprit is isolated with its error and the four others committed once, with
    # their writes through every connection and their events; the culprit left nothing behind
    assert ends[:2] == [Outcome.PROCESSED] * 2
    assert isinstance(ends[2], Isolated)
    assert str(ends[2].error) == "note 3 is bad"
    assert ends[3:] == [Outcome.PROCESSED] * 2
    assert await accounts(engine) == {
        f"{kind}-{n}" for kind in ("core", "raw", "orm") for n in (1, 2, 4, 5)
    }
    assert dict(await rows(engine, "SELECT key, status FROM inbox")) == {
        "k1": "completed",
        "k2": "completed",
        "k4": "completed",
        "k5": "completed",
    }
    assert await scalar(engine, "SELECT count(*) FROM outbox") == 4
    # one run up to the culprit, then one run of the rest: one extra run, not one per message
    assert calls == [1, 2, 3, 1, 2, 4, 5]


async def test_two_plain_culprits_are_both_taken_out(engine: AsyncEngine) -> None:
    calls: list[Any] = []
    router = notes_router(calls, fail_on={2, 4})
    batch = [envelope(router, "note", n, f"k{n}") for n in (1, 2, 3, 4, 5)]

    ends = await process_batch(engine, batch, UNIT)

    assert [isinstance(end, Isolated) for end in ends] == [False, True, False, True, False]
    assert await scalar(engine, "SELECT count(*) FROM inbox") == 3
    assert await accounts(engine) == {
        f"{kind}-{n}" for kind in ("core", "raw", "orm") for n in (1, 3, 5)
    }


async def test_a_run_again_after_a_rollback_starts_from_the_same_savepoint(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a batch whose plain handler fails on two of five messages, and the statements sent
    sent: list[str] = []
    execute = asyncpg.Connection.execute

    async def recording(self: asyncpg.Connection, query: str, *args: Any, **kwargs: Any) -> Any:
        sent.append(query)
        return await execute(self, query, *args, **kwargs)

    monkeypatch.setattr(asyncpg.Connection, "execute", recording)
    calls: list[Any] = []
    router = notes_router(calls, fail_on={2, 4})
    batch = [envelope(router, "note", n, f"k{n}") for n in (1, 2, 3, 4, 5)]

    ends = await process_batch(engine, batch, UNIT)

    # Then three runs were made from one savepoint: a rollback to it leaves it in place
    assert [isinstance(end, Isolated) for end in ends] == [False, True, False, True, False]
    assert calls == [1, 2, 1, 3, 4, 1, 3, 5]
    assert [q for q in sent if "SAVEPOINT" in q] == [
        "SAVEPOINT worker_handlers",
        "ROLLBACK TO SAVEPOINT worker_handlers",
        "ROLLBACK TO SAVEPOINT worker_handlers",
    ]
    assert await accounts(engine) == {
        f"{kind}-{n}" for kind in ("core", "raw", "orm") for n in (1, 3, 5)
    }


async def test_the_payments_handler_names_a_payment_settled_twice(engine: AsyncEngine) -> None:
    # Given a batch of payments where k-bad reuses p3's payment id under another key: the
    # payments batch handler finds it in its set-based ledger insert and names it
    batch = [requested(f"p{n}", f"k{n}", cents=n) for n in range(1, 9)]
    batch.insert(5, requested("p3", "k-bad", cents=1000))

    # When the batch is processed
    ends = await process_batch(engine, batch, UNIT)

    # Then exactly one of the two deliveries of p3 is isolated (the later in key order), the
    # other eight payments took effect once and emitted their events
    isolated = [
        (e.key, type(end.error).__name__)
        for e, end in zip(batch, ends, strict=True)
        if isinstance(end, Isolated)
    ]
    # "k-bad" sorts before "k3": it ran, and k3's p3 was the repeat
    assert isolated == [("k3", "DuplicatePayment")]
    assert sum(end is Outcome.PROCESSED for end in ends) == 8
    assert await scalar(engine, "SELECT balance_cents FROM accounts") == 1000 + sum(range(1, 9)) - 3
    assert await scalar(engine, "SELECT count(*) FROM ledger_entries") == 8
    assert await scalar(engine, "SELECT count(*) FROM outbox") == 8
    assert await scalar(engine, "SELECT count(*) FROM inbox WHERE key = 'k3'") == 0


@pytest.mark.parametrize(
    ("at_once", "runs"),
    [
        (True, [[1, 2, 3, 4, 5, 6, 7], [1, 3, 4, 5, 7]]),
        (False, [[1, 2, 3, 4, 5, 6, 7], [1, 3, 4, 5, 6, 7], [1, 3, 4, 5, 7]]),
    ],
    ids=["named-together", "named-one-by-one"],
)
async def test_a_batch_handler_that_names_its_culprits_runs_once_more_per_naming(
    engine: AsyncEngine, at_once: bool, runs: list[list[int]]
) -> None:
    router = Router()
    calls: list[list[int]] = []

    @router.batch_handler("many")
    async def many(bodies: list[int], batch: Batch) -> list[int]:
        calls.append(list(bodies))
        await batch.asyncpg.executemany(
            "INSERT INTO accounts (account, balance_cents) VALUES ($1, $2)",
            [(f"a{n}", n) for n in bodies],
        )
        bad = [index for index, body in enumerate(bodies) if body in (2, 6)]
        if bad:
            raise MessageFailed(*(bad if at_once else bad[:1])) from ValueError("bad ones")
        return bodies

    batch = [envelope(router, "many", n, f"k{n}") for n in range(1, 8)]
    ends = await process_batch(engine, batch, UNIT)

    isolated = [n for n, end in zip(range(1, 8), ends, strict=True) if isinstance(end, Isolated)]
    assert isolated == [2, 6]
    assert all(str(end.error) == "bad ones" for end in ends if isinstance(end, Isolated))
    assert calls == runs
    assert await accounts(engine) == {"a1", "a3", "a4", "a5", "a7"}


async def test_two_unnamed_culprits_in_a_batch_handler(engine: AsyncEngine) -> None:
    router = Router()

    @router.batch_handler("many")
    async def many(bodies: list[int], batch: Batch) -> None:
        await batch.asyncpg.executemany(
            "INSERT INTO accounts (account, balance_cents) VALUES ($1, $2)",
            [(f"a{n}", n) for n in bodies],
        )
        if any(n in (3, 8) for n in bodies):
            raise ValueError("a bad one is among them")

    batch = [envelope(router, "many", n, f"k{n}") for n in range(1, 11)]
    ends = await process_batch(engine, batch, UNIT)

    assert [n for n, end in zip(range(1, 11), ends, strict=True) if isinstance(end, Isolated)] == [
        3,
        8,
    ]
    assert await accounts(engine) == {f"a{n}" for n in range(1, 11)} - {"a3", "a8"}


async def test_a_culprit_and_its_duplicate_both_wait_to_run_alone(engine: AsyncEngine) -> None:
    # Given a batch holding a failing message twice (a redelivery in the same batch)
    calls: list[Any] = []
    router = notes_router(calls, fail_on={2})
    batch = [envelope(router, "note", n, f"k{n}") for n in (1, 2, 3, 2)]

    ends = await process_batch(engine, batch, UNIT)

    # Then neither copy is called a duplicate of an effect that never committed: both run alone
    assert [type(end).__name__ for end in ends] == ["Outcome", "Isolated", "Outcome", "Isolated"]
    assert await scalar(engine, "SELECT count(*) FROM inbox WHERE key = 'k2'") == 0


async def test_a_transient_culprit_is_isolated_too(engine: AsyncEngine) -> None:
    router = Router()

    @router.handler("flaky")
    async def flaky(body: int, ctx: Context) -> None:
        if body == 2:
            raise Retryable("the service is down")

    batch = [envelope(router, "flaky", n, f"k{n}") for n in (1, 2, 3)]
    ends = await process_batch(engine, batch, UNIT)

    assert isinstance(ends[1], Isolated)
    assert isinstance(ends[1].error, Retryable)
    assert ends[0] is ends[2] is Outcome.PROCESSED


async def test_too_many_failures_fail_the_whole_batch(engine: AsyncEngine) -> None:
    # Given a batch handler that fails for every message: bisection would need a savepoint per
    # call, more than one transaction should hold
    router = Router()

    @router.batch_handler("broken")
    async def broken(bodies: list[int], batch: Batch) -> None:
        await batch.asyncpg.execute("INSERT INTO accounts (account, balance_cents) VALUES ('x', 1)")
        raise ValueError("always")

    batch = [envelope(router, "broken", n, f"k{n}") for n in range(MAX_SAVEPOINTS)]

    # Then the batch fails as a whole (its messages then run one per transaction), and nothing
    # of it committed
    with pytest.raises(HandlerFailed, match="gave up taking failing messages out"):
        await process_batch(engine, batch, UNIT)
    assert await scalar(engine, "SELECT count(*) FROM inbox") == 0
    assert await scalar(engine, "SELECT count(*) FROM accounts") == 0


async def test_framework_statements_and_every_handler_connection_share_one_transaction(
    engine: AsyncEngine,
) -> None:
    # Given a handler that reads, through each of its three connections, the transaction id and
    # its own key's inbox row: the claim, uncommitted, visible only inside the claiming transaction
    # (written completed already: nobody outside sees it before the commit)
    router = Router()
    seen: list[Any] = []

    @router.handler("xid")
    async def xid(body: int, ctx: Context) -> None:
        query = "SELECT pg_current_xact_id()::text, status FROM inbox WHERE key = :key"
        seen.append(tuple((await ctx.connection.execute(text(query), {"key": ctx.key})).one()))
        seen.append(tuple((await ctx.session.execute(text(query), {"key": ctx.key})).one()))
        raw = query.replace(":key", "$1")
        seen.append(tuple(await ctx.asyncpg.fetchrow(raw, ctx.key)))
        ctx.publish("xid.seen", {"n": body})

    # When two messages run in a batch (a savepoint before the handlers) and one alone
    await process_batch(engine, [envelope(router, "xid", n, f"k{n}") for n in (1, 2)], UNIT)
    await process_batch(engine, [envelope(router, "xid", 3, "k3")], UNIT)

    # Then each handler saw its claim in progress, and one transaction id per unit of work
    assert [status for _, status in seen] == ["completed"] * 9
    batch_xids = {xid for xid, _ in seen[:6]}
    alone_xids = {xid for xid, _ in seen[6:]}
    assert len(batch_xids) == len(alone_xids) == 1
    assert batch_xids != alone_xids
    # and, the handler returning nothing, the claim was its key's only write (no second version)
    versions = await rows(engine, "SELECT key, xmin::text, result FROM inbox ORDER BY key")
    assert versions == [
        ("k1", *batch_xids, None),
        ("k2", *batch_xids, None),
        ("k3", *alone_xids, None),
    ]
    assert await scalar(engine, "SELECT count(*) FROM outbox") == 3


async def test_a_crash_mid_isolation_acks_nothing_and_the_restart_applies_each_once(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection, tmp_path: Path
) -> None:
    # Given 30 payments queued, one of which (k-bad) reuses p4's payment id, and a worker that
    # dies right after its first rollback to a savepoint
    sends = [(f"k{i}", payment(f"p{i}", f"acct-{i % 3}", i + 1)) for i in range(30)]
    sends.insert(10, ("k-bad", payment("p4", "acct-1", 1000)))
    await publish_all(amqp, settings, sends)
    log = tmp_path / "worker.log"
    env = {
        "WORKER_HANDLERS": "examples.payments",
        "WORKER_BATCH_SIZE": "40",
        "WORKER_RELAY": "false",
    }
    with worker_process(settings, log, WORKER_CRASH_AT=UNIT_OF_WORK_ISOLATING, **env) as dying:
        returncode = await asyncio.to_thread(dying.wait, 30)
    assert returncode == -signal.SIGKILL

    # Then the batch that was isolating committed nothing and acked nothing (a batch beside it
    # may have committed, its messages acked or not): every message is committed or queued
    committed = await scalar(engine, "SELECT count(*) FROM inbox")
    assert committed < 31
    assert committed + await broker_depth(settings.queue) >= 31

    # When a healthy worker runs
    with worker_process(settings, log, **env) as worker:
        await wait_for_consumer(amqp, settings.queue)

        async def done() -> bool:
            return await broker_depth(settings.dead_letter_queue) == 1 and (
                await scalar(engine, "SELECT count(*) FROM ledger_entries") == 30
            )

        await wait_until(done)
        worker.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(worker.wait, 30) == 0

    # Then each payment took effect once, one of p4's two deliveries was parked once
    assert await scalar(engine, "SELECT sum(balance_cents) FROM accounts") in (
        sum(range(1, 31)),  # k4's p4 ran, k-bad parked
        sum(range(1, 31)) - 5 + 1000,  # k-bad's p4 ran, k4 parked
    )
    assert await scalar(engine, "SELECT count(*) FROM inbox WHERE status = 'failed'") == 1
    assert await broker_depth(settings.queue) == 0
    assert await broker_depth(settings.dead_letter_queue) == 1


class CountingContention(Contention):
    """A process's contention registry that counts the deadlocks it was told of."""

    def __init__(self) -> None:
        super().__init__()
        self.deadlocks = 0

    def deadlocked(self, handler: str) -> None:
        self.deadlocks += 1
        super().deadlocked(handler)


async def test_batches_that_deadlock_on_shared_rows_take_turns_after_the_first_deadlock(
    engine: AsyncEngine,
) -> None:
    # Given a plain handler that adds 1 to an account's balance, and two batches that touch
    # accounts x and y in opposite orders (the first time, each batch's first message waits
    # until both have written, so that they are sure to deadlock)
    router = Router()
    meeting: asyncio.Barrier | None = asyncio.Barrier(2)

    @router.handler("touch")
    async def touch(account: str, ctx: Context) -> None:
        nonlocal meeting
        await ctx.asyncpg.execute(
            "UPDATE accounts SET balance_cents = balance_cents + 1 WHERE account = $1", account
        )
        if meeting is not None and ctx.key.endswith("0"):
            await asyncio.wait_for(meeting.wait(), 10)
            meeting = None

    async with engine.begin() as conn:
        await conn.execute(text("INSERT INTO accounts VALUES ('x', 0), ('y', 0)"))
    contention = CountingContention()
    unit = UnitOfWorkConfig(exchange="events", contention=contention)

    async def both(round_: int) -> list[Any]:
        first = [envelope(router, "touch", a, f"r{round_}-a{i}") for i, a in enumerate("xy")]
        second = [envelope(router, "touch", a, f"r{round_}-b{i}") for i, a in enumerate("yx")]
        ends = await asyncio.gather(
            process_batch(engine, first, unit), process_batch(engine, second, unit)
        )
        return [end for batch_ends in ends for end in batch_ends]

    # When they run at once: they deadlock, and the loser runs its group again in turn
    assert await both(1) == [Outcome.PROCESSED] * 4
    assert contention.deadlocks == 1
    assert contention.contended("touch")

    # Then the next two such batches take turns and do not deadlock; nothing was lost or doubled
    assert await both(2) == [Outcome.PROCESSED] * 4
    assert contention.deadlocks == 1
    balances = dict(await rows(engine, "SELECT account, balance_cents FROM accounts"))
    assert balances == {"x": 4, "y": 4}


async def test_culprits_parked_beside_their_batchs_successes_do_not_slow_the_worker_down(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given 60 payments queued, every fourth of them a payment settled before under another key
    # (15 culprits), and a worker that slows down after 5 dead letters in a row
    sends = []
    for i in range(45):
        sends.append((f"k{i}", payment(f"p{i}", f"acct-{i % 3}", 10)))
        if i % 3 == 2:
            sends.append((f"k{i}-again", payment(f"p{i}", f"acct-{i % 3}", 10)))
    await publish_all(amqp, settings, sends)
    fast = settings.replace(batch_size=60, failure_throttle_after=5, relay=False)

    # When it drains them
    async with running_worker(fast, payments) as worker:

        async def drained() -> bool:
            return worker.stats[Count.PROCESSED] + worker.stats[Count.DEAD_LETTERED] >= 60

        await wait_until(drained)

    # Then each culprit was parked once, and being taken out of batches whose others committed,
    # the culprits never counted as dead letters in a row
    assert worker.stats[Count.PROCESSED] == 45
    assert worker.stats[dead_lettered_because(Reason.HANDLER_ERROR)] == 15
    assert worker.stats[Count.THROTTLED] == 0
    assert await broker_depth(settings.dead_letter_queue) == 15


async def test_a_culprit_that_failed_for_good_is_parked_without_running_again(
    settings: Settings, amqp: AbstractRobustConnection
) -> None:
    # Given a plain handler that fails for good on odd numbers, and 40 messages queued
    router = Router()
    calls: dict[int, int] = {}

    @router.handler("numbers")
    async def numbers(n: int, ctx: Context) -> None:
        calls[n] = calls.get(n, 0) + 1
        if n % 2:
            raise ValueError(f"{n} is odd")

    channel = await amqp.channel(publisher_confirms=True)
    await declare_topology(channel, settings, router.routing_keys())
    exchange = await channel.get_exchange(settings.exchange)
    for n in range(40):
        await exchange.publish(
            Message(str(n).encode(), headers={"idempotency-key": f"n{n}"}), routing_key="numbers"
        )
    await channel.close()

    # When a worker drains them in batches
    async with running_worker(settings.replace(batch_size=40, relay=False), router) as worker:

        async def drained() -> bool:
            return worker.stats[Count.PROCESSED] + worker.stats[Count.DEAD_LETTERED] >= 40

        await wait_until(drained)

    # Then each odd one was parked once, its handler called once: taken out of its batch, it
    # took its failure path at once instead of failing again in a transaction of its own
    assert worker.stats[Count.PROCESSED] == 20
    assert worker.stats[dead_lettered_because(Reason.HANDLER_ERROR)] == 20
    assert {n: calls[n] for n in range(1, 40, 2)} == dict.fromkeys(range(1, 40, 2), 1)
    assert await broker_depth(settings.dead_letter_queue) == 20


def payments_with_culprits() -> list[tuple[str, dict[str, Any]]]:
    """30 payments, four of them sent again under a second key after them (the ledger refuses
    the second: k<n>-again is the culprit), one of those twice, and k5 reused for another
    payment."""
    sends = [(f"k{i}", payment(f"p{i}", f"acct-{i % 3}", i + 1)) for i in range(30)]
    for i in (21, 13, 8, 3):
        sends.insert(i + 5, (f"k{i}-again", payment(f"p{i}", f"acct-{i % 3}", i + 1)))
    sends.insert(20, ("k8-again", payment("p8", "acct-2", 9)))
    sends.insert(25, ("k5", payment("p99", "acct-0", 99)))
    return sends


CULPRITS = ["k13-again", "k21-again", "k3-again", "k8-again"]


async def parked_ids(amqp: AbstractRobustConnection, settings: Settings) -> list[tuple[str, str]]:
    """(message id, reason) of each copy in the dead-letter queue, sorted (drains it)."""
    channel = await amqp.channel()
    try:
        parked = await dead_letters(channel, settings)
    finally:
        await channel.close()
    return sorted((str(m.message_id), str(m.headers["x-worker-reason"])) for m in parked)


async def assert_payments_applied_once(engine: AsyncEngine) -> None:
    assert await scalar(engine, "SELECT count(*) FROM ledger_entries") == 30
    assert await scalar(engine, "SELECT sum(balance_cents) FROM accounts") == sum(range(1, 31))
    failed = await rows(engine, "SELECT key FROM inbox WHERE status = 'failed' ORDER BY key")
    assert [r.key for r in failed] == CULPRITS
    assert await scalar(engine, "SELECT status FROM inbox WHERE key = 'k5'") == "completed"


async def test_the_culprits_of_a_batch_are_parked_together_each_once(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given 30 payments queued with four culprits (one sent twice) and a reused key among them
    sends = payments_with_culprits()
    await publish_all(amqp, settings, sends)

    # When one consumer task drains them in batches of up to 40
    wide = settings.replace(batch_size=40, prefetch=100, concurrency=1, relay=False)
    async with running_worker(wide, payments) as worker:

        async def drained() -> bool:
            return sum(
                worker.stats[s]
                for s in (Count.PROCESSED, Count.DEAD_LETTERED, Count.DUPLICATE_OF_FAILED)
            ) >= len(sends)

        await wait_until(drained)

    # Then each culprit and the reused key were parked once and counted once, each culprit's
    # key is recorded failed, the second copy of k8-again ended as a duplicate of that failure,
    # and every payment took effect once
    assert await parked_ids(amqp, settings) == sorted(
        [*((key, "handler-error") for key in CULPRITS), ("k5", "key-reused")]
    )
    assert worker.stats[Count.PROCESSED] == 30
    assert worker.stats[Count.DEAD_LETTERED] == 5
    assert worker.stats[dead_lettered_because(Reason.HANDLER_ERROR)] == 4
    assert worker.stats[dead_lettered_because(Reason.KEY_REUSED)] == 1
    assert worker.stats[Count.DUPLICATE_OF_FAILED] == 1
    assert worker.stats[Count.REQUEUED] == 0
    await assert_payments_applied_once(engine)
    assert await broker_depth(settings.queue) == 0


@pytest.mark.parametrize(
    ("crash_at", "parked_at_most"),
    [
        # the copies are confirmed, their keys not recorded: a redelivery is parked again
        pytest.param(FAILURES_PARKED, 2, id="copies-confirmed"),
        # the keys are recorded too: a redelivery is a duplicate of a failed key, acked
        pytest.param(FAILURES_RECORDED, 1, id="failures-recorded"),
    ],
)
async def test_a_crash_while_parking_loses_nothing_and_records_no_failure_without_its_copy(
    settings: Settings,
    engine: AsyncEngine,
    amqp: AbstractRobustConnection,
    tmp_path: Path,
    crash_at: str,
    parked_at_most: int,
) -> None:
    # Given the payments and culprits queued, and a worker that dies at its first parking
    await publish_all(amqp, settings, payments_with_culprits())
    log = tmp_path / "worker.log"
    env = {
        "WORKER_HANDLERS": "examples.payments",
        "WORKER_BATCH_SIZE": "40",
        "WORKER_PREFETCH": "100",
        "WORKER_CONCURRENCY": "1",
        "WORKER_RELAY": "false",
    }
    with worker_process(settings, log, WORKER_CRASH_AT=crash_at, **env) as dying:
        returncode = await asyncio.to_thread(dying.wait, 30)
    assert returncode == -signal.SIGKILL

    # Then every key recorded failed has its copy parked
    failed = await rows(engine, "SELECT key FROM inbox WHERE status = 'failed'")
    parked_before = await parked_ids(amqp, settings)
    assert parked_before
    assert {r.key for r in failed} <= {key for key, _ in parked_before}

    # When a healthy worker runs
    with worker_process(settings, log, **env) as worker:
        await wait_for_consumer(amqp, settings.queue)

        async def done() -> bool:
            return await broker_depth(settings.queue) == 0 and (
                await scalar(engine, "SELECT count(*) FROM inbox WHERE status = 'failed'") == 4
            )

        await wait_until(done)
        worker.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(worker.wait, 30) == 0

    # Then every payment took effect once, each culprit and the reused key are parked (at most
    # twice, and only if the crash left them parked and unacked), nothing else is. A reused key
    # is never recorded (its key belongs to the payment that committed), so whenever the crash
    # came before its ack, which may be held for a multiple-ack with the culprits', its
    # redelivery is parked again, whatever the crash point
    await assert_payments_applied_once(engine)
    parked = Counter(parked_before + await parked_ids(amqp, settings))
    assert set(parked) == {*((key, "handler-error") for key in CULPRITS), ("k5", "key-reused")}
    reused = parked.pop(("k5", "key-reused"))
    assert 1 <= reused <= 2
    assert all(1 <= count <= parked_at_most for count in parked.values()), parked
    assert await broker_depth(settings.queue) == 0
