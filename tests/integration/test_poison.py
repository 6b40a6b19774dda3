"""Poison against the real PostgreSQL and RabbitMQ: every delivery ends in exactly one place,
once, whatever it holds, and the worker keeps running.

Each trigger here once crashed the consumer, sent a delivery round the DLQ forever, or parked a
whole stream for a deployment mistake. For each: the worker is alive, the delivery is parked
once with its reason (or, for a deployment fault, nothing is parked and it is applied once the
fault is fixed), the work queue is empty, the DLQ stays as it is, and good messages around it are
applied once.
"""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from aio_pika.abc import AbstractRobustConnection
from pydantic import BaseModel, field_validator
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from examples.payments import router as payments
from tests.helpers import broker_depth, payment, rows, scalar, wait_until
from tests.integration.support import RunningWorker, dead_letters, publish, running_worker
from worker import Context, Router, schema
from worker.errors import ConfigurationError, Reason
from worker.ops import runner
from worker.settings import Settings
from worker.sql.rows import MAX_ATTEMPTS
from worker.telemetry import Count, dead_lettered_because
from worker.testing import empty_database

QUIET = 3.0
"""Seconds during which nothing may move once a trigger has settled: a cycle would show."""


@dataclass(frozen=True)
class Trigger:
    name: str
    body: Any
    reason: str
    routing_key: str = "payment.requested"
    message_id: str | None = None
    headers: dict[str, Any] | None = None


def nested(depth: int) -> bytes:
    """A payment nested ``depth`` levels deep: json.loads reads it, json.dumps recursed out."""
    return b'{"a":' * depth + json.dumps(payment("deep")).encode() + b"}" * depth


def wide(names: int) -> bytes:
    """A valid payment holding ``names`` names more: 80,000 took a core most of a second."""
    return json.dumps(payment("wide") | {f"k{i:05d}": 1 for i in range(names)}).encode()


TRIGGERS = [
    Trigger("a body nested 1000 levels deep", nested(1000), "body-too-deep"),
    Trigger("a body of 80,000 names", wide(80_000), "body-too-large"),
    Trigger(
        "a NUL in the message_id beside a valid key",
        payment("nul-id"),
        "invalid-property",
        message_id="id\x00with-nul",
    ),
    Trigger("an amount beyond int64", payment("huge", amount_cents=2**63), "invalid"),
    Trigger("a NUL in the account", payment("nul-account", account="a\x00b"), "invalid"),
    Trigger(
        "a handler error quoting a NUL byte", {"text": "bad\x00value"}, "handler-error", "quote"
    ),
    Trigger(
        "a forged attempt count of 2**40 on a handler error",
        {"text": "plain"},
        "handler-error",
        "quote",
        headers={"x-worker-attempts": 2**40},
    ),
]


class Touchy(BaseModel):
    """A body model whose validator fails in a way no check expects."""

    n: int

    @field_validator("n")
    @classmethod
    def explode(cls, value: int) -> int:
        raise RecursionError("a validator recursed out of stack")


def quoting_router() -> Router:
    """The payments handlers, and one that fails quoting its input (NUL bytes included)."""
    router = Router()

    @router.handler("quote")
    async def quote(body: dict[str, Any], ctx: Context) -> None:
        raise ValueError(f"cannot handle {body['text']}")

    router.include(payments)
    return router


async def stays_quiet(worker: RunningWorker, settings: Settings) -> None:
    """Nothing moves for ``QUIET`` seconds: no delivery is handled, parked or requeued again.

    (The relay's own counts are left out: it counts an event after its delete commits, which
    may be after the event was consumed and handled.)"""

    def deliveries() -> Counter[str]:
        return Counter({k: n for k, n in worker.stats.items() if not k.startswith("relay_")})

    before = (deliveries(), await broker_depth(settings.dead_letter_queue))
    await asyncio.sleep(QUIET)
    after = (deliveries(), await broker_depth(settings.dead_letter_queue))
    assert after == before, f"{before} became {after}"
    assert not worker.task.done(), "the worker stopped"


@pytest.mark.parametrize("trigger", TRIGGERS, ids=[t.name for t in TRIGGERS])
async def test_a_poison_message_is_parked_once_and_the_worker_keeps_going(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection, trigger: Trigger
) -> None:
    # Given a worker, a good payment, the poison message, and another good payment
    async with running_worker(settings, quoting_router()) as worker:
        channel = await amqp.channel(publisher_confirms=True)
        await publish(channel, settings, payment("before"), key="k-before")
        await publish(
            channel,
            settings,
            trigger.body,
            key="k-poison",
            message_id=trigger.message_id,
            routing_key=trigger.routing_key,
            headers=trigger.headers,
        )
        await publish(channel, settings, payment("after"), key="k-after")

        # When it has handled all three
        async def settled() -> bool:
            return worker.stats[Count.DEAD_LETTERED] >= 1 and worker.stats[Count.PROCESSED] >= 4

        await wait_until(settled)
        await wait_until(lambda: _empty(settings.queue))
        await stays_quiet(worker, settings)

        # Then the poison is parked exactly once, with its reason
        parked = await dead_letters(channel, settings)
    assert [m.headers["x-worker-reason"] for m in parked] == [trigger.reason]
    assert worker.stats[f"dead_lettered:{trigger.reason}"] == 1
    # and both good payments took effect once (each emitted one event, handled in turn)
    ledger = await rows(engine, "SELECT payment_id FROM ledger_entries ORDER BY payment_id")
    assert [r.payment_id for r in ledger] == ["after", "before"]
    if trigger.reason == "handler-error":
        [row] = await rows(
            engine, "SELECT status, error, attempts FROM inbox WHERE key = 'k-poison'"
        )
        assert row.status == "failed"
        assert "\x00" not in row.error
        assert 1 <= row.attempts <= MAX_ATTEMPTS
        assert "\x00" not in parked[0].headers["x-worker-error"]


async def _empty(queue: str) -> bool:
    return await broker_depth(queue) == 0


@pytest.fixture
async def failures_unrecordable(engine: AsyncEngine) -> AsyncIterator[None]:
    """A trigger that makes recording any key as failed raise (the database refuses the row)."""
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "CREATE FUNCTION refuse_failed() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                "RAISE EXCEPTION 'no failed rows today'; END $$"
            )
        )
        await conn.execute(
            text(
                "CREATE TRIGGER refuse_failed BEFORE INSERT OR UPDATE ON inbox FOR EACH ROW "
                "WHEN (NEW.status = 'failed') EXECUTE FUNCTION refuse_failed()"
            )
        )
    try:
        yield
    finally:
        async with engine.begin() as conn:
            await conn.execute(text("DROP TRIGGER refuse_failed ON inbox"))
            await conn.execute(text("DROP FUNCTION refuse_failed()"))


@pytest.mark.usefixtures("failures_unrecordable")
async def test_parking_ends_even_when_the_failure_cannot_be_recorded(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given a handler error whose key the database refuses to record as failed
    async with running_worker(settings, quoting_router()) as worker:
        channel = await amqp.channel(publisher_confirms=True)
        await publish(channel, settings, {"text": "x"}, key="k-unrecorded", routing_key="quote")

        # When it is parked
        await wait_until(lambda: _at_least(worker, "dead_lettered", 1))
        await wait_until(lambda: _empty(settings.queue))
        await stays_quiet(worker, settings)
        parked = await dead_letters(channel, settings)

    # Then the DLQ copy is the record: parked once, acked, and no inbox row
    assert [m.headers["x-worker-reason"] for m in parked] == ["handler-error"]
    assert await scalar(engine, "SELECT count(*) FROM inbox") == 0


async def _at_least(worker: RunningWorker, name: str, count: int) -> bool:
    return worker.stats[name] >= count


async def test_a_missing_table_pauses_consumption_and_resumes_once_it_exists(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given a handler whose table was never created (its migration was not applied)
    router = Router()

    @router.handler("audit.recorded")
    async def record(body: dict[str, Any], ctx: Context) -> None:
        await ctx.connection.execute(
            text("INSERT INTO audit_entries (key) VALUES (:key)"), {"key": ctx.key}
        )

    async with engine.begin() as conn:
        await conn.execute(text("DROP TABLE IF EXISTS audit_entries"))
    settings = with_endpoint(settings.replace(failure_throttle_after=0))
    async with running_worker(settings, router) as worker:
        channel = await amqp.channel(publisher_confirms=True)
        for n in range(5):
            await publish(
                channel, settings, {"n": n}, key=f"k-audit-{n}", routing_key="audit.recorded"
            )

        # When the handler meets the missing table, consumption pauses: nothing is parked and
        # no key is marked failed, and the messages wait in the queue
        await wait_until(lambda: _at_least(worker, "paused", 1))

        async def reported() -> bool:
            return (await healthz(settings)).get("paused") == "deployment"

        await wait_until(reported)  # (the monitor probes every few seconds)
        health = await healthz(settings)
        assert health["status"] == "failing", health
        assert "audit_entries" in str(health.get("paused_because")), health
        assert worker.stats[Count.DEAD_LETTERED] == 0
        assert await scalar(engine, "SELECT count(*) FROM inbox WHERE status = 'failed'") == 0
        assert await broker_depth(settings.dead_letter_queue) == 0

        # Then once the table exists, the worker resumes by itself and applies each message once
        async with engine.begin() as conn:
            await conn.execute(text("CREATE TABLE audit_entries (key text PRIMARY KEY)"))
        try:
            await wait_until(lambda: _at_least(worker, "processed", 5), timeout=60)
            await wait_until(lambda: _empty(settings.queue))
        finally:
            keys = await rows(engine, "SELECT key FROM audit_entries ORDER BY key")
            async with engine.begin() as conn:
                await conn.execute(text("DROP TABLE audit_entries"))
    assert [r.key for r in keys] == [f"k-audit-{n}" for n in range(5)]
    assert worker.stats[Count.DEAD_LETTERED] == 0


def with_endpoint(settings: Settings) -> Settings:
    """``settings`` with ``/healthz`` and ``/metrics`` on a free local port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return settings.replace(http_host="127.0.0.1", http_port=port)


async def healthz(settings: Settings) -> dict[str, Any]:
    """The worker's ``/healthz`` JSON, whatever its status code."""
    return json.loads(await _get(settings, "/healthz"))


async def throttled_gauge(settings: Settings) -> float:
    """``worker_consumer_throttled`` as ``/metrics`` shows it."""
    for line in (await _get(settings, "/metrics")).splitlines():
        if line.startswith("worker_consumer_throttled "):
            return float(line.split()[1])
    raise AssertionError("worker_consumer_throttled not in /metrics")


async def _get(settings: Settings, path: str) -> str:
    def get() -> str:
        url = f"http://127.0.0.1:{settings.http_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return str(response.read().decode())
        except urllib.error.HTTPError as error:
            return str(error.read().decode())

    return await asyncio.to_thread(get)


async def test_a_deleted_dead_letter_queue_pauses_instead_of_losing_or_cycling(
    settings: Settings, amqp: AbstractRobustConnection
) -> None:
    # Given a running worker whose dead-letter queue an operator deleted
    settings = settings.replace(failure_throttle_after=0)
    async with running_worker(settings, quoting_router()) as worker:
        channel = await amqp.channel(publisher_confirms=True)
        await channel.queue_delete(settings.dead_letter_queue)

        # When a message must be parked
        await publish(channel, settings, {"text": "x"}, key="k-no-dlq", routing_key="quote")

        # Then consumption pauses (the copy has nowhere to go) and, declaring the topology
        # again, parks it once on resuming
        await wait_until(lambda: _at_least(worker, "paused", 1))
        await wait_until(lambda: _at_least(worker, "dead_lettered", 1), timeout=30)
        await wait_until(lambda: _empty(settings.queue))
        await stays_quiet(worker, settings)
        parked = await dead_letters(channel, settings)
    assert [m.headers["x-worker-reason"] for m in parked] == ["handler-error"]


async def test_consecutive_dead_letters_slow_the_worker_to_one_at_a_time(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given a worker that slows down after 3 dead letters in a row
    settings = with_endpoint(
        settings.replace(failure_throttle_after=3, failure_throttle_delay=0.05)
    )
    async with running_worker(settings, quoting_router()) as worker:
        channel = await amqp.channel(publisher_confirms=True)

        # When 8 messages in a row fail
        for n in range(8):
            await publish(
                channel, settings, {"text": str(n)}, key=f"k-bad-{n}", routing_key="quote"
            )
        await wait_until(lambda: _at_least(worker, "dead_lettered", 8))

        # Then it slowed down once, says so, and each failed message is parked once
        assert worker.stats[Count.THROTTLED] == 1
        assert (await healthz(settings))["throttled"] is True
        assert await throttled_gauge(settings) == 1

        # and one good message brings it back to full speed
        await publish(channel, settings, payment("good"), key="k-good")
        await wait_until(lambda: _at_least(worker, "processed", 1))
        assert (await healthz(settings))["throttled"] is False
        assert await throttled_gauge(settings) == 0
        parked = await dead_letters(channel, settings)
    assert sorted(m.headers["idempotency-key"] for m in parked) == [f"k-bad-{n}" for n in range(8)]


def test_the_worker_refuses_to_start_on_a_schema_behind_its_code(settings: Settings) -> None:
    # Given a database where only the worker's own migrations ran
    with empty_database(settings, prefix="worker_behind") as scratch:
        schema.upgrade(scratch, None)
        # When the worker starts with the payments module, it refuses, naming what is behind
        # and the command that fixes it
        with pytest.raises(ConfigurationError, match=r"payments not at head.*worker migrate"):
            asyncio.run(runner.run(scratch, payments, asyncio.Event()))
    # and a relay refuses a database where no migration ran at all
    with (
        empty_database(settings, prefix="worker_empty") as scratch,
        pytest.raises(ConfigurationError, match=r"worker not at head.*worker migrate"),
    ):
        asyncio.run(runner.run_relay(scratch, asyncio.Event()))


async def test_an_unchecked_exception_while_opening_is_parked_not_fatal(
    settings: Settings, amqp: AbstractRobustConnection
) -> None:
    # Given a handler whose model's validator raises something no check expects
    router = Router()

    @router.handler("touchy")
    async def touchy(body: Touchy, ctx: Context) -> None:
        return None

    router.include(payments)
    async with running_worker(settings, router) as worker:
        channel = await amqp.channel(publisher_confirms=True)
        await publish(channel, settings, {"n": 1}, key="k-touchy", routing_key="touchy")
        await publish(channel, settings, payment("fine"), key="k-fine")
        await wait_until(lambda: _at_least(worker, "dead_lettered", 1))
        await wait_until(lambda: _at_least(worker, "processed", 2))
        await stays_quiet(worker, settings)
        parked = await dead_letters(channel, settings)
    assert [m.headers["x-worker-reason"] for m in parked] == ["check-failed"]


async def test_a_copy_too_large_for_a_frame_is_dead_lettered_by_the_broker_once(
    settings: Settings,
    engine: AsyncEngine,
    amqp: AbstractRobustConnection,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given an invalid message whose headers nearly fill an AMQP frame: its DLQ copy, with the
    # x-worker headers added, would not fit, and the broker would close the whole connection
    big = {"padding": "x" * (131072 - 400)}
    async with running_worker(settings, quoting_router()) as worker:
        channel = await amqp.channel(publisher_confirms=True)
        await publish(channel, settings, {"payment_id": "bad"}, key="k-big", headers=big)
        await publish(channel, settings, payment("after-big"), key="k-after-big")

        # When the worker handles them
        await wait_until(lambda: _at_least(worker, "dead_lettered", 1))
        await wait_until(lambda: _at_least(worker, "processed", 2))
        await wait_until(lambda: _empty(settings.queue))
        await stays_quiet(worker, settings)
        parked = await dead_letters(channel, settings)

    # Then no copy was tried (none was lost with a connection the broker closed): the broker
    # dead-lettered the original, once, as it was
    assert not [r for r in caplog.records if "was lost" in r.getMessage()]
    assert worker.stats[Count.REJECTED_TO_BROKER] == 1
    assert worker.stats[dead_lettered_because(Reason.INVALID)] == 1
    assert len(parked) == 1
    assert "x-worker-reason" not in parked[0].headers
    assert parked[0].headers["padding"] == big["padding"]
    assert parked[0].headers["x-death"][0]["reason"] == "rejected"
    ledger = await rows(engine, "SELECT payment_id FROM ledger_entries")
    assert [r.payment_id for r in ledger] == ["after-big"]
