"""Workflows against the real PostgreSQL and RabbitMQ: steps in their own transactions, resumed
after a failure at the next step, never run twice, never run beside a live owner, taken over
when the owner's lease expired."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest
from aio_pika.abc import AbstractRobustConnection
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.helpers import envelope, rows, scalar, wait_until
from tests.integration.support import dead_letters, publish, running_worker, settled
from worker import Context, Permanent, Retryable, Router, Workflow, WorkflowBusy
from worker.core import workflows
from worker.core.config import UnitOfWorkConfig
from worker.core.outcomes import Outcome
from worker.errors import HandlerFailed
from worker.ops import dlq
from worker.settings import Settings
from worker.telemetry import Count

ROUTING_KEY = "trip.booked"
STEPS = ("book_flight", "book_hotel", "send_itinerary")


class Script:
    """Failures to inject: step name -> what to raise the first times it runs."""

    def __init__(self, **failures: list[str]) -> None:
        self.failures = {step: list(plan) for step, plan in failures.items()}
        self.gate: asyncio.Event | None = None


def trip_router(script: Script) -> Router:
    """A three-step workflow; each step calls a fake external service with its step key."""
    router = Router()

    async def external_call(ctx: Context, step: str) -> dict[str, Any]:
        # the fake external service records every call on a connection of its own: a record
        # survives the caller's rollback, as a real remote call would
        async with ctx.connection.engine.begin() as conn:
            await conn.execute(
                text("INSERT INTO external_calls (step_key, step) VALUES (:k, :s)"),
                {"k": ctx.step_key, "s": step},
            )
        await ctx.connection.execute(
            text("INSERT INTO step_effects (key, step) VALUES (:k, :s)"), {"k": ctx.key, "s": step}
        )
        if step == "book_flight" and script.gate is not None:
            await script.gate.wait()
        plan = script.failures.get(step, [])
        action = plan.pop(0) if plan else "ok"
        if action == "retryable":
            raise Retryable(f"{step}: the provider is busy")
        if action == "permanent":
            raise Permanent(f"{step}: refused")
        if step == "send_itinerary":
            ctx.publish("trip.itinerary", {"key": ctx.key})
        return {"step": step, "ref": ctx.step_key}

    @router.workflow(ROUTING_KEY)
    async def book_trip(body: dict[str, Any], wf: Workflow) -> dict[str, Any]:
        refs = [(await wf.step(step, external_call, step))["ref"] for step in STEPS]
        return {"refs": refs}

    return router


@pytest.fixture(autouse=True)
async def trip_tables(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "CREATE TABLE IF NOT EXISTS external_calls "
                "(id bigserial PRIMARY KEY, step_key text NOT NULL, step text NOT NULL)"
            )
        )
        await conn.execute(
            text(
                "CREATE TABLE IF NOT EXISTS step_effects "
                "(key text, step text, PRIMARY KEY (key, step))"
            )
        )
        await conn.execute(text("TRUNCATE external_calls, step_effects"))


async def calls_per_step_key(engine: AsyncEngine) -> dict[str, int]:
    found = await rows(engine, "SELECT step_key, count(*) FROM external_calls GROUP BY step_key")
    return {key: count for key, count in found}


@pytest.mark.parametrize("failing_step", STEPS)
async def test_a_failure_after_a_step_resumes_at_the_next_one(
    settings: Settings,
    engine: AsyncEngine,
    amqp: AbstractRobustConnection,
    failing_step: str,
) -> None:
    # Given a step that fails permanently the first time, after the steps before it committed
    script = Script(**{failing_step: ["permanent"]})
    key = f"trip-{failing_step}"
    async with running_worker(settings, trip_router(script)) as worker:
        channel = await amqp.channel(publisher_confirms=True)
        await publish(channel, settings, {"to": "Lisbon"}, key=key, routing_key=ROUTING_KEY)
        await settled(worker, dead_lettered=1)

        # Then the key is failed, at the last committed step
        done = STEPS[: STEPS.index(failing_step)]
        status, point = (await rows(engine, "SELECT status, recovery_point FROM inbox"))[0]
        assert (status, point) == ("failed", done[-1] if done else None)

        # When the message is replayed
        assert len(await dlq.replay(amqp, engine, settings)) == 1
        await settled(worker, processed=1)

    # Then it resumed at the failed step: every external call was made once per step key,
    # except the failed step's, which was made again under the same key
    expected = {f"{key}:{step}": 1 for step in STEPS}
    expected[f"{key}:{failing_step}"] = 2
    assert await calls_per_step_key(engine) == expected
    assert await scalar(engine, "SELECT count(*) FROM step_effects") == 3
    status, result = (await rows(engine, "SELECT status, result FROM inbox"))[0]
    assert status == "completed"
    assert result == {"refs": [f"{key}:{step}" for step in STEPS]}
    assert await scalar(engine, "SELECT count(*) FROM workflow_steps") == 3


async def test_a_transient_failure_in_a_step_resumes_through_a_delayed_retry(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    settings = settings.replace(transient_attempts=1)
    script = Script(book_hotel=["retryable"])
    async with running_worker(settings, trip_router(script)) as worker:
        channel = await amqp.channel(publisher_confirms=True)
        await publish(channel, settings, {}, key="trip-t", routing_key=ROUTING_KEY)
        await settled(worker, processed=1)

    assert worker.stats[Count.RETRY_SCHEDULED] == 1
    assert await calls_per_step_key(engine) == {
        "trip-t:book_flight": 1,
        "trip-t:book_hotel": 2,
        "trip-t:send_itinerary": 1,
    }


async def test_a_concurrent_duplicate_never_runs_a_step_beside_the_owner(
    settings: Settings, engine: AsyncEngine, amqp: AbstractRobustConnection
) -> None:
    # Given a workflow whose first step is held open
    script = Script()
    script.gate = asyncio.Event()
    async with running_worker(settings, trip_router(script)) as worker:
        channel = await amqp.channel(publisher_confirms=True)
        await publish(channel, settings, {}, key="trip-dup", routing_key=ROUTING_KEY)

        async def first_step_running() -> bool:
            return bool(await scalar(engine, "SELECT count(*) FROM external_calls"))

        await wait_until(first_step_running)

        # When a duplicate arrives meanwhile, it is turned away (and retried later)
        await publish(channel, settings, {}, key="trip-dup", routing_key=ROUTING_KEY)
        await settled(worker, retry_scheduled=1)
        script.gate.set()

        # Then the owner finishes and the duplicate, retried, is acked without work
        await settled(worker, processed=1, duplicate=1)

    assert await calls_per_step_key(engine) == {f"trip-dup:{step}": 1 for step in STEPS}
    assert await dead_letters(channel, settings) == []


async def test_a_live_lease_is_respected_and_an_expired_one_taken_over(
    settings: Settings, engine: AsyncEngine
) -> None:
    # Given a workflow that a delivery owns, its first step committed
    script = Script()
    router = trip_router(script)
    trip = envelope(router, ROUTING_KEY, {"to": "Porto"}, "trip-lease")
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO inbox (handler, key, fingerprint, status, routing_key, owner, "
                "lease_until, recovery_point) VALUES (:h, :k, :f, 'in_progress', :r, 'other', "
                "now() + interval '1 minute', 'book_flight')"
            ),
            {"h": trip.handler.name, "k": trip.key, "f": trip.fingerprint, "r": ROUTING_KEY},
        )
        await conn.execute(
            text(
                "INSERT INTO workflow_steps (handler, key, step, position, output) "
                "VALUES (:h, :k, 'book_flight', 1, :o)"
            ),
            {"h": trip.handler.name, "k": trip.key, "o": '{"ref": "trip-lease:book_flight"}'},
        )

    async def run() -> Outcome:
        return await workflows.run(engine, trip, UnitOfWorkConfig(exchange=settings.exchange))

    # When another delivery runs it while the lease is live, it is refused and runs nothing
    with pytest.raises(WorkflowBusy):
        await run()
    assert await calls_per_step_key(engine) == {}

    # When the lease has expired (moved back in SQL), the next delivery takes over and resumes
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE inbox SET lease_until = now() - interval '1 second'"))
    assert await run() == Outcome.PROCESSED
    assert await calls_per_step_key(engine) == {
        "trip-lease:book_hotel": 1,
        "trip-lease:send_itinerary": 1,
    }
    status, attempts, owner = (await rows(engine, "SELECT status, attempts, owner FROM inbox"))[0]
    assert (status, attempts, owner) == ("completed", 2, None)

    # And a duplicate of the completed workflow is acked without work
    assert await run() == Outcome.DUPLICATE


async def test_a_step_being_committed_is_not_taken_over_even_with_an_expired_lease(
    settings: Settings, engine: AsyncEngine
) -> None:
    # Given an owner inside a step's transaction (its inbox row locked), its lease expired
    script = Script()
    trip = envelope(trip_router(script), ROUTING_KEY, {}, "trip-locked")
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO inbox (handler, key, fingerprint, status, routing_key, owner, "
                "lease_until) VALUES (:h, :k, :f, 'in_progress', :r, 'owner', "
                "now() - interval '1 second')"
            ),
            {"h": trip.handler.name, "k": trip.key, "f": trip.fingerprint, "r": ROUTING_KEY},
        )
    holder = await asyncpg.connect(settings.database_url)
    try:
        transaction = holder.transaction()
        await transaction.start()
        await holder.execute("SELECT 1 FROM inbox WHERE key = 'trip-locked' FOR UPDATE")

        # Then a delivery does not wait for it and does not take it over
        with pytest.raises(WorkflowBusy):
            await asyncio.wait_for(
                workflows.run(engine, trip, UnitOfWorkConfig(exchange=settings.exchange)), 10
            )
        await transaction.rollback()
    finally:
        await holder.close()
    assert await scalar(engine, "SELECT owner FROM inbox") == "owner"
    assert await calls_per_step_key(engine) == {}


async def test_a_step_name_used_twice_fails_the_workflow(
    settings: Settings, engine: AsyncEngine
) -> None:
    router = Router()

    async def noop(ctx: Context) -> None:
        return None

    @router.workflow("twice")
    async def twice(body: Any, wf: Workflow) -> None:
        await wf.step("a", noop)
        await wf.step("a", noop)

    with pytest.raises(HandlerFailed, match="called twice"):
        await workflows.run(
            engine, envelope(router, "twice", {}, "k-twice"), UnitOfWorkConfig(exchange="x")
        )
    assert await scalar(engine, "SELECT owner FROM inbox WHERE key = 'k-twice'") is None
