"""Failure semantics against the real PostgreSQL and RabbitMQ: transient failures retried in
process and then through the delayed-retry queues, permanent ones parked with a failed key, DLQ
list and replay, and fail-closed behaviour while PostgreSQL is unreachable."""

from __future__ import annotations

import asyncio
import shutil
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

import aio_pika
import asyncpg
import pytest
from aio_pika.abc import AbstractChannel, AbstractRobustConnection
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.payments import router as payments
from tests.helpers import (
    WORKER_SCRIPT,
    broker_depth,
    payment,
    rows,
    run,
    scalar,
    wait_until,
    worker_environ,
)
from tests.integration.support import (
    RunningWorker,
    dead_letters,
    inbox,
    publish,
    queue_empty,
    ready_messages,
    running_worker,
    settled,
)
from tests.integration.tcp_proxy import tcp_proxy
from worker import Context, Permanent, Retryable, Router
from worker.errors import is_transient
from worker.ops import dlq
from worker.settings import Settings
from worker.sql.inbox import record_failures
from worker.sql.rows import MAX_ATTEMPTS, KeyClaim
from worker.telemetry import Count

ROUTING_KEY = "flaky.job"


class Script:
    """What the test handler does on each call, and what it saw."""

    def __init__(self, *plan: str) -> None:
        self.plan = list(plan)
        self.calls: list[dict[str, Any]] = []

    def next(self) -> str:
        return self.plan.pop(0) if self.plan else "ok"


def scripted_router(script: Script) -> Router:
    """A handler that writes a ledger row and then does what the script says next."""
    router = Router()

    @router.handler(ROUTING_KEY)
    async def flaky_job(body: dict[str, Any], ctx: Context) -> dict[str, Any]:
        script.calls.append(
            {"attempt": ctx.attempt, "headers": dict(ctx.envelope.delivery.headers)}
        )
        await ctx.connection.execute(
            text("INSERT INTO job_effects (key) VALUES (:key)"), {"key": ctx.key}
        )
        action = script.next()
        if action == "retryable":
            raise Retryable("the payment provider is busy")
        if action == "serialization":  # a real SQLSTATE 40001 from the server
            await ctx.connection.execute(
                text("DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = '40001'; END $$")
            )
        if action == "terminate":  # the server ends this very connection
            await ctx.connection.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))
        if action == "permanent":
            raise Permanent("card declined")
        if action == "bug":
            raise KeyError("account")
        return {"done": body["n"]}

    return router


@pytest.fixture(autouse=True)
async def job_effects(engine: AsyncEngine) -> None:
    """The scripted handler's business table (unique key: a second effect would fail loudly)."""
    async with engine.begin() as conn:
        await conn.execute(text("CREATE TABLE IF NOT EXISTS job_effects (key text PRIMARY KEY)"))
        await conn.execute(text("TRUNCATE job_effects"))


async def effects(engine: AsyncEngine) -> int:
    return int(await scalar(engine, "SELECT count(*) FROM job_effects"))


async def send_job(channel: AbstractChannel, settings: Settings, key: str, n: int = 1) -> None:
    await publish(channel, settings, {"n": n}, key=key, routing_key=ROUTING_KEY)


async def park_one_by_one(
    channel: AbstractChannel, settings: Settings, worker: RunningWorker, keys: list[str]
) -> None:
    """Send a job per key, each after the previous one was parked by the script's "bug": the
    script counts handler calls, and a batch that fails runs its handlers again one by one."""
    for parked, key in enumerate(keys, start=1):
        await send_job(channel, settings, key, n=parked)
        await settled(worker, dead_lettered=parked)


async def test_a_transient_database_error_is_retried_in_process(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given a handler whose first try hits a serialization failure and whose second loses its
    # connection to the server
    script = Script("serialization", "terminate")
    async with running_worker(settings, scripted_router(script)) as worker:
        channel = await amqp.channel(publisher_confirms=True)
        await send_job(channel, settings, "k-inline")
        await settled(worker, processed=1)

    # Then the third try, in the same delivery, applied the effect once
    assert [call["attempt"] for call in script.calls] == [1, 1, 1]
    assert await effects(engine) == 1
    assert worker.stats[Count.RETRY_SCHEDULED] == 0
    assert worker.stats[Count.DEAD_LETTERED] == 0
    assert (await inbox(engine, "k-inline")).status == "completed"


async def test_a_handler_failing_twice_succeeds_through_the_delayed_retries(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given one try per delivery and delayed retries after 0.1 s and 0.2 s
    settings = settings.replace(transient_attempts=1)
    script = Script("retryable", "retryable")
    async with running_worker(settings, scripted_router(script)) as worker:
        channel = await amqp.channel(publisher_confirms=True)
        await send_job(channel, settings, "k-delayed")
        await settled(worker, processed=1)

    # Then the third delivery succeeded, each retry carrying its attempt count
    assert [call["attempt"] for call in script.calls] == [1, 2, 3]
    assert [call["headers"].get("x-worker-attempts") for call in script.calls] == [None, 1, 2]
    first_failure = script.calls[1]["headers"]["x-worker-first-failure-at"]
    assert script.calls[2]["headers"]["x-worker-first-failure-at"] == first_failure
    assert worker.stats[Count.RETRY_SCHEDULED] == 2
    assert await effects(engine) == 1
    assert await dead_letters(channel, settings) == []
    for delay in settings.retry_delays:
        assert await ready_messages(channel, settings.retry_queue(delay)) == 0


async def test_a_message_still_failing_after_the_last_retry_is_dead_lettered(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    settings = settings.replace(transient_attempts=2)
    script = Script(*["retryable"] * 6)
    async with running_worker(settings, scripted_router(script)) as worker:
        channel = await amqp.channel(publisher_confirms=True)
        await send_job(channel, settings, "k-exhausted")
        await settled(worker, dead_lettered=1)

    # 3 deliveries (the first and two delayed retries), each tried twice in process
    assert len(script.calls) == 6
    [parked] = await dead_letters(channel, settings)
    assert parked.headers["x-worker-reason"] == "retries-exhausted"
    assert parked.headers["x-worker-attempts"] == 3
    assert parked.headers["x-worker-exception-type"] == "Retryable"
    assert parked.headers["x-worker-original-routing-key"] == ROUTING_KEY
    failed = await inbox(engine, "k-exhausted")
    assert (failed.status, failed.attempts) == ("failed", 3)
    assert "the payment provider is busy" in failed.error
    assert await effects(engine) == 0


@pytest.mark.parametrize(
    ("action", "exception_type"), [("permanent", "Permanent"), ("bug", "KeyError")]
)
async def test_a_permanent_error_is_parked_at_once_and_its_key_recorded_as_failed(
    settings: Settings,
    engine: AsyncEngine,
    amqp: AbstractRobustConnection,
    action: str,
    exception_type: str,
) -> None:
    script = Script(action)
    before = datetime.now().astimezone()
    async with running_worker(settings, scripted_router(script)) as worker:
        channel = await amqp.channel(publisher_confirms=True)
        await send_job(channel, settings, "k-permanent")
        await settled(worker, dead_lettered=1)

        # When the same message comes again
        await send_job(channel, settings, "k-permanent")
        await settled(worker, duplicate_of_failed=1)

    # Then it was acked without running the handler again
    assert len(script.calls) == 1
    assert worker.stats[Count.RETRY_SCHEDULED] == 0
    assert await effects(engine) == 0  # the business write rolled back
    [parked] = await dead_letters(channel, settings)
    headers = parked.headers
    assert headers["x-worker-reason"] == "handler-error"
    assert headers["x-worker-exception-type"] == exception_type
    assert headers["x-worker-attempts"] == 1
    assert headers["x-worker-handler"] == ROUTING_KEY
    assert headers["x-worker-original-routing-key"] == ROUTING_KEY
    assert datetime.fromisoformat(str(headers["x-worker-first-failure-at"])) >= before
    assert parked.body == b'{"n": 1}'
    failed = await inbox(engine, "k-permanent")
    assert failed.status == "failed"
    assert exception_type in failed.error


async def test_dlq_list_shows_the_parked_messages_and_replay_runs_each_once(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given two messages parked by a bug in their handler
    script = Script("bug", "bug")
    async with running_worker(settings, scripted_router(script)) as worker:
        channel = await amqp.channel(publisher_confirms=True)
        await park_one_by_one(channel, settings, worker, ["k-a", "k-b"])

        # When the operator lists them
        listed = await dlq.list_parked(amqp, engine, settings)
        assert sorted((p.key, p.reason, p.handler, p.attempts) for p in listed) == [
            ("k-a", "handler-error", ROUTING_KEY, 1),
            ("k-b", "handler-error", ROUTING_KEY, 1),
        ]
        assert all("KeyError" in p.error for p in listed)
        assert len(await dlq.list_parked(amqp, engine, settings)) == 2  # listing left them parked

        # and, the bug fixed, replays one of them by key
        replayed = await dlq.replay(amqp, engine, settings, key="k-b")
        assert [p.key for p in replayed] == ["k-b"]
        await settled(worker, processed=1)

        # and then the rest
        assert [p.key for p in await dlq.replay(amqp, engine, settings)] == ["k-a"]
        await settled(worker, processed=2)
        assert await dlq.replay(amqp, engine, settings) == []

    # Then each ran once more, succeeded, and nothing is parked
    assert len(script.calls) == 4
    assert [call["attempt"] for call in script.calls[2:]] == [1, 1]  # a replay starts afresh
    assert await effects(engine) == 2
    assert (await inbox(engine, "k-a")).status == "completed"
    assert (await inbox(engine, "k-b")).status == "completed"
    assert await dead_letters(channel, settings) == []


async def test_a_replay_copy_sent_twice_runs_once(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given a parked message replayed, and a second copy of it parked again (a crash between
    # parking and acking parks a message twice)
    script = Script("bug")
    async with running_worker(settings, scripted_router(script)) as worker:
        channel = await amqp.channel(publisher_confirms=True)
        await send_job(channel, settings, "k-twice")
        await settled(worker, dead_lettered=1)
        await send_job(channel, settings, "k-twice")
        await settled(worker, duplicate_of_failed=1)
        [parked] = await dead_letters(channel, settings)  # (taken off the DLQ)
        dead_letter_exchange = await channel.get_exchange(settings.dead_letter_exchange)
        for _ in range(2):
            await dead_letter_exchange.publish(
                aio_pika.Message(
                    parked.body,
                    headers=parked.headers,
                    message_id=parked.message_id,
                    content_type=parked.content_type,
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                ),
                routing_key=ROUTING_KEY,
            )

        # When they are replayed: the first copy is the worker's, the second is flagged as a
        # second copy of that parking and left, until an operator forces it
        [first] = await dlq.replay(amqp, engine, settings)
        assert first.verified
        assert first.parking_id == dlq.parking_id_of(parked)
        await settled(worker, processed=1)
        [second] = await dlq.list_parked(amqp, engine, settings)
        assert not second.verified
        assert (second.unverified_because or "").startswith(
            f"a copy of parking {first.parking_id}, replayed at "
        )
        assert len(await dlq.replay(amqp, engine, settings, force=True)) == 1
        await settled(worker, processed=1, duplicate=1)

    # Then the effect was applied once
    assert await effects(engine) == 1
    assert len(script.calls) == 2


@pytest.mark.skipif(shutil.which("rabbitmqctl") is None, reason="needs rabbitmqctl")
async def test_the_worker_pauses_while_postgresql_is_unreachable_and_loses_nothing(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    url = urlsplit(settings.database_url)
    async with tcp_proxy(url.hostname or "127.0.0.1", url.port or 5432) as proxy:
        through_proxy = url._replace(netloc=f"{url.username}@127.0.0.1:{proxy.port}").geturl()
        worker_settings = settings.replace(database_url=through_proxy, relay=False)
        async with running_worker(worker_settings, payments) as worker:
            channel = await amqp.channel(publisher_confirms=True)
            await publish(channel, settings, payment("before", "erin", 1), key="before")
            await settled(worker, processed=1)

            # When PostgreSQL becomes unreachable and 20 payments arrive
            await proxy.down()
            for i in range(20):
                await publish(channel, settings, payment(f"p{i}", "erin", 10), key=f"p{i}")
            await settled(worker, paused=1)

            # Then nothing is acked, retried or parked: every payment waits in the queue
            async def all_returned() -> bool:
                return await broker_depth(settings.queue) == 20

            await wait_until(all_returned)
            assert worker.stats[Count.PROCESSED] == 1
            assert worker.stats[Count.RETRY_SCHEDULED] == worker.stats[Count.DEAD_LETTERED] == 0

            # When PostgreSQL is back, each payment is applied once
            await proxy.up()
            await settled(worker, processed=21)
            await wait_until(lambda: queue_empty(channel, settings.queue))

    assert await scalar(engine, "SELECT balance_cents FROM accounts WHERE account='erin'") == 201
    assert await scalar(engine, "SELECT count(*) FROM inbox WHERE status='completed'") == 21
    assert worker.stats[Count.DEAD_LETTERED] == 0
    assert await dead_letters(channel, settings) == []


async def test_connections_terminated_mid_run_lose_nothing_and_apply_each_once(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given units of work in flight, each waiting on a lock the test holds
    blocker = await asyncpg.connect(settings.database_url)
    gate = 7_300_001
    await blocker.execute("SELECT pg_advisory_lock($1)", gate)
    router = Router()

    @router.handler(ROUTING_KEY)
    async def gated(body: dict[str, Any], ctx: Context) -> None:
        await ctx.connection.execute(text("SELECT pg_advisory_xact_lock_shared(:g)"), {"g": gate})
        await ctx.connection.execute(
            text("INSERT INTO job_effects (key) VALUES (:key)"), {"key": ctx.key}
        )

    worker_settings = settings.replace(relay=False)
    try:
        async with running_worker(worker_settings, router) as worker:
            channel = await amqp.channel(publisher_confirms=True)
            for i in range(8):
                await send_job(channel, settings, f"t{i}")

            async def waiting_on_the_gate() -> bool:
                return bool(
                    await scalar(
                        engine,
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                        "AND query LIKE '%pg_advisory_xact_lock_shared%'",
                    )
                )

            await wait_until(waiting_on_the_gate)

            # When every connection of the worker is terminated, and the lock then released
            terminated = await blocker.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name = 'worker' AND datname = current_database()"
            )
            assert terminated >= 1
            await blocker.execute("SELECT pg_advisory_unlock($1)", gate)
            await settled(worker, processed=8)
    finally:
        await blocker.close()
    # Then every message was applied once and nothing was parked
    assert await effects(engine) == 8
    assert worker.stats[Count.DEAD_LETTERED] == 0
    assert worker.stats[Count.DUPLICATE] == 0
    assert await dead_letters(channel, settings) == []


def test_permanent_wins_over_a_transient_cause() -> None:
    permanent = Permanent("no such account")
    permanent.__cause__ = ConnectionError("timed out")
    assert not is_transient(permanent)
    assert is_transient(Retryable())


async def test_worker_dlq_list_and_replay_from_the_command_line(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    script = Script("bug", "bug")
    env = worker_environ(settings)
    async with running_worker(settings, scripted_router(script)) as worker:
        channel = await amqp.channel(publisher_confirms=True)
        await park_one_by_one(channel, settings, worker, ["k-cli-1", "k-cli-2"])

        listed = await asyncio.to_thread(run, WORKER_SCRIPT, "dlq", "list", **env)
        assert listed.returncode == 0, listed.stderr
        assert "key=k-cli-1 handler=flaky.job reason=handler-error attempts=1" in listed.stdout
        assert "key=k-cli-2" in listed.stdout
        assert "KeyError" in listed.stdout
        assert "2 parked message(s)" in listed.stdout
        first = await asyncio.to_thread(run, WORKER_SCRIPT, "dlq", "list", "--limit", "1", **env)
        assert "1 parked message(s)" in first.stdout

        replayed = await asyncio.to_thread(
            run, WORKER_SCRIPT, "dlq", "replay", "--key", "k-cli-2", **env
        )
        assert replayed.returncode == 0, replayed.stderr
        assert "1 message(s) sent back" in replayed.stdout
        await settled(worker, processed=1)

    assert (await inbox(engine, "k-cli-2")).status == "completed"
    assert (await inbox(engine, "k-cli-1")).status == "failed"
    assert [p.key for p in await dlq.list_parked(amqp, engine, settings)] == ["k-cli-1"]


async def test_failed_keys_are_recorded_in_one_statement_never_over_a_completed_effect(
    engine: AsyncEngine,
) -> None:
    # Given a completed key, a key recorded failed once before (2 attempts), and a new key
    def claim(key: str) -> KeyClaim:
        return KeyClaim(ROUTING_KEY, key, b"fingerprint", f"m-{key}", ROUTING_KEY)

    async with engine.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO inbox (handler, key, fingerprint, status, attempts, routing_key) "
                "VALUES (:h, 'k-done', 'x', 'completed', 1, :h), "
                "(:h, 'k-again', 'x', 'failed', 2, :h)"
            ),
            {"h": ROUTING_KEY},
        )

    # When the three are recorded as failed together, the new one given twice
    async with engine.begin() as conn:
        await record_failures(
            conn,
            [
                (claim("k-new"), "first error", 1),
                (claim("k-done"), "too late", 1),
                (claim("k-again"), "failed again", MAX_ATTEMPTS),
                (claim("k-new"), "last error", 1),
            ],
        )

    # Then the completed effect stands, the others are failed once each, attempts added up to
    # the cap, and a key given twice holds its last error
    recorded = await rows(
        engine,
        "SELECT key, status, error, attempts, message_id FROM inbox WHERE handler = :h "
        "ORDER BY key",
        h=ROUTING_KEY,
    )
    assert [tuple(row) for row in recorded] == [
        ("k-again", "failed", "failed again", MAX_ATTEMPTS, None),
        ("k-done", "completed", None, 1, None),
        ("k-new", "failed", "last error", 1, "m-k-new"),
    ]
